"""`--enable-deterministic-inference` with tensor parallelism and data-parallel attention (bf16,
gloo, 2 ranks): a prompt's greedy tokens and logprobs are bit-identical sent alone or with 7
others, MTP K = 2 on. `--tp-size 2` splits attention heads and MLP rows (the row-parallel
o_proj / down_proj and the MoE's partial sums all-reduced); `--enable-dp-attention --dp-size 2`
schedules the requests in two groups whose tokens the MLPs gather (`dp_gather`) and hand back
(`dp_scatter`, an all-reduce), so a request's MLP rows sit among another group's rows.
Without the flag (measured) all 8 prompts' tokens or logprobs change with the batch in both
configurations.
"""

from __future__ import annotations

import pytest
from e2e_servers import running_server

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push",
    "def fibonacci(n):\n    if n",
    "for i in range(10):\n    print(",
    "    return self._",
    'if __name__ == "__main__":\n    ',
    "from collections import",
]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
FLAGS = ("--dtype", "bfloat16", "--enable-deterministic-inference")
MTP = ("--speculative-algorithm", "MTP", "--speculative-num-steps", "2")
CONFIGS = {
    "tp2-mtp-fia": ("--tp-size", "2", *MTP, "--speculative-verify", "fia"),
    "dp2-attention-mtp-expand": (
        "--tp-size", "2", "--enable-dp-attention", "--dp-size", "2", *MTP,
        "--speculative-verify", "expand",
    ),
}  # fmt: skip


def _generate(server, texts) -> list[tuple[list[int], list[float]]]:
    body = {"text": texts, "sampling_params": GREEDY, "return_logprob": True}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json() if isinstance(texts, list) else [r.json()]
    return [
        (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        for o in outs
    ]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_parallel_outputs_do_not_change_with_the_batch(config, tmp_path):
    with running_server(tmp_path, *FLAGS, *CONFIGS[config]) as server:
        alone = [_generate(server, p)[0] for p in PROMPTS]
        batched = _generate(server, PROMPTS)
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids, _ in alone)
    differing = [i for i, (a, b) in enumerate(zip(alone, batched)) if a != b]
    assert differing == [], f"{config}: prompts {differing} changed with the batch"
