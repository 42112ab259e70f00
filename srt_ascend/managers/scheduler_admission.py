"""The scheduler's admission room: a request's arrival, admission by free KV, (chunked) prefill.

`AdmissionMixin` is one room of `Scheduler` (managers/scheduler.py, whose docstring maps the
rooms and the state each writes). A request is validated and queued (`_add_request`), admitted
with its matched prefix locked (`_schedule_prefill`, `_admit`), prefilled a chunk at a time
(`_run_prefill`), and joins the decode batch with its first tokens committed.
"""

from __future__ import annotations

import torch

from srt_ascend.constrained import Grammar, GrammarBackend, GrammarOptions
from srt_ascend.managers.io_struct import TokenizedGenerateReq
from srt_ascend.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from srt_ascend.managers.schedule_policy import (
    DECODE_RESERVE_PER_REQ,
    PrefillAdder,
    order_waiting,
)
from srt_ascend.managers.scheduler_decode import _with_ids
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.sampling.sample_step import input_logprobs
from srt_ascend.utils import to_device


class AdmissionMixin:
    """Adds requests to the queue, plans and runs prefill batches.

    Writes: `waiting` (appends arrivals, takes out the admitted), `chunked_req` (the request
    whose prompt is prefilled in chunks, one at a time), `running` (extended with the
    requests a prefill finished), `total_prompt_tokens`, `total_cached_tokens`, `_grammars`
    (a non-leader rank's grammar compiler), `_outputs`. Uses `runner`, `kv`, `tree`,
    `req_to_token_pool`, `allocator`, `decoder`, `batch_log`, `args`, and from the other
    rooms `_finish`, `_flush_outputs`, `_make_output`, `_next_batch`, `_pool_usage` (decode),
    `prefill_side`, `decode_side` (disaggregation)."""

    def _add_request(self, m: TokenizedGenerateReq) -> None:
        req = Req(
            m.rid,
            list(m.input_ids),
            m.sampling_params,
            m.return_logprob,
            m.logprob_start_len,
            m.top_logprobs_num,
            m.token_ids_logprob,
            m.stream,
            extra_key=m.extra_key,
            grammar=self._grammar_of(m),
            bootstrap=m.bootstrap,
        )
        limit = self.runner.context_len
        if len(req.origin_input_ids) >= limit:
            self._finish(
                req,
                FinishReason(
                    "abort",
                    message=(
                        f"the prompt has {len(req.origin_input_ids)} tokens, the context length is "
                        f"{limit}"
                    ),
                ),
            )
            return
        if len(req.origin_input_ids) + self.kv.page_size > self.runner.max_total_tokens:
            self._finish(req, FinishReason("abort", message="the prompt does not fit the KV pool"))
            return
        if req.bootstrap is not None and self.decode_side is not None:
            self.decode_side.add(req)  # its KV comes from its prefill server
            return
        if req.bootstrap is not None and self.prefill_side is not None:
            if self.prefill_side.room_taken(req.bootstrap.room):
                message = f"bootstrap_room {req.bootstrap.room} is in use by another request"
                self._finish(req, FinishReason("abort", message=message))
                return
            self.prefill_side.add(req)
        self.waiting.append(req)

    def _grammar_of(self, m: TokenizedGenerateReq) -> Grammar | None:
        """The request's grammar matcher. The leader gets requests with the grammar compiled
        (TokenizerManager.attach_grammar); the other ranks of a tensor-parallel group get them
        without (xgrammar's compiled grammars do not pickle) and compile the same grammar
        here, from their own cache, as each SGLang rank compiles its own."""
        spec = m.sampling_params.grammar_spec
        if spec is None:
            return None
        compiled = m.grammar
        if compiled is None:
            if self._grammars is None:
                self._grammars = GrammarBackend(
                    self.stop_checker.tokenizer,
                    self.runner.vocab_size,
                    self.stop_checker.eos_ids,
                    GrammarOptions.from_args(self.args, bounded=False),
                )
            compiled = self._grammars.compile(spec).result()
        return Grammar(compiled)

    # ---- admission --------------------------------------------------------------------------

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        chunk = self.args.chunked_prefill_size
        adder = PrefillAdder(
            budget=chunk if chunk > 0 else 1 << 62,
            available=self.allocator.available_size() + self.tree.evictable_size(),
            free_req_slots=self.args.max_running_requests - len(self.running),
            page_size=self.kv.page_size,
            reserve=sum(min(r.remaining_new_tokens, DECODE_RESERVE_PER_REQ) for r in self.running),
        )
        if self.chunked_req is not None:
            # It takes one of the --max-running-requests places (it holds its row since its
            # first chunk), so running + chunked + admitted stays within the limit and the
            # decode batch after it within the largest graph bucket.
            r = self.chunked_req
            if not adder.try_add(r, r.seq_len - r.kv_len, can_chunk=True):
                return None
        for req in order_waiting(self.waiting, self.args.schedule_policy, self.tree):
            if not self._admit(req, adder):
                break
        plan = adder.plan
        if not plan.reqs:
            return None
        admitted = {id(r) for r in plan.reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        self.batch_log.prefill(
            len(plan.reqs),
            sum(plan.extend_lens),
            sum(r.kv_len for r in plan.reqs if r is not self.chunked_req),
            self._pool_usage(),
            len(self.running),
            len(self.waiting),
        )
        return ScheduleBatch(plan.reqs, ForwardMode.EXTEND, plan.extend_lens, plan.chunked)

    def _admit(self, req: Req, adder: PrefillAdder) -> bool:
        """Matches the prefix, locks it, and asks the adder; undoes everything on refusal."""
        match = self.tree.match_prefix(req.all_ids[: req.max_prefix_len()], req.extra_key)
        # Locking makes the matched nodes unevictable: the adder's budget shrinks with them.
        adder.available += self.tree.inc_lock_ref(match.last_node)
        can_chunk = self.chunked_req is None and not adder.plan.chunked
        if not adder.try_add(req, req.seq_len - match.prefix_len, can_chunk):
            adder.available += self.tree.dec_lock_ref(match.last_node)
            return False
        rows = self.req_to_token_pool.alloc(1)
        assert rows is not None, "request rows are sized by --max-running-requests"
        req.req_pool_idx = rows[0]
        req.prefix_len = req.kv_len = req.alloc_len = match.prefix_len
        req.last_node = match.last_node
        req.cached_tokens = match.prefix_len if not req.retracted else req.cached_tokens
        self.req_to_token_pool.write(
            [req.req_pool_idx], [0], match.device_indices, [match.prefix_len]
        )
        return True

    # ---- prefill ----------------------------------------------------------------------------

    def _run_prefill(self, batch: ScheduleBatch) -> None:
        reqs, lens = batch.reqs, batch.extend_lens
        loc = self.kv.alloc_extend(reqs, lens)
        input_ids = []
        for r, n in zip(reqs, lens):
            input_ids.extend(r.all_ids[r.kv_len : r.kv_len + n])
        fb = self.runner.build_forward_batch(
            ForwardMode.EXTEND,
            input_ids,
            [r.req_pool_idx for r in reqs],
            [r.kv_len + n for r, n in zip(reqs, lens)],
            lens,
            loc,
        )
        hidden = self.runner.forward(fb)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        kv_before = [r.kv_len for r in reqs]
        for r, n, s in zip(reqs, lens, starts):
            if r.wants_input_logprobs:
                self._collect_input_logprobs(r, hidden[s : s + n], r.kv_len)
            r.kv_len += n
        for r in reqs:
            if r.rid in batch.chunked:
                self._cache_chunk(r)
        self.chunked_req = next((r for r in reqs if r.rid in batch.chunked), None)
        done = [r.rid not in batch.chunked for r in reqs]
        to_sample, prompt_only = [], []
        for r, d, s, n in zip(reqs, done, starts, lens):
            if not d:
                continue
            if r.sampling_params.max_new_tokens == 0:  # e.g. prompt logprobs only
                r.finished_reason = FinishReason("length", length=0)
                prompt_only.append(r)
                continue
            to_sample.append((r, s + n - 1))
            self.total_prompt_tokens += len(r.origin_input_ids)
            self.total_cached_tokens += r.cached_tokens
        if to_sample:
            last = to_device([i for _, i in to_sample], hidden.device)  # no blocking copy
            logits = self.runner.compute_logits(hidden.index_select(0, last))
            self.decoder.sample_and_commit([r for r, _ in to_sample], logits)
        joining = [r for r, _ in to_sample if not r.finished]
        self.decoder.after_prefill(reqs, kv_before, lens, hidden, done, self._next_batch(joining))
        # a prefill server's requests go to their decode server, KV and all
        sent = set()
        if self.prefill_side is not None:
            sent = {id(r) for r, d in zip(reqs, done) if d and r.bootstrap is not None}
        for r in reqs:
            if r.finished and id(r) not in sent:
                self.kv.release(r)
        self._outputs += [self._make_output(r) for r in prompt_only if id(r) not in sent]
        self.running.extend(r for r in joining if id(r) not in sent)
        self._flush_outputs()
        for r in reqs:
            if id(r) in sent:
                self.prefill_side.prefilled(r)

    def _collect_input_logprobs(self, req: Req, hidden: torch.Tensor, a: int) -> None:
        """Positions a..a+n-1 were computed; the logits at q give the logprob of token q+1."""
        start, prompt = req.logprob_start_len, req.origin_input_ids
        if start == 0 and a == 0:
            req.input_token_logprobs.append((None, prompt[0]))
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
        lo, hi = max(start - 1, a, 0), min(a + hidden.shape[0], len(prompt) - 1)
        if hi > lo:
            logits = self.runner.compute_logits(hidden[lo - a : hi - a])
            asked = req.token_ids_logprob
            lps = input_logprobs(logits, prompt[lo + 1 : hi + 1], req.top_logprobs_num, asked)
            req.input_token_logprobs.extend(zip(lps.chosen, prompt[lo + 1 : hi + 1]))
            req.input_top_logprobs.extend(lps.top)
            req.input_token_ids_logprobs.extend(_with_ids(v, asked) for v in lps.ids)

    def _cache_chunk(self, req: Req) -> None:
        row = self.req_to_token_pool.host[req.req_pool_idx, : req.kv_len].clone()
        res = self.tree.cache_unfinished_req(
            req.all_ids, row, req.prefix_len, req.last_node, req.extra_key
        )
        self.req_to_token_pool.write([req.req_pool_idx], [0], res.device_indices, [res.prefix_len])
        req.prefix_len, req.last_node = res.prefix_len, res.last_node
