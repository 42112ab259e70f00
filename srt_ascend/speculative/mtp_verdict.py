"""MTPDecoder's verdict: the lossless acceptance rule over the target logits, the round's one
host read of its result, and the emitted tokens' logprobs (`VerdictMixin`, a part of
MTPDecoder: it reads the decoder's `vocab`, `accept`, `h` and `agree`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt_ascend.decoding.base import StepRequest
from srt_ascend.layers.sampler import TokenLogprobs, processed_probs, token_logprobs
from srt_ascend.platforms.device_worker import HostCopy
from srt_ascend.sampling.sample_step import all_plain_greedy, verify_logits
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.speculative.acceptance import AcceptResult, greedy_accept
from srt_ascend.speculative.mtp_worker import Counts, Drafts, lower, one_hot_probs, stream_uniforms
from srt_ascend.utils import HOST_READS, to_device


@dataclass
class Verdict:
    """What the acceptance rule decided for a batch, read to the host once."""

    accept_len: list[int]  # [B] drafts accepted
    emitted: list[list[int]]  # [B][K+1]: accepted drafts + 1 target token, then -1
    logits: torch.Tensor  # [B, K+1, V] the target logits the rule read (penalties applied)


class VerdictMixin:
    """MTPDecoder's acceptance (`_accept`), read (`_read`) and logprobs (`_logprobs`); no
    state of its own."""

    def _accept(
        self,
        reqs: list[StepRequest],
        logits: torch.Tensor,
        drafts: Drafts,
        generated: list[int] | Counts,
        limits: torch.Tensor | None = None,  # [B] drafts each row may accept (None: K)
    ) -> tuple[AcceptResult, torch.Tensor]:
        """Target distributions per position (penalties see the drafts before it), then the
        lossless acceptance rule; greedy requests get one-hot distributions = exact greedy.
        A seeded request's uniforms come from the stream of its count (`Counts`: picked on
        the device). Returns the verdict and the logits it read [B, K+1, V] (penalties
        applied), both on the device. Row i accepts at most limits[i] drafts, as a step with
        that many drafts would (`acceptance`)."""
        k1, device = logits.shape[1], logits.device
        tokens = drafts.tokens  # [B, K]
        low, ranged = lower(generated), isinstance(generated, Counts)
        if all_plain_greedy(reqs, low):  # nothing modifies the logits: raw argmax
            return greedy_accept(tokens, logits.argmax(dim=-1), limits), logits
        params = [r.sampling_params for r in reqs]  # a range: `stream_uniforms` below
        info = SamplingBatchInfo.from_params(
            params, self.vocab, device, seed_offsets=low, generators=not ranged
        )
        logits = verify_logits(logits, reqs, info, self.h.eos_ids, tokens)  # [B, K+1, V]
        if info.is_all_greedy:  # the same rule without materialising one-hot distributions
            return greedy_accept(tokens, logits.argmax(dim=-1), limits), logits
        target = torch.stack([processed_probs(logits[:, j], info) for j in range(k1)], dim=1)
        draft_probs = drafts.probs
        if draft_probs is None:  # greedy drafts: one-hot at the token
            draft_probs = one_hot_probs(tokens, self.vocab)
        uniforms = None  # exact counts: drawn from info.generators
        if ranged:
            uniforms = stream_uniforms(reqs, generated, 0, k1)
        gens = list(info.generators)
        res = self.accept(
            tokens, draft_probs, target, uniforms=uniforms, generators=gens, limits=limits
        )
        return res, logits

    def _copy_verdict(self, res: AcceptResult) -> HostCopy:
        """accept_len | emitted [B, 1+K+1] on their way to the host (`Platform.copy_to_host`:
        on a device, enqueued now - before the next round - and waited for alone)."""
        verdict = torch.cat([res.accept_len.view(-1, 1), res.emitted], dim=1)
        return self.runner.platform.copy_to_host(verdict)

    def _read(
        self, res: AcceptResult, logits: torch.Tensor, copy: HostCopy | None = None
    ) -> Verdict:
        """The step's one host read of the acceptance result (`agree`d across ranks): of
        `copy` when an overlapped round started it, else of a copy started now."""
        read = HOST_READS.read((copy or self._copy_verdict(res)).wait())
        both = self.agree(read)
        return Verdict([row[0] for row in both], [row[1:] for row in both], logits)

    def _logprobs(self, reqs: list[StepRequest], verdict: Verdict) -> list[TokenLogprobs | None]:
        """Logprobs of each emitted token under the target logits of its position, as the
        plain decoder reports them: penalties applied, over the request's temperature, top
        lists clamped to the vocabulary (`token_logprobs`)."""
        out: list[TokenLogprobs | None] = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.return_logprob]
        if not want:
            return out
        k1 = verdict.logits.shape[1]
        rows, tokens, nums, asked, params = [], [], [], [], []
        for i in want:
            n = verdict.accept_len[i] + 1
            rows += [i * k1 + j for j in range(n)]
            tokens += verdict.emitted[i][:n]
            nums += [reqs[i].top_logprobs_num] * n
            asked += [reqs[i].token_ids_logprob or []] * n
            params += [reqs[i].sampling_params] * n
        device = verdict.logits.device
        flat = verdict.logits.view(-1, verdict.logits.shape[-1])
        temps = [p.sampling_temperature for p in params]  # as the sampler divides by
        lps = token_logprobs(
            flat.index_select(0, to_device(rows, device)),
            to_device(tokens, device),
            nums,
            asked,
            to_device(temps, device, torch.float32).view(-1, 1),
        )
        at = 0
        for i in want:
            n = verdict.accept_len[i] + 1
            out[i] = lps.rows(at, at + n)
            at += n
        return out
