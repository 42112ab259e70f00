"""MTP speculative decoding as a decoder (`--speculative-algorithm MTP`).

Step for requests with committed tokens t_0..t_{L-1} (KV for 0..L-2) and drafts d_1..d_K:
1. allocate K+1 slots for positions L-1..L-1+K (evicting / retracting like plain decode);
2. draft steps 2..K (MTP re-applied; step j runs MTP layer j of a multi-layer checkpoint,
   the last one repeating) write MTP KV into those slots;
3. verify [t_{L-1}, d_1..d_K] with the target model (the verify strategy's forward);
4. accept on the device (--speculative-accept-method: token-wise rejection sampling or block
   verification; exact greedy for temperature-0 requests): accept lengths and emitted tokens;
5. run the MTP module over all K+1 positions, its inputs the emitted tokens (its KV for the
   committed ones, and the next d_1 from the last accepted one; every later layer the draft
   steps run writes its own KV over the same positions);
6. read the verdict (the step's one host read), commit up to a stop, set kv_len to the
   committed positions and free the slots past them.
Steps 2-5 need no host value of the round: the round is device-resident, one launch of work
and one read; with graphs on, a batch without logprobs (nor penalties, grammar, logit bias,
min_new_tokens ahead) replays steps 2-5 as one captured graph per (K, bucket), greedy or
sampled (`_round_fits`, speculative/mtp_round_graph.py), its slots
gathered from req_to_token on the device. A batch with penalties or a grammar (whose d_1
reads the state the commit advances), or with several ranks (d_1 must follow the verdict
`agree`d across them), runs step 5 after step 6, from the read verdict.
Under overlap scheduling (`launch` / `finish`) round N+1 is issued before round N's read:
its first positions (round N's plus its accept lengths + 1), last committed token and d_1
come from round N's device results, its slots are gathered from req_to_token on the device,
and its forwards carry device sequence lengths with host upper bounds (the slots of every
position it may reach were allocated ahead). Its finish fills in where the round after it
starts. A seeded request's streams follow its generated count, which is round N's plus
its accept length + 1: the uniforms of each count it may reach are drawn on the host and
picked on the device (`Counts`), exactly those a serial round draws. Batches whose masks
follow the committed count run `step` (`can_overlap`).
K is --speculative-num-steps, or per step what `draft_length` chooses (--speculative-adaptive,
0..K). K = 0 is the plain decoder's step (the decode graph kind; tokens and logprobs sampled as
without MTP), and step 5 is deferred (the MTP worker keeps the target hidden) until the
request's next step with drafts, which first runs every deferred position in one MTP pass
(`MTPWorker.catch_up`); a request leaving first (finished, aborted, retracted: `leaving`)
runs it without drafting, so the prefix cache takes those positions with their MTP KV. Under
overlap an adaptive round's K is chosen at its launch, from the estimates of the last round
read (one round stale); rounds of any K follow each other overlapped, except a round with
drafts after a K = 0 step (its catch-up reads committed tokens), which runs `step`.

Per request: each request drafts its own k_r (`_plan`: its `speculative_num_steps`, or the
server's K for a seeded sampled request under --speculative-adaptive, `own_length`; else the
policy's choice, per request under --speculative-adaptive). A step drafts K = the smallest
registered K holding the longest k_r, and the acceptance rule stops row r at k_r, as a
K = k_r step over the same drafts and uniforms would (lossless per request, seeded draws
independent of the neighbours). The verify is ragged (verify.Ragged): request r's rows past
k_r are not built, and a request with k_r = 0 rides in the drafting step as one row; its
outputs are read back in the [B, K+1] layout with row k_r repeated past it, which the rule
never reads. Where the MTP pass runs eagerly it covers the same rows. Overlapped rounds carry
the limits, and ragged rows where the strategy builds them from device lengths (expand); an
FIA round mixing k_r = 0 with drafts runs `step`. Without a ragged verify (tests switch it
off) requests with k_r = 0 run apart as the plain decoder's step in the same `step` (not
under DP attention, where every group must run the same forwards: they verify with limit 0).

Here: the decoder, its serial step and idle forwards; overlapped rounds (`launch`, `finish`)
in mtp_rounds, the acceptance rule's verdict and its logprobs in mtp_verdict, what runs once
at start (round graphs, the step-cost profiles) in mtp_start (mixins).
"""

