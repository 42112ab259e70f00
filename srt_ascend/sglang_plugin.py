"""SGLang launcher integration: `python -m sglang.launch_server ... --speculative-algorithm MTP`
and `sglang serve ... --speculative-algorithm MTP` start srt_ascend's server.

Two entry points (see pyproject.toml):

- `sglang.srt.plugins` -> `register`: SGLang calls it in `python -m sglang.launch_server` (and
  `sglang serve`) before the command line is parsed. Unless the command line asks for
  `--speculative-algorithm MTP` it does nothing at all. Otherwise it hooks (AROUND)
  `sglang.srt.server_args.prepare_server_args`: a call whose argv asks for MTP translates the
  flags and runs srt_ascend's server instead of SGLang's; any other call goes to SGLang.
- `sglang.serve_backends` -> `serve_backend`: the `srt-ascend` backend of `sglang serve`,
  picked automatically (detector) when the command line asks for MTP, or with
  `--model-type srt-ascend`.

Translation: SGLang's own parser reads the argv (so SGLang's flag names, aliases and types
apply); every flag given that srt_ascend supports maps to its field, and the rest are listed
in one warning line at start (parallelism: `--tp-size`, `--ep-size`, `--dist-init-addr`,
`--nnodes`, `--node-rank`, `--enable-dp-attention`, `--dp-size`, `--load-balance-method`,
`--moe-a2a-backend` map to srt_ascend's fields of the same names; so do
`--disaggregation-mode`, `--disaggregation-transfer-backend`, `--disaggregation-bootstrap-port`
and `--disaggregation-ib-device`). Flags that only srt_ascend has
(`--num-threads`, `--speculative-verify`, `--cpu-small-gemm`, `--max-request-body-mb`,
`--shutdown-timeout`, `--request-read-timeout`, `--max-prompts-per-request`,
`--grammar-compile-timeout`, `--grammar-max-size`, `--disaggregation-timeout`), and
`--moe-a2a-backend` (whose
`all_to_all` value SGLang's parser does not know; srt_ascend checks the value), are taken out
of argv before SGLang parses it.

Importing this module imports nothing heavy (no torch, no torch_npu, no sglang runtime).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger("srt_ascend.sglang_plugin")

ALGORITHM = "MTP"
HOOK_TARGET = "sglang.srt.server_args.prepare_server_args"

# SGLang dest -> srt_ascend field, where the names differ.
RENAMED = {
    "cuda_graph_bs_decode": "cuda_graph_bs",
    "cuda_graph_max_bs_decode": "cuda_graph_max_bs",
}


def wants_mtp(argv: Sequence[str]) -> bool:
    """Whether argv asks for `--speculative-algorithm MTP` (either spelling, any case)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--speculative-algorithm" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--speculative-algorithm="):
            value = arg.split("=", 1)[1]
        else:
            continue
        if value.upper() == ALGORITHM:
            return True
    return False


def _split_own_flags(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Takes the srt_ascend-only flags out of argv: ({field: value}, the rest)."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--num-threads", type=int, default=argparse.SUPPRESS)
    own.add_argument("--speculative-verify", default=argparse.SUPPRESS)
    own.add_argument("--speculative-accept-method", default=argparse.SUPPRESS)
    own.add_argument("--speculative-adaptive", action="store_true", default=argparse.SUPPRESS)
    own.add_argument("--cpu-small-gemm", default=argparse.SUPPRESS)
    own.add_argument("--max-request-body-mb", type=float, default=argparse.SUPPRESS)
    own.add_argument("--shutdown-timeout", type=float, default=argparse.SUPPRESS)
    own.add_argument("--request-read-timeout", type=float, default=argparse.SUPPRESS)
    own.add_argument("--max-prompts-per-request", type=int, default=argparse.SUPPRESS)
    own.add_argument("--grammar-compile-timeout", type=float, default=argparse.SUPPRESS)
    own.add_argument("--grammar-max-size", type=int, default=argparse.SUPPRESS)
    own.add_argument("--disaggregation-timeout", type=float, default=argparse.SUPPRESS)
    # SGLang's parser knows its own values only; srt_ascend checks this one (all_to_all is ours)
    own.add_argument("--moe-a2a-backend", default=argparse.SUPPRESS)
    ns, rest = own.parse_known_args(list(argv))
    return vars(ns), rest


def translate(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """SGLang argv -> (srt_ascend ServerArgs kwargs, SGLang flags srt_ascend does not support).

    Only flags present on the command line count; SGLang's defaults are not carried over."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs as SGLangServerArgs

    from srt_ascend.server_args import ServerArgs

    kwargs, rest = _split_own_flags(argv)
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    SGLangServerArgs.add_cli_args(parser)
    options = {}
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # so the namespace holds only the given flags
        if action.option_strings:
            options[action.dest] = action.option_strings[0]
    given = vars(parser.parse_args(rest))

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    unsupported = []
    for dest, value in given.items():
        name = RENAMED.get(dest, dest)
        if name not in fields:
            unsupported.append(options.get(dest, dest))
            continue
        if name == "cuda_graph_bs" and value is not None:
            value = tuple(value)
        if name == "speculative_algorithm":
            value = value.upper()
        kwargs[name] = value
    return kwargs, unsupported


def run_mtp(argv: Sequence[str]) -> None:
    """Translates SGLang's argv and runs srt_ascend's server; a bad setting is one line on
    stderr and exit code 2, as with `python -m srt_ascend.launch_server`."""
    from srt_ascend.launch_server import check_device, configure_logging, fail, run
    from srt_ascend.server_args import ServerArgs

    kwargs, unsupported = translate(argv)
    try:
        server_args = ServerArgs(**kwargs)
    except ValueError as e:
        fail(str(e))
    check_device(server_args.device)  # before anything is logged
    configure_logging(server_args)
    if unsupported:
        logger.warning(
            "srt_ascend does not support these SGLang flags (ignored): %s", " ".join(unsupported)
        )
    logger.info("--speculative-algorithm %s: serving with srt_ascend", ALGORITHM)
    run(server_args)


def _around_prepare_server_args(original, argv, *args, **kwargs):
    if not wants_mtp(argv) or any(h in argv for h in ("-h", "--help")):
        return original(argv, *args, **kwargs)
    run_mtp(argv)
    sys.exit(0)


def register() -> None:
    """`sglang.srt.plugins` entry point: hooks SGLang's argument parsing, only when the
    command line asks for MTP (otherwise SGLang runs exactly as without this plugin)."""
    if not wants_mtp(sys.argv[1:]):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, _around_prepare_server_args, HookType.AROUND)


def _detect(request):
    from sglang.cli.serve_backends import ServeBackendDetection

    if wants_mtp(request.argv):
        return ServeBackendDetection.MATCH
    return ServeBackendDetection.NO_MATCH


def _serve(request) -> None:
    if any(h in request.argv for h in ("-h", "--help")):
        from srt_ascend.server_args import prepare_server_args

        prepare_server_args(["--help"])
        return
    run_mtp(request.argv)


def serve_backend():
    """`sglang.serve_backends` entry point: the `srt-ascend` backend of `sglang serve`."""
    from sglang.cli.serve_backends import SERVE_BACKEND_API_VERSION, ServeBackend

    return ServeBackend(api_version=SERVE_BACKEND_API_VERSION, run=_serve, detect=_detect)
