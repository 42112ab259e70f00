"""One MTP speculative decode step for the scheduler's running batch.

Step for requests with committed tokens t_0..t_{L-1} (KV for 0..L-2) and drafts d_1..d_K:
1. allocate K+1 slots for positions L-1..L-1+K (evicting / retracting like plain decode);
2. draft steps 2..K (MTP re-applied) write MTP KV into those slots;
3. verify [t_{L-1}, d_1..d_K] with the target model (expand or fia strategy);
4. accept (rejection sampling; exact greedy for temperature-0 requests), commit up to a stop;
5. run the MTP module over all K+1 positions (its KV for the committed ones, and the next d_1
   from the last committed one); free the slots of rejected positions; release requests that
   finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from srt_ascend.layers.sampler import processed_probs
from srt_ascend.managers.sample_step import all_plain_greedy, penalised_logits
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.speculative.acceptance import greedy_accept, rejection_sample
from srt_ascend.speculative.mtp_worker import DraftHandles, MTPWorker
from srt_ascend.speculative.verify import VERIFY_STRATEGIES

if TYPE_CHECKING:
    from srt_ascend.managers.scheduler import Scheduler


class SpecDecoder:
    def __init__(self, sched: Scheduler) -> None:
        runner, args = sched.runner, sched.args
        self.sched = sched
        self.k = args.speculative_num_steps
        self.vocab = runner.vocab_size
        self.worker = MTPWorker(
            DraftHandles(
                runner.forward_mtp,
                runner.mtp.compute_logits,
                runner.build_forward_batch,
                sched.req_to_token,
                runner.vocab_size,
                sched.stop_checker.eos_ids,
            ),
            self.k,
        )
        self.verify = VERIFY_STRATEGIES[args.speculative_verify](
            runner.build_forward_batch, runner.verify_backend
        )
        self.accepted_per_position = [0] * self.k  # drafts accepted at draft position j
        self.num_verify = 0  # request-steps verified (each checks K draft tokens)
        self.num_accepted = 0  # drafts accepted

    @property
    def avg_accept_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_verify if self.num_verify else 0.0

    def after_extend(self, reqs, starts, lens, hidden, done) -> None:
        """MTP pass over an EXTEND batch's positions; requests whose prompt is complete and
        that are still running get their first draft."""
        next_tokens = []
        for r, s, n in zip(reqs, starts, lens):
            ids = r.all_ids
            nxt = ids[s + 1 : s + n + 1]
            next_tokens.append(nxt + [0] * (n - len(nxt)))  # no next token: KV never keyed
        draft = [d and not r.finished for r, d in zip(reqs, done)]
        self.worker.draft_extend(reqs, starts, lens, hidden, next_tokens, draft)

    @torch.inference_mode()
    def step(self) -> list:
        s = self.sched
        loc = s.alloc_running(self.k + 1)
        reqs = s.running
        if not reqs:
            return []
        loc = loc.view(len(reqs), self.k + 1)
        if self.k > 1:
            self.worker.draft_chain(reqs, loc)
        fb = self.verify.build(reqs, loc)
        hidden = s.runner.forward(fb).view(len(reqs), self.k + 1, -1)
        logits = s.runner.compute_logits(hidden.view(-1, hidden.shape[-1]))[:, : self.vocab]
        logits = logits.view(len(reqs), self.k + 1, -1)
        accept_len, emitted = self._accept(reqs, logits)
        outs, starts, committed = [], [], []
        for i, r in enumerate(reqs):
            n, start = int(accept_len[i]), r.kv_len
            tokens = emitted[i, : n + 1].tolist()
            lps, tops = self._logprobs(r, logits[i], tokens)
            r.spec_verify_ct += 1
            r.spec_accepted_tokens += n
            self.num_verify += 1
            self.num_accepted += n
            for j in range(n):
                self.accepted_per_position[j] += 1
            outs.append(s.commit_tokens(r, tokens, lps, tops, release=False))
            starts.append(start)
            committed.append(r.seq_len - 1 - start)  # positions start .. start+c-1 have KV
        k1 = self.k + 1
        self.worker.draft_after_verify(
            reqs,
            starts,
            loc,
            hidden.view(-1, hidden.shape[-1]),
            [(r.all_ids[st + 1 : st + 1 + k1] + [0] * k1)[:k1] for r, st in zip(reqs, starts)],
            committed,
            [not r.finished for r in reqs],
        )
        for r, start, c in zip(reqs, starts, committed):
            r.kv_len = start + c
            s.free_positions(r, r.kv_len, start + k1)
            if r.finished:
                s.release(r)
        s.running = [r for r in reqs if not r.finished]
        return outs

    def _accept(self, reqs: list[Req], logits: torch.Tensor):
        """Target distributions per position (penalties see the drafts before it), then the
        lossless acceptance rule; greedy requests get one-hot distributions = exact greedy."""
        b, k1, _ = logits.shape
        drafts = torch.tensor([r.draft_tokens for r in reqs], dtype=torch.int64)
        if all_plain_greedy(reqs):  # nothing modifies the logits: argmax of the raw ones
            res = greedy_accept(drafts, logits.argmax(dim=-1))
            return res.accept_len.tolist(), res.emitted
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            self.vocab,
            logits.device,
            seed_offsets=[len(r.output_ids) for r in reqs],
        )
        eos = self.sched.stop_checker.eos_ids
        logits = torch.stack(
            [
                penalised_logits(logits[:, j], reqs, info, eos, [r.draft_tokens[:j] for r in reqs])
                for j in range(k1)
            ],
            dim=1,
        )  # [B, K+1, V]
        if info.is_all_greedy:  # the same rule without materialising one-hot distributions
            res = greedy_accept(drafts, logits.argmax(dim=-1))
            return res.accept_len.tolist(), res.emitted
        target = torch.stack([processed_probs(logits[:, j], info) for j in range(k1)], dim=1)
        draft_probs = torch.stack(
            [
                torch.stack([self._draft_dist(r, j, logits.device) for j in range(k1 - 1)])
                for r in reqs
            ]
        )  # [B, K, V]
        res = rejection_sample(drafts, draft_probs, target, generators=list(info.generators))
        return res.accept_len.tolist(), res.emitted

    def _draft_dist(self, req: Req, j: int, device: torch.device) -> torch.Tensor:
        """A greedy request's draft distribution is one-hot at its draft token."""
        p = req.draft_probs[j]
        if p is None:
            p = torch.zeros(self.vocab, device=device)
            p[req.draft_tokens[j]] = 1.0
        return p

    @staticmethod
    def _logprobs(req: Req, logits: torch.Tensor, tokens: list[int]):
        if not req.return_logprob:
            return None, None
        lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        chosen = lp.gather(-1, torch.tensor(tokens).view(-1, 1)).squeeze(-1).tolist()
        tops = None
        if req.top_logprobs_num:
            v, ids = lp.topk(req.top_logprobs_num, dim=-1)
            tops = [list(zip(a, c)) for a, c in zip(v.tolist(), ids.tolist())]
        return chosen, tops