from __future__ import annotations

import time

import torch

from srt_ascend.decoding.base import DECODERS, Decoder, DecoderHandles, LaunchedStep, StepRequest
from srt_ascend.model_executor.forward_batch import ForwardMode, pack_to_device
from srt_ascend.model_executor.graph_runner import GraphKind, graph_buckets
from srt_ascend.sampling.penalty_state import has_penalties
from srt_ascend.sampling.sample_step import greedy_without_logprobs
from srt_ascend.sampling.static_sampling import needs_filter, plain_sampling
from srt_ascend.server_args import ServerArgs
from srt_ascend.speculative.acceptance import ACCEPT_METHODS, AcceptResult
from srt_ascend.speculative.draft_length import DRAFT_LENGTHS, SETTLE_STEPS, capped
from srt_ascend.speculative.mtp_round_graph import MTPRoundGraphs, SampledRound
from srt_ascend.speculative.mtp_rounds import LaunchedRound, OverlappedRoundsMixin
from srt_ascend.speculative.mtp_start import StartMixin
from srt_ascend.speculative.mtp_verdict import VerdictMixin
from srt_ascend.speculative.mtp_worker import (
    Counts,
    DraftHandles,
    FirstDrafts,
    MTPWorker,
    Starts,
    lengths,
    state_of,
)
from srt_ascend.speculative.round_sampling import host_block
from srt_ascend.speculative.verify import VERIFY_STRATEGIES, Ragged
from srt_ascend.utils import to_device


def draft_step_kinds(layer_for_step, k: int, backend) -> dict[int, GraphKind]:
    """Graph kinds of draft steps 1..K-1 (`MTPWorker.draft_chain`): a step re-running the
    previous step's MTP layer is one token per request (`draft_step{l}`); a step starting a
    later layer of a multi-layer checkpoint covers the chain's j positions (`draft_chain{j}`)."""
    kinds = {}
    for j in range(1, k):
        layer = layer_for_step(j)
        if j == 1 or layer == layer_for_step(j - 1):
            kinds[j] = GraphKind(f"draft_step{layer}", ForwardMode.DECODE, 1, 1, backend, layer)
        else:
            kinds[j] = GraphKind(
                f"draft_chain{j}_l{layer}", ForwardMode.DRAFT_EXTEND, j, 1, backend, layer
            )
    return kinds


def mtp_pass_kinds(suffix: dict[int, str], step_kinds: dict[int, GraphKind], backend):
    """The MTP pass's kinds for each K > 0 in `suffix` (K: its name suffix): layer 0 over
    the K+1 positions (`draft_extend{suffix}`), and with several MTP layers each later layer
    the draft steps run (`draft_extend{suffix}_l{layer}`: its KV over committed positions in
    every MTP pass, no logits). K = 0 steps defer their MTP pass: no kind."""
    extend = {
        j: GraphKind(f"draft_extend{sfx}", ForwardMode.DRAFT_EXTEND, j + 1, 1, backend, 0)
        for j, sfx in suffix.items()
        if j
    }
    later = sorted({kind.mtp_layer for kind in step_kinds.values()} - {0})
    layers = {
        (j, layer): GraphKind(
            f"draft_extend{suffix[j]}_l{layer}",
            ForwardMode.DRAFT_EXTEND,
            j + 1,
            1,
            backend,
            layer,
            logits=False,
        )
        for j in extend
        for layer in later
    }
    return extend, layers


