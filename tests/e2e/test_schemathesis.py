"""Fuzzing the served API from its own /openapi.json with schemathesis: valid and invalid
bodies, query strings and methods for every operation; no answer may be a 5xx, and the server
is healthy (and leaks no KV) afterwards. Generation lengths are capped so the run stays short."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode

MAX_TOKENS = 4
EXAMPLES_PER_OPERATION = 12


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], deterministic=True
    )
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def _cap(body):
    """Keeps generations short: at most MAX_TOKENS new tokens and 2 choices per request."""
    if not isinstance(body, dict):
        return
    sps = body.get("sampling_params")
    for sp in sps if isinstance(sps, list) else [sps]:
        if isinstance(sp, dict):
            sp["max_new_tokens"] = MAX_TOKENS
    if isinstance(body.get("text"), str) or isinstance(body.get("input_ids"), list):
        body.setdefault("sampling_params", {"max_new_tokens": MAX_TOKENS})
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body or "prompt" in body or "messages" in body:
            body[key] = MAX_TOKENS
    if "input" in body or "max_output_tokens" in body:
        body["max_output_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2


def test_openapi_describes_the_request_bodies(server):
    doc = server.get("/openapi.json").json()
    paths = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/score")
    for path in (*paths, "/abort_request"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
        assert "400" in op["responses"]
    assert "get" not in doc["paths"]["/flush_cache"]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case, server):
    _cap(case.body)
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])


def test_server_healthy_after_fuzzing(server):
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    state = server.wait_idle()
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == state["max_total_num_tokens"]
    )
