"""Every program in python/ is an example users start from, and each one is run here."""

from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "python"
# example -> the test that runs it
RUN_BY = {
    "frontend_gen.py": "test_sglang_clients.py::test_frontend_gen",
    "frontend_constrained.py": "test_sglang_clients.py::test_frontend_constrained",
    "frontend_select.py": "test_sglang_clients.py::test_frontend_select",
    "frontend_fork.py": "test_sglang_clients.py::test_frontend_fork",
    "frontend_run_batch.py": "test_sglang_clients.py::test_frontend_run_batch",
    "openai_client.py": "test_client_examples.py::test_openai_client_example",
}


def test_every_example_is_run_by_a_test():
    programs = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    assert programs == sorted(RUN_BY)


def test_openai_client_example(server, run_example):
    import sys

    out = run_example(sys.executable, "openai_client.py")
    assert out["model"] == "tiny-mtp"
    body = {
        "text": "def fibonacci(n):\n",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }
    assert out["completion"] == server.post("/generate", json=body).json()["text"]
    assert out["streamed_chat"] == out["chat"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["stream_usage"][key] == out["chat_usage"][key] > 0
