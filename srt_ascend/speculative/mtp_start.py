"""MTPDecoder's start (`calibrate`, after the per-forward graphs are captured): the whole-round
graphs (speculative/mtp_round_graph) where they apply, then the draft-length policy's cost
profiles: every K's step over padding requests (`_padding_step`) and, for a ragged verify,
the verify forward over a number of rows (`_padding_rows`). `StartMixin` is a part of
MTPDecoder: it writes the decoder's `rounds` and reads its runner, verifies, step kinds,
worker and `plain_kind`."""

from __future__ import annotations

import torch

from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.speculative.mtp_round_graph import MTPRoundGraphs, RoundKinds
from srt_ascend.speculative.verify import Ragged
from srt_ascend.utils import to_device

PROFILE_CONTEXT = 256  # committed tokens per padding request when the step costs are profiled


class StartMixin:
    def calibrate(self) -> None:
        """Captures the round graphs (the per-forward graphs are captured now), then times
        the steps of every K and the ragged verify's rows for the draft-length policy."""
        self.rounds = self._capture_rounds()
        self.draft_length.calibrate(
            self._padding_step, self.runner.platform.synchronize, self._padding_rows
        )

    @torch.inference_mode()
    def _padding_rows(self, n: int) -> None:
        """The row-proportional forwards of a ragged step over `n` verify rows (as requests
        of 1 + K rows and one of the rest; request row 0, PROFILE_CONTEXT tokens, KV into
        the padding slot 0): the draft steps over the requests drafting past each one
        (`MTPWorker.draft_chain` with limits), the verify forward of the largest K and its
        logits, and the MTP pass over those rows where it is ragged."""
        runner, verify = self.runner, self.verifies[max(self.verifies)]
        k1 = verify.k + 1
        context = min(PROFILE_CONTEXT, self.h.req_to_token.shape[1] - k1)
        full, rest = divmod(n, k1)
        limits = [verify.k] * full + ([rest - 1] if rest else [])
        bs = len(limits)
        loc = torch.zeros(bs, k1, dtype=torch.int64, device=runner.device)
        for j in range(1, verify.k):
            drafting = sum(m > j for m in limits)
            if drafting:
                self._padding_draft_step(drafting, j, context, loc)
        ragged = Ragged.of(limits, verify.k, runner.device)
        fb = verify.build(loc, [0] * bs, [context] * bs, loc, None, ragged)
        hidden, _ = runner.forward_logits(fb, verify.kind)
        if self.worker.ragged_pass:
            per = [m + 1 for m in limits]
            build = lambda: runner.build_forward_batch(  # noqa: E731
                ForwardMode.DRAFT_EXTEND, ragged.take(loc.view(-1)), [0] * bs,
                [context + m for m in per], per, ragged.take(loc.view(-1)),
            )  # fmt: skip
            ends = ragged.first + to_device(limits, runner.device)
            self.worker.mtp_pass(build, hidden, None, verify.k, ends)

    def _padding_draft_step(self, bs: int, j: int, context: int, loc: torch.Tensor) -> None:
        """Draft step j (`MTPWorker.draft_chain`) over `bs` padding requests, its KV into the
        padding slot 0 (`loc`: zeros, at least [bs, j + 1])."""
        runner, kind = self.runner, self.step_kinds[j]
        n = kind.tokens_per_req
        ids = loc[:bs, :n].reshape(-1)
        fb = runner.build_forward_batch(kind.mode, ids, [0] * bs, [context + j] * bs, [n] * bs, ids)
        steps = loc.new_zeros(bs * n, runner.config.hidden_size, dtype=runner.dtype)
        last = torch.arange(n - 1, bs * n, n, device=runner.device)
        runner.forward_mtp_logits(fb, steps, j, kind, last)

    def _capture_rounds(self) -> MTPRoundGraphs | None:
        """One graph per (K, bucket) running the whole round for all-greedy batches
        (speculative/mtp_round_graph), where graphs are on, uncompiled, with one rank, and
        every forward of the round runs over device lengths; None elsewhere."""
        runner, args, w = self.runner, self.args, self.worker
        graphs = runner.graph_runner
        if graphs is None or args.disable_mtp_round_graph or args.enable_torch_compile:
            return None
        if runner.tp.size > 1 or runner.tp.dp_size > 1:
            return None
        kinds = {}
        for k, verify in self.verifies.items():
            steps = {j: self.step_kinds[j] for j in range(1, k)}
            later = [w.layer_kinds[k, layer] for layer in w.later_layers]
            round_kinds = RoundKinds(verify.kind, w.extend_kinds[k], steps, later)
            every = [verify.kind, round_kinds.extend, *steps.values(), *later]
            if all(
                kind.backend.supports_static_shapes
                and (not kind.host_lengths or kind.backend.takes_length_bounds(runner.device))
                for kind in every
            ):
                kinds[k] = round_kinds
        if not kinds:
            return None
        rounds = MTPRoundGraphs(
            graphs,
            runner.forward_static,
            kinds,
            self.vocab,
            runner.config.hidden_size,
            runner.dtype,
            # the decoder's rule when the round is traced (eager replays: at each replay)
            lambda *a, **kw: self.accept(*a, **kw),
        )
        rounds.capture()
        return rounds

    @torch.inference_mode()
    def _padding_step(self, bs: int, k: int) -> None:
        """The forwards of a step with K = k over `bs` padding requests (request row 0, a
        context of PROFILE_CONTEXT tokens, every KV write into the padding slot 0): the K-1
        draft steps, the verify forward and its logits, the MTP pass and its drafting head;
        the round's one graph where it holds the batch (what all-greedy rounds replay; the
        served steps scale the estimate per bucket and K)."""
        runner, k1 = self.runner, k + 1
        context = min(PROFILE_CONTEXT, self.h.req_to_token.shape[1] - k1)
        loc = torch.zeros(bs, k1, dtype=torch.int64, device=runner.device)
        hidden = loc.new_zeros(bs, runner.config.hidden_size, dtype=runner.dtype)
        rows = [0] * bs
        if not k:  # the plain decode step
            fb = runner.build_forward_batch(
                ForwardMode.DECODE, loc[:, 0], rows, [context + 1] * bs, [1] * bs, loc[:, 0]
            )
            runner.forward_logits(fb, self.plain_kind)
            return
        if self.rounds is not None and self.rounds.holds(k, bs):  # the round's one graph
            zeros = torch.zeros(bs, dtype=torch.int64, device=runner.device)  # row 0: slot 0
            self.rounds.run(k, zeros, zeros + context, [context] * bs, zeros, zeros, hidden, None)
            return
        for j in range(1, k):
            self._padding_draft_step(bs, j, context, loc)
        verify = self.verifies[k]
        out, _ = runner.forward_logits(verify.build(loc, rows, [context] * bs, loc), verify.kind)
        flat = loc.reshape(-1)
        build = lambda: runner.build_forward_batch(  # noqa: E731
            ForwardMode.DRAFT_EXTEND, flat, rows, [context + k1] * bs, [k1] * bs, flat
        )
        first = torch.arange(bs, device=runner.device)
        self.worker.mtp_pass(build, out, self.worker.extend_kinds[k], k, first)
