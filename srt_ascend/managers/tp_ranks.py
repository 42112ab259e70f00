"""The processes of a tensor-parallel server: one scheduler/model process per rank.

Rank 0 (the leader) runs in the serving process, in the scheduler thread beside the HTTP and
tokenizer side, as the only rank does without parallelism; the other ranks of this node are
processes started here (torch.multiprocessing, spawn). Every rank runs the same Scheduler: the
leader receives the requests and broadcasts what it took from its inbox at the top of each
loop, so every rank schedules, matches prefixes, samples and accepts alike (the same seed, the
same logits after the LM head's all-gather) and runs the same forwards, whose collectives then
pair up. A rank that dies takes the server down at once with one error line naming it
(`fail_fast`): its peers would otherwise wait in a collective for ever. Across nodes the
failure is posted on the failure board (distributed/failure_board.py), which every node
watches, so every node ends; --dist-timeout bounds any collective as a last resort.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable

from srt_ascend.distributed import SINGLE, DistInit, TPGroup, init_tp_group
from srt_ascend.distributed.failure_board import (
    FAILED_KEY,
    STOPPING_KEY,
    FailureBoard,
    StoreLost,
)
from srt_ascend.managers.dp_scheduler import DPAttentionScheduler
from srt_ascend.managers.scheduler import Scheduler
from srt_ascend.managers.stop_checker import StopChecker
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import Platform, get_platform
from srt_ascend.server_args import ServerArgs

logger = logging.getLogger(__name__)

WATCH_POLL_S = 0.5  # how often a node's watcher reads the failure board


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def dist_init_of(args: ServerArgs) -> DistInit:
    """Where this server's ranks meet: --dist-init-addr, else a free port on this machine."""
    addr = args.dist_init_addr
    if addr is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{s.getsockname()[1]}"
    return DistInit(addr, args.tp_size, args.nnodes, args.node_rank, args.dist_timeout)


def join_group(args: ServerArgs, dist_init: DistInit, local_rank: int, backend: str) -> TPGroup:
    """Joins this server's group of ranks as this node's `local_rank` (expert parallelism,
    data-parallel attention and the MoE dispatch as the flags say)."""
    a2a = args.moe_a2a_backend == "all_to_all"
    return init_tp_group(dist_init, local_rank, backend, args.ep_size > 1, args.attn_dp_size, a2a)


