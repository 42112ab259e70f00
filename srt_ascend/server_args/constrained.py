"""ServerArgs' constrained-generation flags: the grammar backend, JSON whitespace, grammar
compile bounds (checked in ServerArgs.check)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

# --grammar-backend values served here: xgrammar (SGLang's default) and llguidance
# (constrained/compilers.py). SGLang's outlines and none are not available.
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")


def add_constrained_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    a = parser.add_argument
    a(
        "--constrained-json-disable-any-whitespace",
        action="store_true",
        help="JSON-schema outputs are compact (no whitespace between JSON tokens) instead "
        "of allowing any whitespace there",
    )
    a(
        "--grammar-backend",
        default=d["grammar_backend"].default,
        help="constrained-generation backend: xgrammar or llguidance (SGLang's outlines "
        "and none are refused)",
    )
    a(
        "--enable-custom-logit-processor",
        action="store_true",
        help="refused (one error line): user-supplied logit processors (SGLang's "
        "custom_logit_processor / custom_params) are not supported by this server",
    )
    a(
        "--constrained-json-max-whitespace-cnt",
        type=int,
        default=d["constrained_json_max_whitespace_cnt"].default,
        help="most consecutive whitespace characters between JSON tokens of a JSON-schema "
        "output (0: unbounded, SGLang's default; a small model otherwise pads with "
        "whitespace until its token limit)",
    )
    a(
        "--grammar-compile-timeout",
        type=float,
        default=d["grammar_compile_timeout"].default,
        help="seconds a request's grammar may compile; a longer one is stopped and the "
        "request refused (400)",
    )
    a(
        "--grammar-max-size",
        type=int,
        default=d["grammar_max_size"].default,
        help="most characters in a request's grammar (regex, json_schema, ebnf, "
        "structural_tag); a longer one is refused (400) before compiling",
    )
