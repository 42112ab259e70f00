"""`--enable-dp-attention --dp-size 2 --tp-size 2` on CPU (gloo): two DP groups of one rank
each, every group scheduling its own requests, the MLPs and experts over both groups'
tokens; float32 greedy outputs equal one process's token for token. Configurations: experts
split by intermediate rows (MTP off, eager); experts partitioned (`--ep-size 2`) with the
gather (`--moe-a2a-backend none`) and graphs (`--enable-cpu-graph`: every rank replays the
graph kind and bucket the ranks agree on, an idle group over padding only), MTP off and K = 2
drafts with expand verify; and with the all-to-all dispatch (`all_to_all`, eager: MTP off and
K = 2 with FIA verify). DP group 1 is idle while the first request runs alone, then prefills
while group 0 decodes (group 0 runs idle prefill forwards), then both hold requests: every mix
of prefill, decode, draft and idle forwards (replayed or eager) across the groups must keep
their MLP collectives paired."""

from __future__ import annotations

import json
import threading

import pytest
import requests
from e2e_servers import running_server

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push",
    "def fibonacci(n):\n    if n",
]
GREEDY = {"temperature": 0, "max_new_tokens": 20}
MTP = ("--speculative-algorithm", "MTP", "--speculative-num-steps", "2")
EP = ("--ep-size", "2")
A2A = (*EP, "--moe-a2a-backend", "all_to_all")
GRAPHS = ("--enable-cpu-graph", "--cuda-graph-bs", "1", "2", "--context-length", "512")
CONFIGS = {
    "plain": (),
    "graphs-ep": (*EP, *GRAPHS),
    "graphs-ep-mtp-expand": (*EP, *MTP, "--speculative-verify", "expand", *GRAPHS),
    "ep-a2a": A2A,
    "ep-a2a-mtp-fia": (*A2A, *MTP, "--speculative-verify", "fia"),
}
DP = ("--tp-size", "2", "--enable-dp-attention", "--dp-size", "2")
REPLAYED = {  # graph kinds rank 0 must have replayed
    "graphs-ep": {"decode_greedy"},  # greedy without logprobs: forward + argmax in one graph
    "graphs-ep-mtp-expand": {"verify_expand", "draft_extend", "draft_step0"},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def dp_server(request, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"dp2-{request.param}")
    with running_server(log_dir, *DP, *CONFIGS[request.param]) as s:
        yield request.param, s


def _generate(server, texts: list[str]) -> list[list[int]]:
    r = server.post("/generate", json={"text": texts, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def _stream_alone_then_batch(server) -> list[list[int]]:
    """PROMPTS[0] streams (DP group 0); once it decodes, PROMPTS[1] arrives (group 1), then
    the other two together (groups 0 and 1). Returns the outputs in PROMPTS order."""
    body = {"text": PROMPTS[0], "stream": True, "sampling_params": GREEDY}
    outputs: dict[int, list[int]] = {}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith(b"data: {"))
        events = [json.loads(next(lines)[6:])]  # group 0 is decoding now
        second = threading.Thread(
            target=lambda: outputs.update({1: _generate(server, PROMPTS[1:2])[0]})
        )
        second.start()
        events += [json.loads(line[6:]) for line in lines]
        second.join()
    outputs[0] = events[-1]["output_ids"]
    outputs.update(enumerate(_generate(server, PROMPTS[2:]), start=2))
    return [outputs[i] for i in range(len(PROMPTS))]


def test_dp_attention_greedy_equals_one_process(server, dp_server):
    config, dp_server = dp_server
    expected = _generate(server, PROMPTS)
    assert _stream_alone_then_batch(dp_server) == expected
    assert _generate(dp_server, PROMPTS) == expected  # again: both groups, radix hits
    state = dp_server.wait_idle()
    assert state["dp_group_requests"] == [0, 0]
    replayed = {kind for kind, n in state["graph_replays"].items() if n}
    assert REPLAYED.get(config, set()) <= replayed, state["graph_replays"]
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == state["max_total_num_tokens"]
    )
    log = dp_server.log()
    assert "TP1] INFO srt_ascend.scheduler: Prefill batch" in log  # group 1 served some


def test_parallel_samples_share_their_prompts_prefill(dp_server):
    """n = 2 samples of each of two prompts, in every configuration: every sample finds its
    prompt's shared prefill in its DP group's radix cache (the prefill and its samples go to
    one group; with MTP the bigram-keyed tree holds one position fewer). Round-robin routing
    alone sent them to different groups: a sample in the other group computed the prompt
    again (cached_tokens 0)."""
    _, dp_server = dp_server
    # two unseen prompts sharing no prefix (else the other group's prefill would serve)
    texts = [f"# {tag}\n" + PROMPTS[2] * 3 for tag in ("alpha beta", "gamma delta")]
    body = {"text": texts, "sampling_params": {"n": 2, "max_new_tokens": 2}}
    r = dp_server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    metas = [o["meta_info"] for o in r.json()]
    assert len(metas) == 4
    for m in metas:
        assert m["cached_tokens"] >= m["prompt_tokens"] - 2, metas
