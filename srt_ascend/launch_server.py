"""`python -m srt_ascend.launch_server [flags]` (console script `srt-ascend`): the HTTP server.

Flags use SGLang's names (see `--help`). A setting that makes no sense (unknown algorithm, a
device that is not there, a model path that is not a checkpoint) is one line on stderr and exit
code 2. Once the first generation has gone through, the server logs SGLang's
"The server is fired up and ready to roll!". SIGTERM or SIGINT drains: new requests get 503,
running ones have `--shutdown-timeout` seconds to finish, the rest end with finish_reason abort,
and the process exits 0 (a second signal skips the wait). If it has not stopped some time
after that (`SHUTDOWN_SLACK_S`: a stuck event loop or scheduler), it ends with one error line
and exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time

from srt_ascend.server_args import ServerArgs, prepare_server_args

logger = logging.getLogger("srt_ascend.launch_server")

READY_MESSAGE = "The server is fired up and ready to roll!"


def fail(message: str) -> None:
    """One line on stderr, exit code 2 (argparse's code for a bad command line)."""
    sys.stderr.write(f"srt_ascend.launch_server: error: {message}\n")
    sys.exit(2)


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            fail(f"cannot listen on {host}:{port}: {e.strerror}")


def check_device(device: str) -> str:
    """The device type `--device` resolves to (`auto`: npu, cuda, cpu), or exit 2."""
    from srt_ascend.platforms import DeviceUnavailable, get_platform

    try:
        return get_platform(device).name
    except DeviceUnavailable as e:
        fail(str(e))
        raise  # unreachable: fail exits


def resolve_device_settings(server_args: ServerArgs, device_type: str) -> ServerArgs:
    """Per-device defaults filled in (`ServerArgs.for_device`) and the attention plan checked
    against the model's shape (`resolve_attention_plan`), so that a flag or shape the device
    cannot run is one line and exit 2 before the model loads, not an error at the first
    request."""
    from srt_ascend.layers.attention.device_plan import (
        UnsupportedOnDevice,
        resolve_attention_plan,
    )
    from srt_ascend.models.loader import load_config, tp_shape_problem

    try:
        args = server_args.for_device(device_type)
    except ValueError as e:
        fail(str(e))
        raise  # unreachable: fail exits
    try:
        cfg = load_config(args.model_path)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        fail(f"cannot load the model from {args.model_path!r}: {e}")
        raise
    problem = tp_shape_problem(cfg, args.tp_size, args.ep_size > 1, args.attn_tp_size)
    if problem:
        fail(problem)
    try:
        plan = resolve_attention_plan(
            device_type,
            cfg.num_attention_heads // args.attn_tp_size,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            args.page_size,
            server_args.speculative_verify if args.spec_enabled else None,
        )
    except UnsupportedOnDevice as e:
        fail(str(e))
        raise
    if plan.fallback and args.spec_enabled:
        logger.info("%s", plan.fallback)
    return args


def build_tokenizer_manager(server_args: ServerArgs):
    """The TokenizerManager (model loaded, scheduler thread started), or exit 2 with one line
    when the device is missing or the checkpoint cannot be loaded."""
    from srt_ascend.managers.tokenizer_manager import TokenizerManager
    from srt_ascend.platforms import DeviceUnavailable

    try:
        return TokenizerManager(server_args)
    except DeviceUnavailable as e:
        fail(str(e))
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        fail(f"cannot load the model from {server_args.model_path!r}: {e}")


async def warmup(tokenizer_manager) -> None:
    """One greedy token through the whole runtime."""
    bos = tokenizer_manager.tokenizer.bos_token_id
    req = tokenizer_manager.make_request(
        [bos if bos is not None else 0], {"max_new_tokens": 1, "temperature": 0}
    )
    async for _ in tokenizer_manager.generate_one(req):
        pass


ABORT_GRACE_S = 10.0  # how long aborted requests get to send their last output
# After a signal, how long past the drain (--shutdown-timeout, then ABORT_GRACE_S) the process
# may take to stop (uvicorn closing, the scheduler thread joining) before it is ended.
SHUTDOWN_SLACK_S = 15.0


def hard_exit(message: str) -> None:
    """One error line, exit code 1, whatever the other threads are doing."""
    logger.error("%s", message)
    logging.shutdown()
    os._exit(1)


def exit_unless_stopped_within(seconds: float) -> None:
    """Starts a daemon thread that ends the process (`hard_exit`) if it still runs `seconds`
    from now: a signal stays effective when the event loop or the scheduler is stuck. The
    exit function is the one in force when the watchdog is armed."""
    end = hard_exit

    def watch() -> None:
        time.sleep(seconds)
        end(f"the server did not stop within {seconds:.0f} s of the signal; exiting")

    threading.Thread(target=watch, name="srt-shutdown-watchdog", daemon=True).start()


async def drain(tokenizer_manager, timeout: float, abort_now: asyncio.Event) -> None:
    """Refuses new requests, waits up to `timeout` s (or until `abort_now`) for the running
    ones, then aborts the rest (each gets a finish_reason abort output whose message says
    that the server is shutting down)."""
    from srt_ascend.managers.io_struct import SERVER_SHUTTING_DOWN

    tm = tokenizer_manager
    tm.draining = True
    logger.info(
        "shutting down: %d requests in flight, waiting up to %.0f s", tm.num_in_flight(), timeout
    )
    deadline = time.monotonic() + timeout
    while tm.num_in_flight() and time.monotonic() < deadline and not abort_now.is_set():
        await asyncio.sleep(0.05)
    if tm.num_in_flight():
        logger.info("aborting the %d requests still in flight", tm.num_in_flight())
        tm.abort("", SERVER_SHUTTING_DOWN)
        deadline = time.monotonic() + ABORT_GRACE_S
        while tm.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def draining_server(config, tokenizer_manager, timeout: float):
    """A uvicorn.Server whose SIGTERM/SIGINT runs `drain` before uvicorn stops (uvicorn's own
    handler would stop at once and re-raise the signal afterwards)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Task | None = None
        abort_now: asyncio.Event | None = None

        signals = 0

        def handle_exit(self, sig, frame) -> None:
            """Runs in the main thread, between two bytecodes, even while the event loop is
            busy: it arms the watchdog (the drain's time, then the slack; a second signal:
            the abort grace, then the slack) and asks the loop to drain."""
            self.signals += 1
            grace = ABORT_GRACE_S + (timeout if self.signals == 1 else 0.0)
            exit_unless_stopped_within(grace + SHUTDOWN_SLACK_S)
            if self.loop is None:  # before serving: stop as uvicorn does
                self.should_exit = True
                return
            self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            if self.drain_task is not None:  # a second signal: abort now
                self.abort_now.set()
                return
            self.abort_now = asyncio.Event()
            self.drain_task = asyncio.ensure_future(
                drain(tokenizer_manager, timeout, self.abort_now)
            )
            self.drain_task.add_done_callback(lambda _: setattr(self, "should_exit", True))

    return DrainingServer(config)


async def serve(server, tokenizer_manager) -> None:
    """Runs uvicorn; logs READY_MESSAGE after it listens and a warmup request succeeded."""
    tokenizer_manager.loop = asyncio.get_running_loop()
    server.loop = tokenizer_manager.loop
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        try:
            await warmup(tokenizer_manager)
        except Exception:
            logger.exception("warmup request failed; shutting down")
            server.should_exit = True
            await task
            raise
        logger.info(READY_MESSAGE)
    await task


def configure_logging(server_args: ServerArgs) -> None:
    try:
        logging.basicConfig(
            level=server_args.log_level.upper(),
            format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        )
    except ValueError:
        fail(f"unknown --log-level {server_args.log_level!r} (debug, info, warning, error)")


def main(argv: list[str] | None = None) -> None:
    run(prepare_server_args(argv))


def serve_ranks_only(server_args: ServerArgs) -> None:
    """A node other than node 0 (--node-rank > 0) serves no HTTP: it runs its share of the
    tensor-parallel ranks until node 0's leader stops them."""
    from srt_ascend.managers.tp_ranks import RankProcesses, dist_init_of, fail_fast

    logger.info("node %d of %d: running ranks only", server_args.node_rank, server_args.nnodes)
    RankProcesses(server_args, dist_init_of(server_args), fail_fast).wait()


def run(server_args: ServerArgs) -> None:
    """Runs the server for already-parsed settings until it is stopped (also used by the
    SGLang launcher plugin, `srt_ascend.sglang_plugin`)."""
    configure_logging(server_args)
    device_type = check_device(server_args.device)  # before anything is loaded or logged
    server_args = resolve_device_settings(server_args, device_type)
    if server_args.node_rank > 0:
        serve_ranks_only(server_args)
        return
    check_port(server_args.host, server_args.port)
    tokenizer_manager = build_tokenizer_manager(server_args)
    import uvicorn

    from srt_ascend.entrypoints.http_protocol import bounded_read_protocol
    from srt_ascend.entrypoints.http_server import create_app

    app = create_app(tokenizer_manager, server_args)
    config = uvicorn.Config(
        app,
        http=bounded_read_protocol(server_args.request_read_timeout),
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level.lower(),
        timeout_keep_alive=5,
        loop="asyncio",
    )
    try:
        server = draining_server(config, tokenizer_manager, server_args.shutdown_timeout)
        asyncio.run(serve(server, tokenizer_manager))
    finally:
        tokenizer_manager.shutdown()


if __name__ == "__main__":
    main()
