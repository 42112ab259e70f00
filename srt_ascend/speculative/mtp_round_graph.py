"""One MTP round per captured graph (DESIGN section 9; issue 43 item 3).

For a batch whose sampling is the raw argmax (`greedy_without_logprobs`: every request greedy,
no logprobs, grammar, penalties, logit bias nor min_new_tokens ahead), the whole round is one
graph per (K, batch bucket[, KV window]):

1. the KV slots of positions start .. start+K, gathered from req_to_token on the device;
2. draft steps 2..K (the MTP layer each step runs) from d_1 and the output that drafted it,
   each draft the argmax of its logits;
3. the verify forward over [t_{L-1}, d_1..d_K] (batch expansion, or the multi-query layout
   where the runner's backend serves it on the device) and its logits;
4. greedy acceptance on the device (`spec_accept.greedy_accept`, the per-row limits a static
   input): accept lengths and emitted tokens;
5. the MTP pass over the 1+K positions, its inputs the emitted tokens (every later MTP layer
   a draft step runs writes its KV too), and the next chain's d_1: the argmax of layer 0's
   logits at row accept_len, and the output there, gathered on the device.

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
from srt_ascend.sampling.sample_step import greedy_tokens

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


class RoundKinds(NamedTuple):
    """The per-forward kinds a round of K drafts runs (the decoder's, not captured again)."""

    verify: GraphKind  # the target's verify forward
    extend: GraphKind  # MTP layer 0 over the 1+K positions
    steps: dict[int, GraphKind]  # draft step j = 1..K-1
    later: list[GraphKind]  # later MTP layers over the 1+K positions (KV only)


class _Inputs:
    """Static inputs of every round graph (sized for the largest bucket)."""

    def __init__(self, max_bs: int, hidden: int, dtype, device) -> None:
        z = lambda: torch.zeros(max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.rows, self.starts, self.last, self.first, self.limits = z(), z(), z(), z(), z()
        self.first_hidden = torch.zeros(max_bs, hidden, dtype=dtype, device=device)
        self.live = torch.zeros(max_bs, dtype=torch.bool, device=device)


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
    ) -> None:
        self.g, self.forward, self.vocab = graphs, forward, vocab
        self.kinds = kinds
        self.buckets = graphs.buckets
        device = graphs.platform.device
        self.buf = _Inputs(self.buckets[-1], hidden_size, dtype, device)
        self.table = graphs.req_to_token_pool.req_to_token
        self._range = torch.arange(max(kinds) + 2, device=device)
        self.windows = {k: self._windows(k) for k in kinds}
        self.graphs: dict[tuple[int, int, int], DeviceGraph] = {}  # (K, bucket, window)
        self.replays: Counter[int] = Counter()  # per K

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
        for bs in reversed(self.buckets):  # largest first, in the graph runner's pool
            for k in sorted(self.kinds):
                for window in reversed(self.windows[k]):
                    graph = platform.new_graph(False)
                    body = self._body(k, bs, window)
                    with platform.stream(self.g.stream):
                        for _ in range(graph.warmup_runs):
                            body()
                    graph.capture(body, self.g.pool, self.g.stream)
                    self.graphs[k, bs, window] = graph
        platform.synchronize()
        logger.info(
            "captured %d MTP round graphs (K %s) for batch sizes %s",
            len(self.graphs),
            sorted(self.kinds),
            self.buckets,
        )

    def holds(self, k: int, batch: int) -> bool:
        return k in self.kinds and 0 < batch <= self.buckets[-1]

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

    def _body(self, k: int, bs: int, window: int) -> Callable[[], tuple[torch.Tensor, ...]]:
        b, k1, kinds = self.buf, k + 1, self.kinds[k]

        def body() -> tuple[torch.Tensor, ...]:
            live, rows, start = b.live[:bs], b.rows[:bs], b.starts[:bs]
            at = start.view(-1, 1) + self._range[:k1]
            loc = torch.where(live.view(-1, 1), self.table[rows.view(-1, 1), at], 0)  # [B, K+1]
            seq_at = lambda plus: torch.where(live, start + plus, 0)  # noqa: E731
            drafts = self._chain(
                kinds, b.first[:bs], b.first_hidden[:bs], rows, seq_at, loc, window
            )
            tokens = torch.cat([b.last[:bs].view(-1, 1), drafts], dim=1)  # [B, K+1]
            hidden, logits = self._verify(kinds.verify, tokens, rows, seq_at, loc, window)
            argmax = greedy_tokens(logits, self.vocab).view(bs, k1)
            accept_len, emitted = spec_accept.greedy_accept(drafts, argmax, b.limits[:bs])
            first, first_hidden = self._mtp_pass(
                kinds, emitted, accept_len, hidden, rows, seq_at(k1), loc, window
            )
            return accept_len, emitted, first, first_hidden, drafts

        return body

    def _chain(self, kinds: RoundKinds, first, first_hidden, rows, seq_at, loc, window):
        """Draft steps 2..K as `MTPWorker.draft_chain` runs them (a step starting a later
        MTP layer covers the chain's j positions), each draft the argmax: [B, K] drafts."""
        bs = rows.shape[0]
        tokens, outs = [first], [first_hidden]
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
            out, logits = self.forward(fb, kind, hidden, last)
            outs.append(out.view(bs, n, -1)[:, -1])
            tokens.append(greedy_tokens(logits, self.vocab))
        return torch.stack(tokens, dim=1)

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

    def _mtp_pass(self, kinds, emitted, accept_len, hidden, rows, seq, loc, window):
        """MTP layer 0 over the 1+K positions (inputs: the target hidden and the emitted
        tokens, 0 past them), every later layer for its KV, and the next d_1 from layer 0's
        output at row accept_len: (d_1 [B], that output [B, D])."""
        bs, k1 = emitted.shape
        ids = emitted.clamp(min=0).reshape(-1)
        ends = torch.arange(0, bs * k1, k1, device=ids.device) + accept_len  # [B]
        flat = loc.reshape(-1)
        out, logits = self.forward(
            self._batch(kinds.extend, ids, rows, seq, k1, flat, window), kinds.extend, hidden, ends
        )
        for kind in kinds.later:
            self.forward(self._batch(kind, ids, rows, seq, k1, flat, window), kind, hidden, None)
        return greedy_tokens(logits, self.vocab), out.index_select(0, ends)

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
    ) -> RoundResult:
        """Replays round K over the batch (`holds` it) and returns its real rows' results."""
        n, b = len(bounds), self.buf
        bucket = next(s for s in self.buckets if s >= n)
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
        graph = self.graphs[k, bucket, window]
        outs = graph.replay()
        self.replays[k] += 1
        self.g.replays[f"mtp_round_k{k}"] += 1
        self.g.window_replays[window] += 1
        return RoundResult(*(o[:n].clone() if graph.outputs_reused else o[:n] for o in outs))
