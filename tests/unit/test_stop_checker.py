"""StopChecker: stop_regex runs on RE2 (linear time, so no pattern can stall the scheduler),
reports the pattern as `matched` (SGLang's FINISHED_MATCHED_REGEX) and the matched text for
trimming; stop strings report the string."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from srt_ascend.managers.detokenizer import trim_stop
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.managers.stop_checker import STOP_REGEX_TAIL_TOKENS, StopChecker
from srt_ascend.sampling.sampling_params import SamplingParams

CONTEXT = 4096
REPO = Path(__file__).resolve().parents[2]


class CharTokenizer:
    """Token id i is the character chr(i): decode is a join."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def request(text: str, **params) -> Req:
    p = SamplingParams(max_new_tokens=1000, **params)
    p.verify(vocab_size=1 << 16)
    p.normalize()
    return Req("r", [1, 2], p, output_ids=[ord(c) for c in text])


def test_stop_regex_matched_is_the_pattern_and_the_text_is_trimmed():
    checker = StopChecker(CharTokenizer(), eos_ids=[0])
    reason = checker.check(request("the answer is 42.", stop_regex=[r"^x", r"\d+\."]), CONTEXT)
    assert reason is not None
    assert reason.to_json() == {"type": "stop", "matched": r"\d+\."}
    assert reason.stop_text == "42."
    assert trim_stop("the answer is 42.", reason.stop_text, no_stop_trim=False) == (
        "the answer is "
    )
    assert trim_stop("the answer is 42.", reason.stop_text, no_stop_trim=True).endswith("42.")


def test_stop_string_matched_is_the_string():
    checker = StopChecker(CharTokenizer(), eos_ids=[0])
    reason = checker.check(request("one, two", stop=[", t"]), CONTEXT)
    assert reason.to_json() == {"type": "stop", "matched": ", t"} and reason.stop_text == ", t"
    assert checker.check(request("one", stop_regex=[r"\d"]), CONTEXT) is None


def test_catastrophic_pattern_is_searched_in_linear_time():
    """ "(a|aa)*c" over a tail of `a`s backtracks in Fibonacci(n) steps with Python's re (39 `a`s
    took 42 s; the 64-token tail never ends). The check runs in a child process so that the
    test ends (with a timeout) even on an engine that backtracks."""
    code = textwrap.dedent(
        f"""
        import time
        from tests.unit.test_stop_checker import CONTEXT, CharTokenizer, request
        from srt_ascend.managers.stop_checker import StopChecker
        checker = StopChecker(CharTokenizer(), eos_ids=[0])
        req = request("a" * {STOP_REGEX_TAIL_TOKENS}, stop_regex=["(a|aa)*c"])
        start = time.monotonic()
        for _ in range(100):
            assert checker.check(req, CONTEXT) is None
        print(time.monotonic() - start)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.0, f"100 checks took {done.stdout} s"
