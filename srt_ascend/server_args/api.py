"""ServerArgs' API and admission flags: keys, body size (--max-request-body-mb or SGLang's
--max-payload-size), the tokenize bound, read deadline, queue and batch limits, shutdown; the
secrets no route returns."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

# Fields holding secrets: never returned by an endpoint nor logged (`ServerArgs.redacted`).
SECRET_FIELDS = ("api_key", "admin_api_key")
REDACTED = "****"


class ApiArgsMixin:
    """ServerArgs' API properties (no fields: those are ServerArgs')."""

    def redacted(self) -> dict:
        """Every field as a dict, each set secret (SECRET_FIELDS) replaced by REDACTED; an
        unset one stays None, so a reader still sees whether a key is configured. What
        /server_info returns (SGLang's redaction)."""
        info = dataclasses.asdict(self)
        for name in SECRET_FIELDS:
            if info[name] is not None:
                info[name] = REDACTED
        return info

    @property
    def max_request_body_bytes(self) -> int:
        if self.max_payload_size is not None:
            return self.max_payload_size
        return int(self.max_request_body_mb * (1 << 20))

    def _check_request_bounds(self) -> None:
        """--max-payload-size and --max-request-body-mb name one bound: both set (the MiB one
        off its default) to different sizes is an error; --max-tokenize-tokens >= 1."""
        payload, mb = self.max_payload_size, self.max_request_body_mb
        if payload is not None and payload < 1:
            raise ValueError("--max-payload-size must be >= 1 (bytes)")
        default_mb = self.__dataclass_fields__["max_request_body_mb"].default
        if payload is not None and mb != default_mb and int(mb * (1 << 20)) != payload:
            raise ValueError(
                f"--max-payload-size {payload} and --max-request-body-mb {mb:g} give two "
                "different request body bounds: give one of them"
            )
        if self.max_tokenize_tokens is not None and self.max_tokenize_tokens < 1:
            raise ValueError("--max-tokenize-tokens must be >= 1")


def add_api_flags(parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]) -> None:
    a = parser.add_argument
    a(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health*, /metrics",
    )
    a(
        "--admin-api-key",
        default=None,
        help="key for the admin endpoints (/flush_cache); when set they do not accept --api-key",
    )
    a(
        "--max-request-body-mb",
        type=float,
        default=d["max_request_body_mb"].default,
        help="largest request body accepted (MiB); larger ones get HTTP 413",
    )
    a(
        "--max-payload-size",
        type=int,
        default=None,
        help="SGLang's spelling of the request body bound, in bytes (one bound with "
        "--max-request-body-mb: giving both with different sizes is an error)",
    )
    a(
        "--max-tokenize-tokens",
        type=int,
        default=None,
        help="most tokens a text may have on any route that tokenizes (/generate, "
        "/v1/*, /tokenize, chat templates, score, responses); more get HTTP 400 "
        "(default: the context length)",
    )
    a(
        "--request-read-timeout",
        type=float,
        default=d["request_read_timeout"].default,
        help="seconds a client has to send a whole request (headers and body) once its "
        "connection opens or its request starts; slower ones are disconnected",
    )
    a(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests allowed to wait beyond --max-running-requests; more get HTTP 503 "
        "(default: no limit)",
    )
    a(
        "--max-prompts-per-request",
        type=int,
        default=d["max_prompts_per_request"].default,
        help="generations one request may ask for (prompts of a batch times n); more get HTTP 400",
    )
    a(
        "--shutdown-timeout",
        type=float,
        default=d["shutdown_timeout"].default,
        help="on SIGTERM/SIGINT, seconds to let running requests finish before the rest "
        "are aborted (finish_reason abort) and the process exits",
    )
