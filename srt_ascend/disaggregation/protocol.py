"""What the two servers of a disaggregated pair tell each other, and the scheduler messages
that carry it. The registration and its answer travel as JSON over the prefill server's
bootstrap endpoint; the KV and the MTP hidden state travel through the transfer engine."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

# sglang-router's request fields (it adds them to the body it sends to both servers)
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class BootstrapError(ValueError):
    """A request's bootstrap fields are missing or malformed (HTTP 400)."""


@dataclass(frozen=True)
class BootstrapInfo:
    """Where a request's prefill server is, and the room that pairs its two halves."""

    host: str
    port: int
    room: int

    @classmethod
    def from_fields(cls, host: Any, port: Any, room: Any) -> BootstrapInfo | None:
        """The fields as sglang-router sends them; None when all are absent; BootstrapError
        naming the first that is missing or of the wrong type."""
        if host is None and port is None and room is None:
            return None
        if not isinstance(host, str) or not host:
            raise BootstrapError("bootstrap_host must be a non-empty string")
        for name, value in (("bootstrap_port", port), ("bootstrap_room", room)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise BootstrapError(f"{name} must be an integer, got {value!r}")
        if not 1 <= port <= 65535:
            raise BootstrapError(f"bootstrap_port must be in [1, 65535], got {port}")
        if room < 0:
            raise BootstrapError(f"bootstrap_room must be >= 0, got {room}")
        return cls(host, port, room)

    @classmethod
    def per_generation(
        cls, host: Any, port: Any, room: Any, prompts: int, n: int
    ) -> list[BootstrapInfo] | None:
        """One BootstrapInfo per generation of a request with `prompts` prompts and `n`
        samples each (prompt-major), from the fields as sglang-router sends them; None when
        all are absent. Each field is one value or a list: sglang-router sends one room for a
        prompt with `n` > 1 on /generate and /v1/completions (generation i gets room + i, as
        SGLang's GenerateReqInput spreads it), one per prompt for a batch, and one per
        choice for chat with `n` > 1; a list with one entry per prompt gives sample j of
        prompt i room[i] + j. Both servers spread the fields alike, so each generation pairs
        with the same one on the other server. BootstrapError for a malformed field, a list
        of another length or rooms that collide."""
        if host is None and port is None and room is None:
            return None
        count = prompts * n

        def spread(name: str, value: Any, offset: bool) -> list:
            if not isinstance(value, list):
                step = offset and isinstance(value, int) and not isinstance(value, bool)
                return [value + i if step else value for i in range(count)]
            if len(value) == count:
                return list(value)
            if len(value) == prompts:
                step = offset and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                return [v + j if step else v for v in value for j in range(n)]
            raise BootstrapError(
                f"{name} has {len(value)} entries; the request has {prompts} prompt(s) with "
                f"n = {n} each"
            )

        fields = zip(
            spread("bootstrap_host", host, False),
            spread("bootstrap_port", port, False),
            spread("bootstrap_room", room, True),
        )
        infos = [cls.from_fields(h, p, r) for h, p, r in fields]
        if any(i is None for i in infos):
            raise BootstrapError("bootstrap_room must be an integer, got None")
        if len({i.room for i in infos}) != count:
            raise BootstrapError("the request's generations must have distinct bootstrap_rooms")
        return infos


def prompt_digest(ids: list[int]) -> str:
    """A short digest of a prompt's token ids: both servers must have tokenized alike."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]


@dataclass
class KVDestination:
    """Decode -> prefill: where request `room`'s KV goes in the decode server's pool.

    `buffers[i]` is the address of KV buffer i (the pool's buffers in layer order, main
    layers first, then MTP layers: `num_main` of them are the main model's), a slot's row in
    it `row_bytes[i]` long; `slots[p]` is the decode slot of prompt position p. With MTP on
    the decode server, `hidden_addr` / `probs_addr` are where the first draft's hidden state
    [hidden bytes] and its distribution [probs bytes] go (0: no MTP).

    A decode server with --tp-size N > 1 has N pools, one per rank process, each with the
    whole latent KV and its own transfer engine: those fields are rank 0's, and `peers` holds
    ranks 1..N-1's {"session", "buffers", "hidden_addr", "probs_addr"} (the same slots, row
    sizes and staging sizes on every rank). The prefill server writes every rank's copy."""

    room: int
    session: str  # the decode server's transfer-engine session ("host:rpc_port")
    prompt_len: int
    digest: str  # prompt_digest of the decode server's tokens
    slots: list[int]
    buffers: list[int]
    row_bytes: list[int]
    num_main: int
    hidden_addr: int = 0
    hidden_bytes: int = 0
    probs_addr: int = 0
    probs_bytes: int = 0
    peers: list[dict] = field(default_factory=list)

    def targets(self) -> list[tuple[str, list[int], int, int]]:
        """(session, buffers, hidden_addr, probs_addr) of every decode rank, rank 0 first."""
        first = (self.session, self.buffers, self.hidden_addr, self.probs_addr)
        rest = [(p["session"], p["buffers"], p["hidden_addr"], p["probs_addr"]) for p in self.peers]
        return [first, *rest]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Any) -> KVDestination:
        """Raises ValueError for a body that is not a destination."""
        if not isinstance(body, dict):
            raise ValueError("the registration must be a JSON object")
        try:
            dest = cls(**body)
        except TypeError as e:
            raise ValueError(f"bad registration: {e}") from None
        ints = [dest.room, dest.prompt_len, dest.num_main, dest.hidden_addr, dest.hidden_bytes]
        ints += [dest.probs_addr, dest.probs_bytes, *dest.slots, *dest.buffers, *dest.row_bytes]
        if not all(isinstance(v, int) and v >= 0 for v in ints):
            raise ValueError("bad registration: fields must be non-negative integers")
        if len(dest.slots) != dest.prompt_len or len(dest.buffers) != len(dest.row_bytes):
            raise ValueError("bad registration: slots or buffers of the wrong length")
        keys = {"session", "buffers", "hidden_addr", "probs_addr"}
        for p in dest.peers:
            if (
                not isinstance(p, dict)
                or set(p) != keys
                or not isinstance(p["session"], str)
                or not isinstance(p["buffers"], list)
            ):
                raise ValueError(f"bad registration: a peer must have exactly {sorted(keys)}")
            addrs = [p["hidden_addr"], p["probs_addr"], *p["buffers"]]
            if not all(isinstance(v, int) and v >= 0 for v in addrs):
                raise ValueError("bad registration: peer addresses must be non-negative integers")
            if len(p["buffers"]) != len(dest.buffers) or (p["hidden_addr"] > 0) != (
                dest.hidden_addr > 0
            ):
                raise ValueError("bad registration: the decode ranks' pools differ")
        return dest


