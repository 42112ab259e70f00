"""One streamed greedy /generate, timed per chunk: what the serving benchmarks read TTFT and
TPOT from."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse


def stream_generate(
    url: str, ids: list[int], n: int, temperature: float = 0.0
) -> tuple[float, list[float], int]:
    """(send time, arrival times of the SSE chunks that carried new tokens, tokens) of one
    streamed /generate of `n` tokens after `ids` at `url` (http://host:port), greedy or at
    `temperature`. A speculative step's chunk carries several tokens."""
    u = urllib.parse.urlparse(url)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True},
        "stream": True,
    }
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times, seen = [], 0
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        got = len(json.loads(line[6:])["output_ids"])
        if got > seen:
            times.append(time.perf_counter())
            seen = got
    conn.close()
    return sent, times, seen
