"""Shared by the examples: the server URL from --url (default: a local server)."""

from __future__ import annotations

import argparse
import json

DEFAULT_URL = "http://127.0.0.1:30000"


def parse_url(description: str) -> str:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=DEFAULT_URL, help="srt_ascend server base URL")
    return parser.parse_args().url.rstrip("/")


def report(result: dict) -> None:
    """Prints the example's result as one JSON line (the e2e tests read it)."""
    print(json.dumps(result))
