"""Per-request sampling parameters: fields and defaults follow SGLang's `SamplingParams`.

Life cycle: the tokenizer manager builds one with `SamplingParams.from_dict(request_json)`,
calls `normalize()` (canonical forms: stop as a list, greedy as top_k == 1) and then
`verify(vocab_size)`; the scheduler only ever sees normalized, verified params.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import re2

# A temperature below this is greedy decoding (SGLang's _SAMPLING_EPS).
SAMPLING_EPS = 1e-6
# float32's largest value (torch.finfo(torch.float32).max; this module imports no torch): the
# sampler divides float32 logits by the temperature and holds them within +-this.
FLOAT32_MAX = 3.4028234663852886e38
# top_k meaning "the whole vocabulary" after normalize() (SGLang's TOP_K_ALL).
TOP_K_ALL = 1 << 30

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
# The longest stop_regex pattern taken (RE2 compiles in time linear in the pattern; this keeps
# the compile on the event loop to a millisecond or so).
STOP_REGEX_MAX_CHARS = 4096
# The most stop_regex patterns a request may give (SGLang's MAX_STOP_REGEX_COUNT): each is
# searched at every step, in the scheduler's loop, so thousands stalled every request.
STOP_REGEX_MAX_COUNT = 32
# Grammar parameters (SGLang's names), in the order SGLang checks them.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops.

    `temperature == 0` means greedy; `top_k == -1` means no top-k cut; `seed` makes the
    request's random draws reproducible whatever batch it is scheduled in.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # stop once the output's tail matches one
    # token id (a string, as JSON keys are) -> added to its logit; ints after normalize()
    logit_bias: dict[str, float] | dict[int, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    no_stop_trim: bool = False
    # Constrained generation (at most one): the output must match this grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # MTP drafts per step for this request (0 = none; None = the server's choice); at most the
    # server's --speculative-num-steps (checked by the tokenizer manager, which knows it)
    speculative_num_steps: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON object.

        Unknown keys raise ValueError naming them; a key whose value is None takes the default
        (as SGLang does, so clients may send null). Values are not range-checked here: call
        `normalize()` then `verify(vocab_size)`.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"Unknown sampling parameter(s): {', '.join(unknown)}. "
                f"Supported: {', '.join(sorted(known))}."
            )
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def grammar_spec(self) -> tuple[str, str] | None:
        """(kind, source) of the grammar the output must follow, or None."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (temperature ~ 0 or top_k == 1)."""
        return 0.0 <= self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def sampling_temperature(self) -> float:
        """The temperature the logits are divided by: 1 for a greedy request, at most
        float32's largest value (a larger one is +inf in float32, and a masked token's
        -inf / inf is NaN)."""
        return 1.0 if self.is_greedy else min(float(self.temperature), FLOAT32_MAX)

    def normalize(self) -> SamplingParams:
        """Rewrite fields into canonical form, in place; idempotent; returns self.

        - `stop` and `stop_regex` become lists of strings ([] when unset); `stop_token_ids` a
          de-duplicated list of ints ([] when unset); `logit_bias` a dict of int token ids
          ({} when unset).
        - temperature in [0, 1e-6) becomes greedy: top_k = 1, temperature = 1.0 (SGLang's rule,
          so the sampler never divides by zero).
        - top_k == -1 becomes TOP_K_ALL (no cut).
        """
        self.stop = _as_list(self.stop)
        self.stop_regex = _as_list(self.stop_regex)
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        ids = self.stop_token_ids or []
        self.stop_token_ids = list(dict.fromkeys(ids))
        if 0.0 <= self.temperature < SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        return self

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError (message names the field and the bad value) if anything is invalid.

        Accepts params before or after `normalize()`.
        """
        self._verify_types()
        self._verify_sampling_ranges()
        self._verify_lengths_and_stops(vocab_size)
        self._verify_grammar()

    def _verify_types(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        for name in ("stop", "stop_regex"):
            value = getattr(self, name)
            stops = [value] if isinstance(value, str) else value
            if stops is not None and not (
                isinstance(stops, list) and all(isinstance(s, str) for s in stops)
            ):
                raise ValueError(f"{name} must be a string or a list of strings, got {value!r}.")
        ids = self.stop_token_ids
        if ids is not None and not (
            isinstance(ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}.")
        for name in ("seed", "speculative_num_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}.")

    def _verify_grammar(self) -> None:
        """At most one grammar, given as a string (whether it compiles is checked apart)."""
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in given:
            if not isinstance(getattr(self, kind), str):
                raise ValueError(f"{kind} must be a string, got {getattr(self, kind)!r}.")
        if len(given) > 1:
            raise ValueError(
                f"Only one of {', '.join(GRAMMAR_KINDS)} can be set, got {', '.join(given)}."
            )

    def _verify_sampling_ranges(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(
                f"temperature must be a non-negative finite number, got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                f"got {self.repetition_penalty}."
            )
        if self.n != 1:
            raise ValueError(
                f"n must be 1 (parallel sampling is not supported; send n requests), got {self.n}."
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}.")
        steps = self.speculative_num_steps
        if steps is not None and steps < 0:
            raise ValueError(f"speculative_num_steps must be at least 0, got {steps}.")

    def _verify_lengths_and_stops(self, vocab_size: int) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}."
            )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty.")
        # stop_token_ids outside [0, vocab_size) are accepted, as SGLang does: they never match.
        patterns = _as_list(self.stop_regex)
        if len(patterns) > STOP_REGEX_MAX_COUNT:
            raise ValueError(
                f"at most {STOP_REGEX_MAX_COUNT} stop_regex patterns are allowed, "
                f"got {len(patterns)}"
            )
        for pattern in patterns:
            compile_stop_regex(pattern)
        self._verify_logit_bias(vocab_size)

    def _verify_logit_bias(self, vocab_size: int) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be an object of token id -> bias, got {bias!r}.")
        for key, value in bias.items():
            token_id = _token_id_key(key)
            if token_id is None or not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"logit_bias keys must be token ids in [0, {vocab_size - 1}], got {key!r}."
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"logit_bias values must be finite numbers, got {value!r}.")


def _token_id_key(key: Any) -> int | None:
    """A logit_bias key as a token id: an int, or a string of ASCII digits only (JSON object
    keys are strings). None for anything else: Python's int() would also take "1_0", " 10 ",
    "+10" or other scripts' digits, which OpenAI's API does not."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> re2._Regexp:
    """`pattern` compiled with RE2, whose search time is linear in the text (no catastrophic
    backtracking can stall the scheduler); cached. ValueError (the request's 400) for a
    pattern RE2 cannot take: a syntax error, a backreference or lookaround, a pattern longer
    than STOP_REGEX_MAX_CHARS or one whose program exceeds RE2's memory budget."""
    if len(pattern) > STOP_REGEX_MAX_CHARS:
        raise ValueError(
            f"stop_regex is {len(pattern)} characters long; at most {STOP_REGEX_MAX_CHARS} "
            "are taken."
        )
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as e:
        detail = e.args[0] if e.args else str(e)
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        raise ValueError(
            f"stop_regex {pattern!r} is not a valid regex for RE2, the linear-time engine stop "
            f"regexes run on (no backreferences or lookaround): {detail}."
        ) from None


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a bad pattern is the request's 400, not a server log line
    return options


_RE2_OPTIONS = _re2_options()


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)