@DECODERS.register("MTP")
class MTPDecoder(StartMixin, OverlappedRoundsMixin, VerdictMixin, Decoder):
    overlaps = True

    def __init__(self, args: ServerArgs, handles: DecoderHandles) -> None:
        super().__init__(args, handles)
        runner, k = self.runner, args.speculative_num_steps
        # K per step: --speculative-num-steps, or 0..K as --speculative-adaptive chooses;
        # graph kinds for every K a step may run (the configured K's keep their plain names).
        # Requests asking fewer drafts (`speculative_num_steps`) ride a step of the smallest
        # K that holds them (`_batch_k`): fixed K adds no kinds (nor their captures/compiles)
        # seeded sampled requests run the server's K (`own_length`) where the policy chooses
        self.pin_seeded, self.num_steps = args.speculative_adaptive, k
        self.adaptive = args.speculative_adaptive
        ks = range(k + 1) if args.speculative_adaptive else [k]
        suffix = {j: "" if j == k else f"_k{j}" for j in ks}
        self.draft_length = DRAFT_LENGTHS.get("adaptive" if args.speculative_adaptive else "fixed")(
            k, graph_buckets(args.cuda_graph_bs, args.max_running_requests)
        )
        # --speculative-verify as the device and model shape allow (ModelRunner.attention_plan);
        # K = 0 is the plain decoder's step, through the decode kind
        strategy = VERIFY_STRATEGIES.get(runner.attention_plan.verify)
        self.verifies = {j: strategy(runner, j, suffix[j]) for j in ks if j}
        self.accept = ACCEPT_METHODS[args.speculative_accept_method]
        backend = runner.attn_backend
        self.step_kinds = draft_step_kinds(runner.mtp.layer_for_step, k, backend)
        extend_kinds, layer_kinds = mtp_pass_kinds(suffix, self.step_kinds, backend)
        self.worker = MTPWorker(
            DraftHandles(
                runner.forward_mtp,
                runner.forward_mtp_logits,
                runner.build_forward_batch,
                handles.req_to_token,
                self.vocab,
                handles.eos_ids,
                # under DP attention every group's passes pair up through their exchanges
                runner.write_mtp_kv if runner.tp.dp_size == 1 else None,
            ),
            extend_kinds,
            self.step_kinds,
            layer_kinds,
        )
        self.plain_kind = self.decode_kind()
        self._kinds = [
            self.plain_kind,
            *(v.kind for v in self.verifies.values()),
            *extend_kinds.values(),
            *layer_kinds.values(),
            *{kind.name: kind for kind in self.step_kinds.values()}.values(),
        ]
        self.num_verify = 0  # request-steps verified (each checks that step's K drafts)
        self.num_drafts = 0  # drafts verified
        self.num_accepted = 0  # drafts accepted
        self.num_ragged = 0  # verify forwards over fewer than B(1+K) rows (verify.Ragged)
        self.verify_rows = 0  # rows the verify forwards built (expand: sum(1 + k_r))
        self.since_prefill = 0  # decode steps since the last prefill (SETTLE_STEPS)
        self.sends_prefills = args.disaggregation_mode == "prefill"
        self._choose_layout(args, strategy)
        self._latest: LaunchedRound | None = None  # the round launched last, until finished
        self.rounds: MTPRoundGraphs | None = None  # whole rounds as graphs (`calibrate`)
        self._read_at = 0.0  # perf_counter at the last overlapped round's read

    def _choose_layout(self, args: ServerArgs, strategy) -> None:
        """Whether rounds overlap (`_takes_bounds`), how requests with k_r = 0 run
        (`split_zeros`, `ragged`), and whether the MTP pass after a ragged verify is ragged."""
        runner = self.runner
        # overlapped rounds need backends that read each row's length on the device
        device = runner.device
        self._takes_bounds = runner.attn_backend.takes_length_bounds(device) and all(
            v.backend.takes_length_bounds(device) for v in self.verifies.values()
        )
        # a step may run requests with k_r = 0 apart, as a second forward (not under DP
        # attention: every group must run the same forwards)
        self.split_zeros = not args.enable_dp_attention
        # the verify builds only each request's 1 + k_r rows (verify.Ragged): requests with
        # k_r = 0 ride in the drafting step as one row each instead of a plain step apart.
        # Not where graphs run the verify and its graphs cannot hold those rows
        # (GraphKind.holds_ragged): a ragged verify would then run eagerly, several times
        # the replay it saves rows of on a device, where the split's two forwards replay
        graphs = args.graphs_enabled(runner.platform)
        self.ragged = strategy.ragged and (
            not graphs or all(v.kind.holds_ragged for v in self.verifies.values())
        )
        self.draft_length.ragged = self.ragged
        # overlapped rounds run ragged rows (requests at 0 among drafting ones: `launch`)
        self._ragged_rounds = self.ragged and all(
            v.ragged_on_device for v in self.verifies.values()
        )
        if self.ragged:
            self.split_zeros = False
        # the MTP pass after a ragged verify over its rows only, where it runs eagerly
        self.worker.ragged_pass = self.ragged and not graphs

    def graph_kinds(self) -> list[GraphKind]:
        return list(self._kinds)

    def stats(self) -> dict:
        n, acceptance = self.num_verify, self.draft_length.acceptance
        return {
            "avg_spec_accept_length": 1.0 + self.num_accepted / n if n else 0.0,
            "spec_num_verify": n,
            "spec_draft_tokens": self.num_drafts,
            "spec_accepted_tokens": self.num_accepted,
            "spec_ragged_steps": self.num_ragged,
            "spec_verify_rows": self.verify_rows,
            "spec_catch_up_passes": self.worker.catch_ups,
            "spec_catch_up_positions": self.worker.caught_up_positions,
            "spec_catch_up_seconds": self.worker.catch_up_seconds,
            "spec_accepted_per_position": list(acceptance.accepted),
            "spec_drafted_per_position": list(acceptance.drafted),
            "spec_acceptance_per_position": [
                a / d if d else 0.0 for a, d in zip(acceptance.accepted, acceptance.drafted)
            ],
            **self.draft_length.stats(),
        }

    def _round_fits(self, reqs: list[StepRequest], k: int, generated: list[int]) -> bool | None:
        """Whether a round of K drafts over `reqs` runs as one graph, and which: None (the
        per-forward path), False (the greedy variant: the batch's sampling is the raw
        argmax, `greedy_without_logprobs`) or True (the sampled variant: nothing modifies
        the logits and no logprobs, `plain_sampling`). Counts `generated`: lower bounds
        suffice, min_new_tokens only grows behind them."""
        if self.rounds is None or not self.rounds.holds(k, len(reqs)):
            return None
        if greedy_without_logprobs(reqs, generated):
            return False
        if self.rounds.holds(k, len(reqs), True) and plain_sampling(reqs, generated):
            return True
        return None

    def _sampled_round(
        self, reqs: list[StepRequest], k: int, low: list[int], span: int = 1
    ) -> SampledRound:
        """The sampled round graph's block, drawn on the host now: each row's settings and
        the uniforms of every count low .. low+span-1 it may have (1: exact counts; an
        overlapped round's range, `Counts`, whose extra the round adds on the device)."""
        bucket = self.rounds.bucket_of(len(reqs))
        block = host_block(reqs, low, span, k, self.rounds.k_max, bucket, self.vocab)
        return SampledRound(block, None, None, needs_filter(reqs, self.vocab))

    def _timed(self, seconds: float) -> float | None:
        """A step's seconds for the cost table, None for the SETTLE_STEPS after a prefill."""
        self.since_prefill += 1
        return seconds if self.since_prefill > SETTLE_STEPS else None

    def after_prefill(self, reqs, starts, lens, hidden, done, next_batch) -> None:
        """MTP pass over an EXTEND batch's positions; requests whose prompt is complete and
        that are still running get their first draft. When the next steps are expected to
        run K = 0 (over `next_batch`, which counts the requests still arriving) the pass is
        deferred instead (`MTPWorker.defer`), as a K = 0 step defers its own: a burst of
        prompts under load then costs what it costs without MTP, from its first prefill."""
        self.since_prefill = 0
        # a prefill server's requests leave with their d_1: never deferred there
        if not self.sends_prefills and self.draft_length.prefers_plain(next_batch):
            self.worker.defer(reqs, starts, lens, hidden)
            return
        self.worker.catch_up(reqs)  # a chunk deferred before: its positions first
        next_tokens = []
        for r, s, n in zip(reqs, starts, lens):
            nxt = r.all_ids[s + 1 : s + n + 1]
            next_tokens.append(nxt + [0] * (n - len(nxt)))  # no next token: KV never keyed
        draft = [d and not r.finished for r, d in zip(reqs, done)]
        self.worker.draft_extend(reqs, starts, lens, hidden, next_tokens, draft)

    def leaving(self, reqs: list[StepRequest]) -> None:
        """Requests leaving unfinished (aborted, retracted) while K = 0 steps have deferred
        MTP passes: the passes run now, without drafting, so that the prefix cache takes
        their slots with their MTP KV written (as `defer` and `finish` do for a request that
        finishes), not with what the slots held before."""
        held = [r for r in reqs if r.decoder_state is not None and r.req_pool_idx is not None]
        self.worker.catch_up(held, draft=False)

    def idle_prefill(self) -> None:
        """The main model's EXTEND forward and the MTP pass over it, over no tokens."""
        self.runner.forward_idle()
        self._idle_mtp_pass()

    def _idle_mtp_pass(self) -> None:
        """`MTPWorker.mtp_pass` over no tokens: layer 0, then the later layers it runs."""
        for layer in [0, *self.worker.later_layers]:
            self.runner.forward_idle(mtp_step=layer)

    def idle_step(self) -> None:
        """A step's forwards over no tokens, in `step`'s order: draft steps 2..K (the MTP
        module at step j), the verify forward, the MTP pass after it. Each forward, idle or
        not, runs one MLP per layer, so the DP groups' MLP collectives pair up one to one. K is
        the configured one: adaptive K (per-process choices) is refused with more than one rank."""
        for j in range(1, self.args.speculative_num_steps):
            self.runner.forward_idle(mtp_step=j)
        self.runner.forward_idle()
        self._idle_mtp_pass()

    @torch.inference_mode()
    def step(self, reqs: list[StepRequest]) -> list[StepRequest]:
        """One serial step. Each request drafts its own k_r (`_plan`); the batch drafts
        K = max k_r and the acceptance rule stops each row at its k_r. Requests with k_r = 0
        beside drafting ones run apart, as the plain decoder's step (`_plain_step`), unless
        the step must stay one forward (`_splits`): then they verify with limit 0."""
        started = time.perf_counter()
        plan = self._plan(reqs, count=True)
        k = self._batch_k(plan)
        limit_of = {id(r): n for r, n in zip(reqs, plan)}
        if not k:
            apart, drafting = list(reqs), []
        elif self.split_zeros:
            apart = [r for r, n in zip(reqs, plan) if not n]
            drafting = [r for r, n in zip(reqs, plan) if n]
        else:
            apart, drafting = [], list(reqs)
        plain_loc = loc = None
        if apart:
            apart, plain_loc = self.h.kv.alloc_running(apart, 1)
        if drafting:
            drafting, loc = self.h.kv.alloc_running(drafting, k + 1)
        if not apart and not drafting:
            self.idle_step()
            return []
        ran = self._plain_step(apart, plain_loc, started) if apart else []
        if drafting:
            limits = [limit_of[id(r)] for r in drafting]
            ran += self._drafted_step(drafting, k, limits, loc)
        return ran

    def own_length(self, req: StepRequest) -> int | None:
        """The drafts a request runs every step whatever the policy chooses: its own
        `speculative_num_steps`; under --speculative-adaptive, --speculative-num-steps for a
        seeded sampled request that asked none (its draws follow its drafts, so a seed
        repeats its tokens only where each step ran the same k_r: fixed, they do whatever
        its neighbours, as the same seed on a fixed-K server); else None (the policy's)."""
        params = req.sampling_params
        if params.speculative_num_steps is not None:
            return params.speculative_num_steps
        if self.pin_seeded and params.seed is not None and not params.is_greedy:
            return self.num_steps
        return None

    def _plan(
        self, reqs: list[StepRequest], count: bool, prev: LaunchedStep | None = None
    ) -> list[int]:
        """Each request's drafts this step, k_r in 0..num_steps: its own (`own_length`)
        when it has one, else what `draft_length` chooses for the
        requests that did not ask (`DraftLength.plan`): one K, or per request under
        --speculative-adaptive with a ragged verify (not where whole-round graphs run the
        batch: `_whole_rounds`) or the split (`count`: the step runs, the policy counts it;
        else a peek, for an overlapped round launched after `prev`, the round in flight)."""
        asked = [self.own_length(r) for r in reqs]
        free = [r for r, a in zip(reqs, asked) if a is None]
        if not free:
            return asked
        most = [self._drafts_left(r, count, prev) for r in free]
        estimates = [capped(self._estimate(r), m) for r, m in zip(free, most)]
        per_request = self.split_zeros or (self.ragged and not self._whole_rounds(reqs))
        plan = self.draft_length.plan(estimates, count, per_request)
        own = (min(k, m) for k, m in zip(plan, most))
        return [next(own) if a is None else a for a in asked]

    def _drafts_left(self, req: StepRequest, count: bool, prev: LaunchedStep | None) -> int:
        """The most drafts a request that asked none may run under adaptive lengths: its
        tokens left less the one every step emits (drafts past its last token commit
        nothing: its estimate expects none there, `capped`, and an exploring plan's draft
        there is dropped). In an overlapped round (not `count`) its committed tokens lag
        `prev`, the round in flight, which commits at least one more where it holds the
        request: that one is taken off too, so the cap never drops a draft that could
        commit. Only where ragged rows run the round (a request at 0 beside drafting ones
        would keep an FIA round from launching); the server's K else."""
        if not self.adaptive or not (count or self._ragged_rounds):
            return self.num_steps
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        if not count and prev is not None and id(req) in prev.index:
            left -= 1
        return max(left, 0)

    def _whole_rounds(self, reqs: list[StepRequest]) -> bool:
        """Whether the batch's rounds run as one graph (`_round_fits`, at the largest K):
        such a round verifies B(1 + K) rows whatever each request's k_r, so shorter drafts
        save it nothing, and the ragged policy's plans (priced by their rows) would trade
        expected tokens for a saving it never makes: the policy then plans one K for all."""
        k = max(self.verifies, default=0)
        return bool(k) and self._round_fits(reqs, k, [len(r.output_ids) for r in reqs]) is not None

    def _batch_k(self, plan: list[int]) -> int:
        """The step's K for requests drafting `plan`: the smallest K with a verify (every one
        under --speculative-adaptive, the configured one else) that holds the longest; 0 when
        none drafts, except under DP attention (no split), where every group runs the same
        forwards: a group whose requests all ask 0 verifies the configured K with limit 0."""
        most = max(plan, default=0)
        if not most and not self.split_zeros and not self.ragged:
            most = min(self.verifies, default=0)
        return min(j for j in self.verifies if j >= most) if most else 0

    def _drafted_step(
        self, reqs: list[StepRequest], k: int, limits: list[int], loc: torch.Tensor
    ) -> list[StepRequest]:
        """The serial step with K = k drafts over requests whose K+1 slots `loc` are
        allocated; request i accepts at most limits[i] of them."""
        started = time.perf_counter()
        k1, device = k + 1, self.runner.device
        caught_up = self.worker.counted_catch_up(reqs)  # a switch's cost, kept out of K's
        starts = [r.kv_len for r in reqs]
        generated = [len(r.output_ids) for r in reqs]
        rows = [r.req_pool_idx for r in reqs]
        limited = self._limits(limits, k)
        ahead, ragged = True, None
        fit = self._round_fits(reqs, k, generated)
        if fit is not None:  # the whole round as one graph
            index, begin, last = pack_to_device([rows, starts, [r.last_id for r in reqs]], device)
            first = self.worker.first_of(reqs)
            sampled = None
            if fit:
                sampled = self._sampled_round(reqs, k, generated)._replace(first_probs=first.probs)
            at = Starts(begin, starts)
            res, _ = self._graph_round(reqs, k, index, at, last, first, limited, sampled)
            logits = None
        else:
            loc = to_device(loc, device).view(len(reqs), k1)  # one copy, three uses
            last = to_device([[r.last_id] for r in reqs], device)
            ragged = self._ragged(limits, k)
            res, logits, hidden = self._verify(
                reqs, k, loc, starts, last, None, generated, rows, limited, ragged, limits
            )
            ahead = self._drafts_ahead(reqs)
            if ahead:  # the MTP pass and the next d_1 from the device verdict, before the read
                self.worker.draft_after_verify(
                    reqs, starts, loc, hidden, res, generated, ragged=ragged
                )
        verdict = self._read(res, logits)
        logprobs = self._logprobs(reqs, verdict)
        estimates = [self._estimate(r) for r in reqs]
        committed = []
        for i, r in enumerate(reqs):
            n = verdict.accept_len[i]
            self._count(r, limits[i], n)
            self.h.commit(r, verdict.emitted[i][: n + 1], logprobs[i])
            committed.append(r.seq_len - 1 - starts[i])  # positions start .. start+c-1 have KV
        if not ahead:  # d_1 follows the committed tokens' state (penalties, grammars, ranks)
            agreed = AcceptResult(
                to_device(verdict.accept_len, loc.device), to_device(verdict.emitted, loc.device)
            )
            drafting = [not r.finished for r in reqs]
            self.worker.draft_after_verify(
                reqs, starts, loc, hidden, agreed, None, drafting, ragged=ragged
            )
        for r, start, c in zip(reqs, starts, committed):
            r.kv_len = start + c
        self.h.kv.free_positions_many(reqs, [r.kv_len for r in reqs], [s + k1 for s in starts])
        seconds = self._timed(time.perf_counter() - started - caught_up)
        self.draft_length.record(estimates, k, verdict.accept_len, seconds, limits)
        return reqs

    def _graph_round(
        self,
        reqs: list[StepRequest],
        k: int,
        rows: torch.Tensor,  # [B] their req_to_token rows, on the device
        starts: Starts,  # the positions of their verify input tokens
        last: torch.Tensor,  # [B] their last committed tokens
        first: FirstDrafts,  # their d_1 (greedy: no distributions)
        limits: torch.Tensor | None,  # [B] drafts each row may accept (None: K)
        sampled: SampledRound | None = None,  # the sampled variant's inputs (`_sampled_round`)
    ) -> tuple[AcceptResult, FirstDrafts]:
        """A round of K drafts replayed as one graph (`_round_fits`): the verdict and the
        next round's d_1, which each request's SpecState keeps too."""
        out = self.rounds.run(
            k, rows, starts.device, starts.bounds, last, first.tokens, first.hidden, limits, sampled
        )
        nxt = FirstDrafts(out.first, out.first_probs, out.first_hidden)
        self.worker.keep_first(reqs, *nxt)
        return AcceptResult(out.accept_len, out.emitted), nxt

    def _ragged(self, limits: list[int] | None, k: int, on_device=False) -> Ragged | None:
        """The ragged verify's rows (verify.Ragged) when some request drafts fewer than K and
        the verify strategy builds rows per request (`on_device`: from sequence lengths on
        the device, an overlapped round's); None: every request's 1 + K rows."""
        verify = self.verifies.get(k)
        if verify is None or not (verify.ragged_on_device if on_device else verify.ragged):
            return None
        if not self.ragged or limits is None or all(n == k for n in limits):
            return None
        return Ragged.of(limits, k, self.runner.device)

    def _limits(self, limits: list[int], k: int) -> torch.Tensor | None:
        """The acceptance rule's per-row limits on the device; None when every row drafts K."""
        if all(n == k for n in limits):
            return None
        return to_device(limits, self.runner.device)

    def _verify(
        self,
        reqs: list[StepRequest],
        k: int,
        loc: torch.Tensor,  # [B, K+1] slots of positions L-1 .. L-1+K
        starts: list[int] | Starts,  # L-1 per request: exact, or on the device (overlap)
        last: torch.Tensor,  # [B, 1] t_{L-1} on the device
        first: FirstDrafts | None,  # d_1 (None: from the requests' states)
        generated: list[int] | Counts,  # tokens each request generated before the round
        rows: list[int],  # their req_to_token rows
        limits: torch.Tensor | None = None,  # [B] drafts each row may accept (None: K)
        ragged: Ragged | None = None,  # verify only each request's 1 + k_r rows
        plan: list[int] | None = None,  # k_r each, host starts: draft step j over k_r > j
    ) -> tuple[AcceptResult, torch.Tensor, torch.Tensor]:
        """Draft steps 2..K, the verify forward and the acceptance rule, on the device:
        (the verdict, the logits it read [B, K+1, V], the target hidden [B*(K+1), D], or
        with `ragged` its kept rows [R, D]). The rule reads row j > k_r as row k_r (never
        past its limit)."""
        # draft steps over the requests drafting further; not under DP attention, where
        # every group runs every draft step (its forwards pair up with the others')
        plan = None if self.runner.tp.dp_size > 1 else plan
        drafts = self.worker.draft_chain(reqs, loc, first, starts, rows, generated, plan)
        verify = self.verifies[k]
        seq, bounds = lengths(starts, 1)
        fb = verify.build(
            torch.cat([last, drafts.tokens], dim=1),
            rows,
            seq,
            loc,
            bounds,
            ragged,
        )
        hidden, logits = self.runner.forward_logits(fb, verify.kind)  # [B*(K+1) or R, D / V]
        self.num_ragged += ragged is not None
        self.verify_rows += fb.num_tokens
        logits = logits[:, : self.vocab]
        if ragged is not None:
            logits = ragged.spread(logits)
        logits = logits.view(len(reqs), k + 1, -1)
        res, logits = self._accept(reqs, logits, drafts, generated, limits)
        return res, logits, hidden

    def _drafts_ahead(self, reqs: list[StepRequest]) -> bool:
        """Whether the round's MTP pass and next d_1 run before its host read (from the
        device verdict): not with penalties or a grammar (d_1 reads their state, which the
        commit advances), nor with several ranks (each rank's d_1 must follow the verdict
        `agree`d across them)."""
        return self.runner.tp.size == 1 and not any(
            r.grammar is not None or has_penalties(r.sampling_params) for r in reqs
        )

    def _plain_step(self, reqs: list[StepRequest], loc: torch.Tensor, started: float):
        """K = 0: the plain decoder's step (one token per request through the decode kind,
        sampled, with its logprobs, as without MTP), and the MTP pass over it deferred."""
        starts = [r.kv_len for r in reqs]
        for r in reqs:  # before the commit, which sends a finishing request's counts
            self._count(r, 0, 0)
        hidden = self.decode_and_commit(reqs, loc, self.plain_kind)
        self.worker.defer(reqs, starts, [1] * len(reqs), hidden)
        estimates = [self._estimate(r) for r in reqs]
        seconds = self._timed(time.perf_counter() - started)
        self.draft_length.record(estimates, 0, [0] * len(reqs), seconds)
        return reqs

    def _estimate(self, req: StepRequest) -> list[float]:
        """The request's moving acceptance per draft position (host floats, in its state)."""
        state = state_of(req)
        if state.acceptance is None:
            kind = "greedy" if req.sampling_params.is_greedy else "sampled"
            state.acceptance = self.draft_length.initial_estimate(kind)
        return state.acceptance

    def _count(self, req: StepRequest, k: int, accepted: int) -> None:
        req.spec_verify_ct += 1
        req.spec_draft_tokens += k
        req.spec_accepted_tokens += accepted
        self.num_verify += 1
        self.num_drafts += k
        self.num_accepted += accepted