@dataclass
class KVResult:
    """Prefill -> decode, the answer to a registration: the KV is written (then the first
    tokens, their logprobs, and with MTP the first draft d_1), or why not."""

    ok: bool
    error: str = ""
    tokens: list[int] = field(default_factory=list)  # committed on the prefill server
    # TokenLogprobs of `tokens` as lists: {"chosen": [...], "top": [...], "ids": [...]}
    logprobs: dict | None = None
    cached_tokens: int = 0  # the prefill server's radix-cache hit
    draft_token: int | None = None  # d_1 (MTP); its hidden state (and probs) were written
    draft_probs: bool = False  # whether d_1's distribution was written (a sampled draft)
    # the prompt's logprobs, as the decode server reports them (the prefill server's own
    # answer has none: sglang-router would prepend them to the decode server's)
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict) -> KVResult:
        return cls(**body)


# ---- scheduler messages (through the scheduler's inbox, so they run in its thread) -----------


@dataclass
class DestinationArrived:
    """Prefill side: a decode server registered `dest` at the bootstrap endpoint."""

    dest: KVDestination


@dataclass
class RoomCancelled:
    """Prefill side: the decode server gave up room `room` (its request was aborted)."""

    room: int


@dataclass
class RoomExpired:
    """Prefill side: room `room` waited past --disaggregation-timeout (the leader decides, so
    that every tensor-parallel rank ends it at the same point)."""

    room: int


@dataclass
class TransferDone:
    """Prefill side: room `room`'s KV transfer ended (error None: every write done; else why
    not). The leader's transfer thread sends it; every rank ends the request on it."""

    room: int
    error: str | None


@dataclass
class KVLate:
    """Decode side: request `rid`'s prefill server has not answered in 4 x
    --disaggregation-timeout: the request ends for its client; its row and slots stay held
    (a hung prefill server could still write into them) until the answer comes or the
    registration's connection breaks (the prefill server is gone)."""

    rid: str
    message: str


@dataclass
class KVArrived:
    """Decode side: the prefill server answered request `rid`'s registration (or the
    registration failed: `result.ok` False)."""

    rid: str
    result: KVResult
