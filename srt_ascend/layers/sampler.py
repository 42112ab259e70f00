"""Token sampling: processed distributions, seeded draws, and logprobs.

`processed_probs` is the one definition of "the distribution a request samples from"; the
speculative rejection test (speculative/acceptance.py) applies it to both the target and the
draft logits, so it is row-wise, deterministic and vectorised. Randomness enters only through
`draw_uniforms`, one row per request, from the request's own generator when it is seeded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from srt_ascend.layers.linear import sum_last
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import FLOAT32_MAX
from srt_ascend.utils import HOST_READS, to_device

# SGLang's switch: output logprobs of the logits before the temperature (the model's own)
RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in (
    "1",
    "true",
    "yes",
)


def over_temperature(
    logits: torch.Tensor,  # [B, V] float32
    temperatures: torch.Tensor | None,  # [B, 1] (None: the logits as given)
) -> torch.Tensor:  # [B, V] float32, no +inf
    """logits / T with +inf held at float32's largest value.

    Rule: a logit that overflows float32 (a logit_bias past its range, or a large logit over
    a small T) is the most likely token by far, not a NaN: a softmax over +inf gives NaN for
    every token. -inf (a masked token) stays -inf.
    """
    if temperatures is None:
        return logits.clamp(max=FLOAT32_MAX)
    return (logits / temperatures).clamp_(max=FLOAT32_MAX)  # the quotient is ours to clamp


def draw_uniforms(
    generators: Sequence[torch.Generator | None],  # [B]
    num: int,
    device: torch.device | str,
) -> torch.Tensor:  # [B, num] float32 in (0, 1]
    """Uniform draws in (0, 1], `num` per row.

    Rule: a row with a generator draws its `num` numbers from that generator alone, so its
    values do not depend on the other rows of the batch; the other rows share one draw from
    the global RNG. The interval excludes 0 so that `u * p <= q` never accepts q == 0 and
    inverse-CDF sampling never lands on a zero-probability token.
    """
    u = torch.rand(len(generators), num, device=device)
    seeded = [row for row, g in enumerate(generators) if g is not None]
    if seeded:  # host generators: the same numbers on every device, copied over async
        host = torch.stack([torch.rand(num, generator=generators[row]) for row in seeded])
        u[to_device(seeded, device)] = to_device(host, device, torch.float32)
    return 1.0 - u


def uniforms_among(
    candidates: Sequence[torch.Tensor | None],  # [B]: each row's [C, num] host draws, or None
    pick: torch.Tensor,  # [B] int64 on the device: the candidate each row takes
    num: int,
) -> torch.Tensor:  # [B, num] float32 in (0, 1]
    """`draw_uniforms` for rows whose generator only the device knows, as one of C candidates
    (as many for every row that has them): a row's candidates are what each generator draws
    (`torch.rand(num, generator=g)`, on the host) and `pick` chooses among them on the
    device; rows without candidates (None) share one draw from the global RNG."""
    device = pick.device
    u = torch.rand(len(candidates), num, device=device)
    seeded = [row for row, c in enumerate(candidates) if c is not None]
    if seeded:
        host = torch.stack([candidates[row] for row in seeded])  # [S, C, num]
        rows = to_device(seeded, device)
        at = pick.index_select(0, rows).view(-1, 1, 1).expand(-1, 1, num)
        picked = to_device(host, device, torch.float32).gather(1, at).squeeze(1)
        u = u.index_copy(0, rows, picked)
    return 1.0 - u


def inverse_cdf_sample(
    probs: torch.Tensor,  # [B, V] non-negative, each row with positive mass
    uniforms: torch.Tensor,  # [B] in (0, 1]
) -> torch.Tensor:  # [B] int64
    """Sample one token per row by inverting the CDF: the first v with cdf(v) >= u * cdf(V-1).

    Rows need not be normalised. With u in (0, 1] a zero-probability token is never chosen,
    and a one-hot row always returns its hot index.
    """
    cdf = probs.to(torch.float32).cumsum(dim=-1)
    threshold = (uniforms.to(torch.float32) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    token = torch.searchsorted(cdf, threshold).squeeze(-1)
    return token.clamp_(max=probs.shape[-1] - 1)


def processed_probs(
    logits: torch.Tensor,  # [B, V]
    info: SamplingBatchInfo,
) -> torch.Tensor:  # [B, V] float32, rows sum to 1
    """The distribution each row samples from.

    Rule: p = softmax(logits / temperature). Token v is kept iff
    - its rank in p (descending, ties by lower index first) is < top_k, and
    - the mass of the tokens ranked above it is < top_p (top_p == 1 keeps all), and
    - p(v) >= min_p * max(p).
    Dropped tokens get 0 and the row is renormalised; the top-ranked token is always kept
    (also where float32 rounds top_p to 0, as 1e-46).
    All three conditions read the same temperature-scaled p (SGLang's torch-native order).
    Greedy rows (top_k == 1) are exactly one-hot at argmax(logits) (first index on ties).
    """
    logits = logits.to(torch.float32)
    vocab = logits.shape[-1]
    if info.is_all_greedy:
        return nn.functional.one_hot(logits.argmax(dim=-1), vocab).to(torch.float32)
    probs = torch.softmax(over_temperature(logits, info.temperatures), dim=-1)
    keep = None
    if info.need_top_p_top_k:
        keep = top_k_top_p_keep_mask(probs, info.top_ks, info.top_ps)
    if info.need_min_p:
        min_p_keep = probs >= probs.amax(dim=-1, keepdim=True) * info.min_ps.view(-1, 1)
        keep = min_p_keep if keep is None else keep & min_p_keep
    if keep is None:
        return probs
    probs = probs.masked_fill(~keep, 0.0)
    probs = probs / sum_last(probs)  # batch-invariant on CUDA in deterministic mode
    if info.need_top_p_top_k:
        # Pin greedy rows to argmax(logits) so they agree bit-for-bit with an all-greedy batch.
        greedy = nn.functional.one_hot(logits.argmax(dim=-1), vocab).to(torch.float32)
        probs = torch.where(info.is_greedy.view(-1, 1), greedy, probs)
    return probs


def top_k_top_p_keep_mask(
    probs: torch.Tensor,  # [B, V] normalised
    top_ks: torch.Tensor,  # [B] int64 >= 1
    top_ps: torch.Tensor,  # [B] float32 in (0, 1]
) -> torch.Tensor:  # [B, V] bool
    """Mask of tokens with rank < top_k and (mass ranked above them < top_p or top_p >= 1
    or rank 0: the mass above the top token is 0, not below a top_p that float32 made 0).

    Ranks come from a stable descending sort, so equal probabilities rank by token index.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_ps = top_ps.view(-1, 1)
    in_top_p = (mass_above < top_ps) | (top_ps >= 1.0) | (ranks == 0)
    keep_sorted = (ranks < top_ks.view(-1, 1)) & in_top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def sample_from_probs(
    probs: torch.Tensor,  # [B, V] from processed_probs
    info: SamplingBatchInfo,
    uniforms: torch.Tensor | None = None,  # [B] in (0, 1]; None: drawn here
) -> torch.Tensor:  # [B] int64
    """One token per row: argmax for greedy rows, otherwise a multinomial draw by inverse CDF
    with `uniforms`, or uniforms from `draw_uniforms(info.generators)` (seeded rows are
    batch-independent)."""
    if info.is_all_greedy:
        return probs.argmax(dim=-1)
    if uniforms is None:
        uniforms = draw_uniforms(info.generators, 1, probs.device)[:, 0]
    sampled = inverse_cdf_sample(probs, uniforms)
    return torch.where(info.is_greedy, probs.argmax(dim=-1), sampled)


TopLogprobs = list[tuple[float, int]]  # (logprob, token id), descending


@dataclass
class TokenLogprobs:
    """Logprobs reported for consecutive rows (tokens), on the host."""

    chosen: list[float]  # the chosen token's logprob per row
    top: list[TopLogprobs]  # the top list per row ([] where none was asked)
    ids: list[list[float]]  # per row, the logprobs of the token ids asked for ([] where none)

    def rows(self, lo: int, hi: int) -> TokenLogprobs:
        return TokenLogprobs(self.chosen[lo:hi], self.top[lo:hi], self.ids[lo:hi])


def token_logprobs(
    logits: torch.Tensor,  # [N, V]: the logits the tokens were chosen from, penalties applied
    token_ids: torch.Tensor,  # [N] int64, on the logits' device
    top_nums: Sequence[int],  # [N] top logprobs wanted per row (0: none)
    ids_wanted: Sequence[Sequence[int]] | None = None,  # [N] token ids whose logprobs are asked
    temperatures: torch.Tensor | None = None,  # [N, 1] float32 (None: the logits as given)
) -> TokenLogprobs:
    """The logprobs every path reports (decode, prompt, speculative verify), in one host read.

    Rule (SGLang's sampler): log_softmax of the logits after repetition / frequency /
    presence penalties and the min-new-tokens mask, divided by the row's temperature (1 for
    a greedy row; `output_temperatures`), before top-k / top-p / min-p; prompt positions
    take no temperature. SGLANG_RETURN_ORIGINAL_LOGPROB=1 (SGLang's switch) drops the
    temperature. A masked token's -inf is reported as float32's lowest value (SGLang's clamp:
    JSON has no -inf); +inf logits as `over_temperature`. Row n's top list has
    min(top_nums[n], V) entries, descending; [] where 0. Row n's `ids` are the logprobs of
    ids_wanted[n] in the order asked (token_ids_logprob)."""
    logits = logits.to(torch.float32)
    scale = None if RETURN_ORIGINAL_LOGPROB else temperatures
    logprobs = torch.log_softmax(over_temperature(logits, scale), dim=-1).clamp(min=-FLOAT32_MAX)
    n_rows = logits.shape[0]
    ids_wanted = ids_wanted or [()] * n_rows
    parts = [_gather(logprobs, token_ids).view(-1, 1).double()]
    k = min(max(top_nums, default=0), logprobs.shape[-1])
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        parts += [values.double(), ids.double()]  # ids are exact in float64
    m = max((len(w) for w in ids_wanted), default=0)
    if m > 0:
        asked = to_device([list(w) + [0] * (m - len(w)) for w in ids_wanted], logits.device)
        parts.append(logprobs.gather(-1, asked).double())
    rows = HOST_READS.read(torch.cat(parts, 1))  # [N, 1 (+ 2k) (+ m)]
    at = 1 + 2 * k if k > 0 else 1
    return TokenLogprobs(
        [row[0] for row in rows],
        [
            [(v, int(i)) for v, i in zip(row[1 : 1 + n], row[1 + k : 1 + k + n])]
            for row, n in zip(rows, top_nums)
        ],
        [row[at : at + len(w)] for row, w in zip(rows, ids_wanted)],
    )


def _gather(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, token_ids.view(-1, 1).to(torch.int64)).squeeze(-1)


@dataclass
class SamplerOutput:
    """Result of one sampling step."""

    next_token_ids: torch.Tensor  # [B] int64 on the logits' device
    logprobs: TokenLogprobs | None = None  # when asked


class Sampler(nn.Module):
    """Chooses the next token of every row. Penalties and min-new-tokens masks are applied by
    the caller beforehand (sampling/penalties.py); the input logits are not modified."""

    def forward(
        self,
        logits: torch.Tensor,  # [B, V]
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Sequence[int] | None = None,  # [B]
        ids_wanted: Sequence[Sequence[int]] | None = None,  # [B] token_ids_logprob per row
    ) -> SamplerOutput:
        """Sample next tokens; logprobs (when asked) by `token_logprobs`."""
        logits = logits.to(torch.float32)
        if info.is_all_greedy:
            next_ids = logits.argmax(dim=-1)
        else:
            next_ids = sample_from_probs(processed_probs(logits, info), info)
        if not return_logprob:
            return SamplerOutput(next_ids)
        nums = top_logprobs_nums or [0] * logits.shape[0]
        lps = token_logprobs(logits, next_ids, nums, ids_wanted, info.temperatures)
        return SamplerOutput(next_ids, lps)