def build_scheduler(
    args: ServerArgs, platform: Platform, tokenizer, emit, tp: TPGroup = SINGLE
) -> Scheduler:
    """One rank's model, KV pools, graphs and scheduler, built in the thread that runs them;
    returns once every rank has built its own (so the server listens only when all can run).
    Seeds torch with --random-seed (the same on every rank: unseeded sampling draws alike)."""
    import torch

    threads = args.num_threads
    if threads is None:
        threads = platform.default_threads(tp.size // args.nnodes)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(args.random_seed)
    runner = ModelRunner(args, platform, tp)
    eos = runner.config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if tokenizer.eos_token_id is not None:
        eos_ids.append(tokenizer.eos_token_id)
    # Data-parallel attention: each DP group schedules its own requests (dp_scheduler).
    cls = DPAttentionScheduler if tp.dp_size > 1 else Scheduler
    scheduler = cls(args, runner, StopChecker(tokenizer, eos_ids), emit)
    tp.barrier()
    return scheduler


def fail_fast(message: str) -> None:
    """One error line, then this process ends (exit code 1): a server cannot go on without its
    scheduler or one of its ranks, and its other ranks end when their collectives lose this
    one."""
    logger.error("%s", message)
    logging.shutdown()
    os._exit(1)


class RankProcesses:
    """This node's ranks other than the leader, as processes, and a thread that watches them:
    one that fails (a non-zero exit: an error, a signal) while the server runs calls
    `on_failure` with a message naming it. A rank exits 0 only when the leader stopped."""

    def __init__(
        self, args: ServerArgs, dist_init: DistInit, on_failure: Callable[[str], None]
    ) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        first = 1 if dist_init.node_rank == 0 else 0  # rank 0 is the serving process
        self.procs = []
        for local_rank in range(first, dist_init.ranks_per_node):
            rank = dist_init.rank_of(local_rank)
            p = ctx.Process(
                target=run_rank,
                args=(args, dist_init, local_rank, os.getpid()),
                name=f"srt-tp-rank-{rank}",
                daemon=True,
            )
            p.start()
            logger.info("started tensor-parallel rank %d (pid %d)", rank, p.pid)
            self.procs.append(p)
        self.stopping = False
        self._on_failure = on_failure
        self.node_rank = dist_init.node_rank
        # Several nodes: they tell each other to stop through the rendezvous store.
        self.board = FailureBoard(dist_init) if dist_init.nnodes > 1 else None
        self._watcher = threading.Thread(target=self._watch, name="srt-tp-watch", daemon=True)
        self._watcher.start()

    def announce_stop(self) -> None:
        """Node 0's normal shutdown: its ranks' exits, and the store's going away, are the
        stop, not a fault (here and, through the board, on the other nodes)."""
        self.stopping = True
        if self.board is not None:
            self.board.post(STOPPING_KEY, "node 0 stops")

    def _watch(self) -> None:
        """Until this node's ranks have all ended (node 0: until it stops): a rank that fails
        is posted on the board and ends this node; a failure another node posted, or node 0
        gone without stopping, ends this one too."""
        alive = {p.sentinel: p for p in self.procs}
        while alive or (self.board is not None and not self.stopping):
            ready = multiprocessing.connection.wait(list(alive), timeout=WATCH_POLL_S)
            if not alive:
                time.sleep(WATCH_POLL_S)
            for sentinel in ready:
                p = alive.pop(sentinel)
                p.join()  # it has ended: this only collects the exit code
                if self.stopping or p.exitcode == 0:
                    continue
                rank = p.name.removeprefix("srt-tp-rank-")
                message = (
                    f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode} "
                    f"on node {self.node_rank}; the server cannot run without it and stops"
                )
                if self.board is not None:
                    self.board.post(FAILED_KEY, message)
                self._on_failure(message)
                return
            failure = self._read_board() if self.board is not None else None
            if failure is not None:
                self._on_failure(failure)
                return

    def _read_board(self) -> str | None:
        """Why this node must end, from the board; None while all is well (or stopping)."""
        if self.stopping:
            return None
        try:
            failure, node0_stops = self.board.read()
        except StoreLost:
            if self.node_rank > 0 and not self.stopping:
                return "node 0 is gone (its rendezvous store closed); this node stops"
            return None
        if node0_stops:
            self.stopping = True
            return None
        return failure

    def wait(self) -> None:
        """Blocks while the ranks run (a node that serves no HTTP)."""
        self._watcher.join()

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for the ranks to leave (the leader has broadcast the stop), then ends what
        is left."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()


def run_rank(args: ServerArgs, dist_init: DistInit, local_rank: int, parent_pid: int) -> None:
    """A non-leader rank's process: joins the group, builds its scheduler and runs it on the
    leader's broadcasts until the leader stops (exit 0) or anything fails (exit 1)."""
    rank = dist_init.rank_of(local_rank)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"[%(asctime)s TP{rank}] %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        platform = get_platform(args.device)
        platform.set_device(local_rank)
        args = args.for_device(platform.name)
        tp = join_group(args, dist_init, local_rank, platform.dist_backend)
        scheduler = build_scheduler(args, platform, load_tokenizer(args.tokenizer), _drop, tp)
        scheduler.run_forever()
    except BaseException:  # noqa: BLE001 - reported, then the process ends with code 1
        logger.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    tp.destroy()


def _drop(outputs) -> None:
    """A non-leader rank's outputs: the leader's identical ones are the ones sent."""


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this rank when the process that started it is gone (killed, not stopped)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
