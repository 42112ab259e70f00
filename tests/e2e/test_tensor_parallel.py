"""`--tp-size 2` on CPU (gloo): two scheduler/model processes give token for token the float32
greedy outputs of one process, with MTP off and with K = 2 drafts verified both ways, the
radix cache on; so does `--ep-size 2` (experts partitioned, in the main model and the MTP
block) with K = 2 FIA; a client that leaves mid-stream is aborted on every rank; and killing
a rank ends the server with an error line within seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests
from e2e_servers import running_server

# Shared prefixes, sent twice: the second round is served from the radix cache.
PROMPTS = [
    "def fibonacci(n):\n",
    "def fibonacci(n):\n    if n",
    "import os\nimport sys\n\n",
    "import os\nimport sys\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push",
]
BODY = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}
MTP = ("--speculative-algorithm", "MTP", "--speculative-num-steps", "2")
CONFIGS = {
    "plain": (),
    "mtp-expand": (*MTP, "--speculative-verify", "expand"),
    "mtp-fia": (*MTP, "--speculative-verify", "fia"),
    "ep-mtp-fia": ("--ep-size", "2", *MTP, "--speculative-verify", "fia"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tp_server(request, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"tp2-{request.param}")
    with running_server(log_dir, "--tp-size", "2", *CONFIGS[request.param]) as s:
        yield s


def _generate(server) -> tuple[list[list[int]], list[int]]:
    """(output ids, cached prompt tokens) per prompt."""
    r = server.post("/generate", json=BODY)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()], [o["meta_info"]["cached_tokens"] for o in r.json()]


def test_tp2_greedy_equals_one_process(server, tp_server):
    expected, _ = _generate(server)
    assert _generate(tp_server)[0] == expected
    again, cached = _generate(tp_server)
    assert again == expected and min(cached) > 0  # the second round hit the radix cache
    info = tp_server.get("/server_info").json()
    assert info["tp_size"] == 2 and info["ep_size"] in (1, 2)


def test_tp2_grammar_outputs_equal_one_process(server, tp_server):
    """Grammars compile on the leader and reach the other ranks with the request: greedy
    outputs under a regex and a JSON schema are those of one process; sampled ones follow the
    grammar on every rank alike (they would hang or diverge otherwise)."""
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    body = {
        "text": [PROMPTS[0], PROMPTS[2], PROMPTS[4]],
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 16, "regex": "(yes|no)[0-9]{2,5}"},
            {"temperature": 0, "max_new_tokens": 24, "json_schema": schema},
            {"temperature": 1.0, "seed": 3, "max_new_tokens": 12, "regex": "[a-f]{4}[0-9]+"},
        ],
    }
    r = tp_server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json()
    expected = server.post("/generate", json=body).json()
    assert [o["output_ids"] for o in outs[:2]] == [o["output_ids"] for o in expected[:2]]
    assert re.fullmatch("(yes|no)[0-9]{2,5}", outs[0]["text"])
    text, finish = outs[1]["text"], outs[1]["meta_info"]["finish_reason"]["type"]
    # the tiny model may spend its tokens on the whitespace JSON allows
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text)["n"], int))
    assert re.fullmatch("[a-f]{4}[0-9]+", outs[2]["text"])


def test_client_leaving_mid_stream_is_aborted_on_every_rank(server, tp_server):
    """The abort reaches every rank at the same step: the server goes idle, and the ranks
    still agree afterwards (they would hang or diverge otherwise)."""
    body = {
        "text": PROMPTS[0],
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }
    with requests.post(tp_server.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith(b"data: "))
    state = tp_server.wait_idle()
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == (state["max_total_num_tokens"])
    )
    assert _generate(tp_server)[0] == _generate(server)[0]


def test_killing_a_rank_stops_the_server_with_an_error(tp_server):
    """Runs after each config's parity test, on the same server (which it ends)."""
    pid = int(re.search(r"started tensor-parallel rank 1 \(pid (\d+)\)", tp_server.log())[1])
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        code = tp_server.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs 15 s after rank 1 was killed:\n{tp_server.log()}")
    assert code == 1 and time.monotonic() - start < 10
    assert f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in tp_server.log()
