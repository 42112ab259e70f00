"""The scheduler under data-parallel attention (`--enable-dp-attention --dp-size N`).

Every rank runs one scheduler, as under tensor parallelism, but the ranks form N DP groups
(tp/N consecutive ranks each) and each group schedules its own requests, with its own KV
pool and radix cache; its ranks split its attention heads. The MLPs and experts run over
every group's tokens on all ranks (DecoderLayer), so every rank must run the same sequence
of model forwards: the DP-idle rule. One loop, on every rank at once:

1. schedule this group's prefill batch, if it has one (`_schedule_prefill`);
2. exchange one report per rank (an all-gather of Python objects over all ranks): the
   leader's new messages, each new request tagged with the DP group it goes to
   (GroupRouter: --load-balance-method; a prompt's samples with its prefill), and whether
   it stops; every DP group's outputs of the last loop (from its first rank); each rank's
   state: a prefill batch or not, running requests or not, how many requests it holds;
3. run one phase everywhere: if any group has a prefill batch, every group prefills, and a
   group without one runs the same forwards over no tokens (`Decoder.idle_prefill`); else
   if any group has running requests, every group decodes, an idle one through
   `Decoder.idle_step`. A decoder runs the same forwards every step (MTP: K-1 draft
   forwards, the verify forward, the MTP pass), so the groups' MLP collectives pair up
   whatever each group's batch holds, speculative or not;
4. handle the messages (after the step: an abort finds its request queued, running or done).

The first rank of group 0 (rank 0, the serving process) answers state queries and emits its
group's outputs at once; the other groups' outputs reach it in the next exchange.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from srt_ascend.managers.io_struct import ReqOutput, TokenizedGenerateReq
from srt_ascend.managers.scheduler import Scheduler, wire_form

EVERY_GROUP = -1  # the DP group of a message every group handles (abort, flush)
ROUTING_KEYS_KEPT = 4096  # routing keys remembered: a prompt's samples follow its prefill soon


class GroupRouter:
    """Picks the DP group of each new request (--load-balance-method: in turn, or the group
    with the fewest requests). Requests with the same `routing_key` go to the group the
    first of them went to (the parallel samples of a prompt and its shared prefill meet in
    that group's radix cache); the last ROUTING_KEYS_KEPT keys are remembered."""

    def __init__(self, dp_size: int, method: str, keep: int = ROUTING_KEYS_KEPT) -> None:
        self.method = method
        self.keep = keep
        self._round_robin = itertools.cycle(range(dp_size))
        self._groups: OrderedDict[str, int] = OrderedDict()  # routing key -> group

    def group_of(self, routing_key: str | None, loads: list[int]) -> int:
        """The group of a new request; counts it into `loads` (requests per group)."""
        group = self._groups.get(routing_key) if routing_key is not None else None
        if group is not None:
            self._groups.move_to_end(routing_key)
        else:
            if self.method == "round_robin":
                group = next(self._round_robin)
            else:
                group = min(range(len(loads)), key=lambda g: loads[g])
            if routing_key is not None:
                self._groups[routing_key] = group
                if len(self._groups) > self.keep:
                    self._groups.popitem(last=False)
        loads[group] += 1
        return group


@dataclass
class RankReport:
    """What one rank tells all others at the top of a loop."""

    has_prefill: bool  # this rank's group has a prefill batch this loop
    has_running: bool  # ... has running requests
    running: int  # requests running (a chunked prefill counts)
    queued: int  # requests waiting
    outputs: list[ReqOutput] = field(default_factory=list)  # its group's, first rank only
    # The leader's only:
    stop: bool = False
    msgs: list[tuple[int, object]] = field(default_factory=list)  # (DP group, message)


class DPAttentionScheduler(Scheduler):
    def __init__(self, server_args, runner, stop_checker, emit) -> None:
        super().__init__(server_args, runner, stop_checker, emit)
        self._pending: list[ReqOutput] = []  # a non-leader group's outputs, sent next loop
        self._reports: list[RankReport] = []  # the last exchange's, one per rank
        self._leader_msgs: list[tuple[int, object]] = []  # the leader's, with reply futures
        self._router = GroupRouter(self.tp.dp_size, server_args.load_balance_method)
        self._group_ranks = self.tp.size // self.tp.dp_size

    def run_forever(self) -> None:
        """Runs until the leader stops; a failed step raises (the ranks would disagree)."""
        while True:
            batch = self._schedule_prefill()
            reports = self._exchange(batch is not None)
            leader = reports[0]
            if leader.stop:
                return
            worked = self._run_phase(batch, reports)
            msgs = self._leader_msgs if self.tp.is_leader else leader.msgs
            self.handle_all([m for g, m in msgs if g in (EVERY_GROUP, self.tp.dp_rank)])
            if worked and not self.has_work():
                self._check_when_idle()

    def _run_phase(self, batch, reports: list[RankReport]) -> bool:
        """One prefill or decode phase on every rank (module docstring, step 3); True when
        this rank's group ran requests."""
        if any(r.has_prefill for r in reports):
            if batch is None:
                self.decoder.idle_prefill()
                return False
            self.in_flight = batch.reqs
            self._run_prefill(batch)
        elif any(r.has_running for r in reports):
            if not self.running:
                self.decoder.idle_step()
                return False
            self.in_flight = self.running
            self._run_decode()
        else:
            return False
        self.in_flight = []
        return True

    def _exchange(self, has_prefill: bool) -> list[RankReport]:
        """Step 2 of the loop. The leader waits for messages (up to 0.5 s) only when no
        group had work at the last exchange; it emits the other groups' outputs."""
        report = RankReport(
            has_prefill,
            bool(self.running),
            len(self.running) + (1 if self.chunked_req else 0),
            len(self.waiting),
        )
        report.outputs, self._pending = self._pending, []
        if self.tp.is_leader:
            busy = self.has_work() or any(self._busy(r) for r in self._reports)
            loads = self._group_loads()
            self._leader_msgs = [(self._group_of(m, loads), m) for m in self._take_inbox(not busy)]
            report.stop = self._stop.is_set()
            report.msgs = [(g, w) for g, m in self._leader_msgs for w in wire_form([m])]
        self._reports = self.tp.all_gather_object(report)
        if self.tp.is_leader:
            self._emit([out for r in self._reports[1:] for out in r.outputs])
        return self._reports

    @staticmethod
    def _busy(report: RankReport) -> bool:
        return bool(report.running or report.queued or report.has_prefill)

    def _group_of(self, msg, loads: list[int]) -> int:
        """The DP group a new request goes to (GroupRouter), counted into `loads`; every
        group for other messages."""
        if not isinstance(msg, TokenizedGenerateReq):
            return EVERY_GROUP
        return self._router.group_of(msg.routing_key, loads)

    def _group_loads(self) -> list[int]:
        """Requests each DP group holds, by its first rank's last report (0 before any)."""
        if not self._reports:
            return [0] * self.tp.dp_size
        return [r.running + r.queued for r in self._reports[:: self._group_ranks]]

    def _emit(self, outputs: list[ReqOutput]) -> None:
        """Rank 0 emits; another group's first rank sends its outputs in the next exchange;
        the other ranks' outputs are their group's first rank's."""
        if self.tp.is_leader:
            super()._emit(outputs)
        elif self.tp.is_dp_leader:
            self._pending += outputs

    def internal_state(self) -> dict:
        """Rank 0's state, with the requests of every DP group (as of the last exchange)."""
        state = super().internal_state()
        others = self._reports[self._group_ranks :: self._group_ranks]
        state["dp_group_requests"] = [
            state["num_running_reqs"] + state["num_queue_reqs"],
            *(r.running + r.queued for r in others),
        ]
        state["num_running_reqs"] += sum(r.running for r in others)
        state["num_queue_reqs"] += sum(r.queued for r in others)
        return state
