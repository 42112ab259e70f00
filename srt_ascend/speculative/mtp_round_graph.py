"""One MTP round per captured graph (DESIGN section 9; issue 43 item 3).

For a batch without logprobs, grammar, penalties, logit bias nor min_new_tokens ahead, the
whole round is one graph per (K, batch bucket[, KV window]) and variant: greedy, where every
request is (`greedy_without_logprobs`: the raw argmax), else sampled (`plain_sampling`):

1. the KV slots of positions start .. start+K, gathered from req_to_token on the device;
2. draft steps 2..K (the MTP layer each step runs) from d_1 and the output that drafted it,
   each draft the argmax of its logits (sampled: drawn from its processed distribution at
   the block's uniform, speculative/round_sampling);
3. the verify forward over [t_{L-1}, d_1..d_K] (batch expansion, or the multi-query layout
   where the runner's backend serves it on the device) and its logits;
4. greedy acceptance on the device (`spec_accept.greedy_accept`, the per-row limits a static
   input; sampled: the decoder's rule, token-wise rejection sampling or block verification,
   over each position's processed distribution and the block's verify uniforms): accept
   lengths and emitted tokens;
5. the MTP pass over the 1+K positions, its inputs the emitted tokens (every later MTP layer
   a draft step runs writes its KV too), and the next chain's d_1: the argmax of layer 0's
   logits at row accept_len (sampled: drawn at the uniform of the count the round leaves,
   with its distribution an output), and the output there, gathered on the device.

The sampled variant's inputs besides the greedy ones: one float32 block (settings and the
uniforms of every count the row may have; one host->device copy), d_1's distributions, and
each row's count past the block's lowest (an overlapped round's, on the device). Its LM heads
run over every row of a kind and pick the drafting rows after, as the per-forward graphs do,
so seeded tokens equal theirs bit for bit.

Results stay in the graph's outputs; the caller reads accept_len | emitted once. Nothing in
the body reads a device value on the host: where the next chain starts is a device gather.
The forwards are the same kinds (GraphKind) the per-forward graphs capture, run through
`RoundForward` with static shapes, so a round replays the same arithmetic as the per-forward
path (verify logits over every row; the drafting heads over the rows they draft from).

Padding rows (bucket past the batch) have KV length 0, slot 0 for every write, position 0:
what the graph runner's padding is. Inputs live in static buffers sized for the largest
bucket; the platform's graph class replays (CUDA graphs, aclgraphs; on CPU an eager replay of
the same body over the same buffers, so capture, padding and replay run in every test).

Not captured (the per-forward path runs): compiled forwards (--enable-torch-compile keeps to
its compiled kinds), data-parallel attention, several ranks, a verify whose attention takes
host lengths (NPU's FIA op; off NPU the FIA layout runs its attention in tensor ops over
the device lengths, as overlapped rounds do), --disable-mtp-round-graph."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from srt_ascend.layers.ops import spec_accept
from srt_ascend.model_executor.forward_batch import ForwardBatch
from srt_ascend.model_executor.graph_runner import GraphKind, GraphRunner
from srt_ascend.sampling import static_sampling
from srt_ascend.sampling.sample_step import greedy_tokens
from srt_ascend.speculative import round_sampling
from srt_ascend.speculative.round_sampling import RowSettings
from srt_ascend.utils import to_device

if TYPE_CHECKING:
    from srt_ascend.platforms import DeviceGraph

logger = logging.getLogger(__name__)

# (fb, kind, MTP input hidden or None, rows whose logits are wanted or None: all)
# -> (output hidden, logits of those rows or None for a kind without logits)
RoundForward = Callable[
    [ForwardBatch, GraphKind, "torch.Tensor | None", "torch.Tensor | None"],
    tuple[torch.Tensor, "torch.Tensor | None"],
]


class RoundResult(NamedTuple):
    """A round's results for the batch's real rows, on the device (owned by the caller)."""

    accept_len: torch.Tensor  # [B] int64
    emitted: torch.Tensor  # [B, K+1] int64: accepted drafts, one target token, then -1
    first: torch.Tensor  # [B] int64: the next round's d_1
    first_hidden: torch.Tensor  # [B, D]: the MTP output that drafted it
    drafts: torch.Tensor  # [B, K] d_1..d_K: the chain this round verified
    first_probs: torch.Tensor | None = None  # [B, V] what d_1 was drawn from (sampled)


class RoundKinds(NamedTuple):
    """The per-forward kinds a round of K drafts runs (the decoder's, not captured again)."""

    verify: GraphKind  # the target's verify forward
    extend: GraphKind  # MTP layer 0 over the 1+K positions
    steps: dict[int, GraphKind]  # draft step j = 1..K-1
    later: list[GraphKind]  # later MTP layers over the 1+K positions (KV only)


class SampledRound(NamedTuple):
    """What a sampled round's replay copies in besides the greedy inputs."""

    block: torch.Tensor  # [bucket, columns] float32 on the host: round_sampling.host_block
    first_probs: torch.Tensor | None  # [B, V] float32, what each d_1 was drawn from (None: greedy)
    extra: torch.Tensor | None  # [B] int64 count past the block's lowest (None: 0, serial)
    filtered: bool = True  # the variant with the top-k / top-p masks (static_sampling)


class _Inputs:
    """Static inputs of every round graph (sized for the largest bucket)."""

    def __init__(self, max_bs: int, hidden: int, dtype, device) -> None:
        z = lambda: torch.zeros(max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.rows, self.starts, self.last, self.first, self.limits = z(), z(), z(), z(), z()
        self.first_hidden = torch.zeros(max_bs, hidden, dtype=dtype, device=device)
        self.live = torch.zeros(max_bs, dtype=torch.bool, device=device)


class _SampledInputs:
    """Static inputs a sampled round adds: the settings and uniforms block
    (round_sampling.host_block) and d_1's distributions."""

    def __init__(self, max_bs: int, k_max: int, vocab: int, device) -> None:
        self.block = round_sampling.padding_rows(max_bs, k_max, device)
        self.first_probs = torch.zeros(max_bs, vocab, dtype=torch.float32, device=device)
        self.extra = torch.zeros(max_bs, dtype=torch.int64, device=device)


class MTPRoundGraphs:
    """Captures and replays whole MTP rounds; built over the graph runner (its platform,
    pool, stream, buckets, KV windows and pools), after it captured its kinds."""

    def __init__(
        self,
        graphs: GraphRunner,
        forward: RoundForward,
        kinds: dict[int, RoundKinds],  # per K
        vocab: int,
        hidden_size: int,
        dtype: torch.dtype,
        accept: Callable | None = None,  # sampled rows' rule (ACCEPT_METHODS); None: greedy only
    ) -> None:
        self.g, self.forward, self.vocab = graphs, forward, vocab
        self.kinds, self.accept = kinds, accept
        self.buckets = graphs.buckets
        device = graphs.platform.device
        self.buf = _Inputs(self.buckets[-1], hidden_size, dtype, device)
        self.k_max = max(kinds)
        self.sampling = (
            None if accept is None else _SampledInputs(self.buckets[-1], self.k_max, vocab, device)
        )
        self.table = graphs.req_to_token_pool.req_to_token
        self._range = torch.arange(max(kinds) + 2, device=device)
        self.windows = {k: self._windows(k) for k in kinds}
        # (K, bucket, window, variant): None greedy, False sampled, True filtered (top-k/p)
        self.graphs: dict[tuple[int, int, int, bool | None], DeviceGraph] = {}
        self.replays: Counter[int] = Counter()  # per K
        self.sampled_replays: Counter[int] = Counter()  # per K, of the sampled variant

    def _windows(self, k: int) -> list[int]:
        """KV windows round K is captured for: the graph runner's, where a kind of it gathers
        the whole window (torch_native), else the full width only."""
        kinds = self.kinds[k]
        every = [kinds.verify, kinds.extend, *kinds.steps.values(), *kinds.later]
        widest = self.g.static_kv_len
        whole = any(kind.backend.reads_whole_kv_window for kind in every)
        return self.g.windows if whole else [widest]

    @torch.inference_mode()
    def capture(self) -> None:
        platform = self.g.platform
        platform.synchronize()
        variants = [None] if self.sampling is None else [None, False, True]
        for bs in reversed(self.buckets):  # largest first, in the graph runner's pool
            for k in sorted(self.kinds):
                for window in reversed(self.windows[k]):
                    for variant in variants:
                        graph = platform.new_graph(False)
                        body = self._body(k, bs, window, variant)
                        with platform.stream(self.g.stream):
                            for _ in range(graph.warmup_runs):
                                body()
                        graph.capture(body, self.g.pool, self.g.stream)
                        self.graphs[k, bs, window, variant] = graph
        platform.synchronize()
        logger.info(
            "captured %d MTP round graphs (K %s) for batch sizes %s",
            len(self.graphs),
            sorted(self.kinds),
            self.buckets,
        )

    def holds(self, k: int, batch: int, sampled: bool = False) -> bool:
        """Whether round K over `batch` requests is captured (`sampled`: its sampled variant)."""
        if sampled and self.sampling is None:
            return False
        return k in self.kinds and 0 < batch <= self.buckets[-1]

    def _sampled_inputs(self, sampled: SampledRound, first, n: int, bucket: int) -> None:
        """The sampled variant's inputs: the block (one host->device copy), d_1's
        distributions (one-hot where None) and each row's count past the block's lowest."""
        s = self.sampling
        s.block[:bucket].copy_(to_device(sampled.block, self.table.device, torch.float32))
        probs = sampled.first_probs
        if probs is None:  # every d_1 greedy
            probs = static_sampling.one_hot(first, self.vocab)
        s.first_probs[:n].copy_(probs)
        s.first_probs[n:bucket].zero_()
        if sampled.extra is None:
            s.extra[:bucket].zero_()
        else:
            s.extra[:n].copy_(sampled.extra)
            s.extra[n:bucket].zero_()

    def bucket_of(self, batch: int) -> int:
        return next(s for s in self.buckets if s >= batch)

    # the captured body ------------------------------------------------------------------
    def _batch(self, kind, ids, rows, seq, q: int, loc, window: int) -> ForwardBatch:
        """A static-shape ForwardBatch of `kind` over device tensors: rows of `q` tokens at
        positions seq-q .. seq-1 (0 for padding rows, whose `seq` is 0)."""
        n = rows.shape[0]
        positions = (seq.view(-1, 1) + self._range[:q] - q).clamp(min=0).view(-1)
        return ForwardBatch(
            forward_mode=kind.mode,
            input_ids=ids,
            positions=positions,
            req_pool_indices=rows,
            seq_lens=seq,
            extend_seq_lens=torch.full_like(seq, q),
            out_cache_loc=loc,
            seq_lens_cpu=[0] * n,  # static shapes: the window sizes every read
            extend_seq_lens_cpu=[q] * n,
            req_to_token_pool=self.g.req_to_token_pool,
            token_to_kv_pool=self.g.kv_pool,
            attn_backend=kind.backend,
            static_kv_len=window,
            # FIA off NPU: its attention in tensor ops over the device lengths, `q` per row
            static_max_q=q if kind.host_lengths else None,
            host_lengths_exact=False,
        )

    def _body(
        self, k: int, bs: int, window: int, variant: bool | None
    ) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Round K's body over bucket `bs`: greedy (`variant` None), or sampled, with the
        top-k / top-p masks (True) or without (False, no sort)."""
        b, k1, kinds = self.buf, k + 1, self.kinds[k]

        def body() -> tuple[torch.Tensor, ...]:
            s = None
            if variant is not None:
                extra = self.sampling.extra[:bs]
                s = RowSettings(self.sampling.block, extra, k, self.k_max, variant)
            live, rows, start = b.live[:bs], b.rows[:bs], b.starts[:bs]
            at = start.view(-1, 1) + self._range[:k1]
            loc = torch.where(live.view(-1, 1), self.table[rows.view(-1, 1), at], 0)  # [B, K+1]
            seq_at = lambda plus: torch.where(live, start + plus, 0)  # noqa: E731
            first = (b.first[:bs], b.first_hidden[:bs], s and self.sampling.first_probs[:bs])
            drafts, probs = self._chain(kinds, first, rows, seq_at, loc, window, s)
            tokens = torch.cat([b.last[:bs].view(-1, 1), drafts], dim=1)  # [B, K+1]
            hidden, logits = self._verify(kinds.verify, tokens, rows, seq_at, loc, window)
            if s is None:
                argmax = greedy_tokens(logits, self.vocab).view(bs, k1)
                accept_len, emitted = spec_accept.greedy_accept(drafts, argmax, b.limits[:bs])
            else:
                accept_len, emitted = self._sampled_accept(logits, drafts, probs, s, b.limits[:bs])
            seq = seq_at(k1)
            nxt = self._mtp_pass(kinds, emitted, accept_len, hidden, rows, seq, loc, window, s)
            out = (accept_len, emitted, nxt[0], nxt[1], drafts)
            return out if s is None else (*out, nxt[2])

        return body

    def _forward_rows(self, fb, kind, hidden, rows, s):
        """`self.forward` and the logits of `rows` (None: every row). A sampled round (`s`)
        runs the LM head over every row and picks `rows` after, as the per-forward graphs
        do (ModelRunner._with_logits): the head's GEMM over another number of rows may round
        differently, and a sampled draw reads every probability, not only the argmax."""
        if s is None or rows is None:
            return self.forward(fb, kind, hidden, rows)
        out, logits = self.forward(fb, kind, hidden, None)
        return out, logits.index_select(0, rows)

    def _draw(self, logits: torch.Tensor, s: RowSettings | None, uniforms):
        """A draft from each row of `logits` [B, V'] and what it was drawn from: the argmax
        (None) without `s`, else `s`'s distribution sampled at `uniforms` [B]."""
        if s is None:
            return greedy_tokens(logits, self.vocab), None
        probs = s.probs(logits[:, : self.vocab])
        return s.sample(probs, uniforms), probs

    def _chain(self, kinds: RoundKinds, first, rows, seq_at, loc, window, s):
        """Draft steps 2..K as `MTPWorker.draft_chain` runs them (a step starting a later
        MTP layer covers the chain's j positions), each draft the argmax, or with `s` drawn
        as `MTPWorker._draft_step` draws it: ([B, K] drafts, [B, K, V] their distributions or
        None)."""
        bs = rows.shape[0]
        tokens, outs, probs = [first[0]], [first[1]], [first[2]]
        for j in range(1, loc.shape[1] - 1):
            kind = kinds.steps[j]
            n = kind.tokens_per_req
            fb = self._batch(
                kind,
                torch.stack(tokens[j - n :], dim=1).reshape(-1),
                rows,
                seq_at(j),
                n,
                loc[:, j - n : j].reshape(-1),
                window,
            )
            hidden = torch.stack(outs[j - n :], dim=1).reshape(bs * n, -1)
            last = torch.arange(n - 1, bs * n, n, device=rows.device) if n > 1 else None
            out, logits = self._forward_rows(fb, kind, hidden, last, s)
            outs.append(out.view(bs, n, -1)[:, -1])
            token, p = self._draw(logits, s, s and s.u_chain[:, j - 1])
            tokens.append(token)
            probs.append(p)
        drafts = torch.stack(tokens, dim=1)
        return drafts, None if s is None else torch.stack(probs, dim=1)

    def _sampled_accept(self, logits, drafts, draft_probs, s: RowSettings, limits):
        """The sampled rows' rule (`self.accept`) as `VerdictMixin._accept` runs it: each
        verify position's distribution, the verify's uniforms from the block."""
        bs, k1 = drafts.shape[0], drafts.shape[1] + 1
        view = logits[:, : self.vocab].reshape(bs, k1, -1)
        target = torch.stack([s.probs(view[:, j]) for j in range(k1)], dim=1)
        uniforms = s.u_verify.contiguous()
        return self.accept(drafts, draft_probs, target, uniforms=uniforms, limits=limits)

    def _verify(self, kind: GraphKind, tokens, rows, seq_at, loc, window):
        """The target's verify forward: (hidden [B(K+1), D], logits [B(K+1), V])."""
        k1 = tokens.shape[1]
        if kind.rows_per_req == k1:  # batch expansion: row j of a request has KV length L+j
            seq = self._expand_lengths(seq_at, k1)
            expanded = rows.view(-1, 1).expand(-1, k1).reshape(-1)
            fb = self._batch(kind, tokens.reshape(-1), expanded, seq, 1, loc.reshape(-1), window)
        else:  # one row of 1+K queries per request
            fb = self._batch(
                kind, tokens.reshape(-1), rows, seq_at(k1), k1, loc.reshape(-1), window
            )
        return self.forward(fb, kind, None, None)

    def _expand_lengths(self, seq_at, k1: int) -> torch.Tensor:
        """Batch expansion's KV lengths L .. L+K per request (0 for padding rows)."""
        first = seq_at(1)
        grown = first.view(-1, 1) + self._range[:k1]
        return torch.where(first.view(-1, 1) > 0, grown, 0).view(-1)

    def _mtp_pass(self, kinds, emitted, accept_len, hidden, rows, seq, loc, window, s):
        """MTP layer 0 over the 1+K positions (inputs: the target hidden and the emitted
        tokens, 0 past them), every later layer for its KV, and the next d_1 from layer 0's
        output at row accept_len (drawn with `s` at the uniform of that accept length, as
        `MTPWorker._draft_ahead` draws it): (d_1 [B], that output [B, D], d_1's
        distribution [B, V] or None)."""
        bs, k1 = emitted.shape
        ids = emitted.clamp(min=0).reshape(-1)
        ends = torch.arange(0, bs * k1, k1, device=ids.device) + accept_len  # [B]
        flat = loc.reshape(-1)
        fb = self._batch(kinds.extend, ids, rows, seq, k1, flat, window)
        out, logits = self._forward_rows(fb, kinds.extend, hidden, ends, s)
        for kind in kinds.later:
            self.forward(self._batch(kind, ids, rows, seq, k1, flat, window), kind, hidden, None)
        u = None if s is None else s.u_next(accept_len)
        token, probs = self._draw(logits, s, u)
        return token, out.index_select(0, ends), probs

    # replay -----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        k: int,
        rows: torch.Tensor,  # [B] req_to_token rows, on the device
        starts: torch.Tensor,  # [B] positions of the verify input tokens, on the device
        bounds: Sequence[int],  # their host upper bounds
        last: torch.Tensor,  # [B] the last committed tokens
        first: torch.Tensor,  # [B] d_1
        first_hidden: torch.Tensor,  # [B, D] the outputs that drafted d_1
        limits: torch.Tensor | None,  # [B] drafts each row may accept (None: K)
        sampled: SampledRound | None = None,  # the sampled variant's inputs (None: greedy)
    ) -> RoundResult:
        """Replays round K over the batch (`holds` it) and returns its real rows' results:
        the greedy variant, or with `sampled` the sampled one (`block` from
        round_sampling.host_block for the bucket, copied in one host->device copy)."""
        n, b = len(bounds), self.buf
        bucket = self.bucket_of(n)
        longest = max(bounds) + k + 1
        window = next(w for w in self.windows[k] if w >= longest)
        for dst, src in (
            (b.rows, rows),
            (b.starts, starts),
            (b.last, last.view(-1)),
            (b.first, first),
            (b.first_hidden, first_hidden),
        ):
            dst[:n].copy_(src)
            dst[n:bucket].zero_()
        if limits is None:
            b.limits[:bucket].fill_(k)
        else:
            b.limits[:n].copy_(limits)
            b.limits[n:bucket].fill_(k)
        b.live[:n].fill_(True)
        b.live[n:bucket].fill_(False)
        if sampled is not None:
            self._sampled_inputs(sampled, first, n, bucket)
            self.sampled_replays[k] += 1
            self.g.replays[f"mtp_round_sampled_k{k}"] += 1
        variant = None if sampled is None else sampled.filtered
        graph = self.graphs[k, bucket, window, variant]
        outs = graph.replay()
        self.replays[k] += 1
        self.g.replays[f"mtp_round_k{k}"] += 1
        self.g.window_replays[window] += 1
        return RoundResult(*(o[:n].clone() if graph.outputs_reused else o[:n] for o in outs))
