"""Small HTTP helpers shared by the native and OpenAI routes: orjson bodies and SSE frames."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from srt_ascend.managers.tokenizer_manager import RequestError

SSE_DONE = b"data: [DONE]\n\n"


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(message: str, status_code: int = 400) -> ORJSONResponse:
    """SGLang's native error body."""
    return ORJSONResponse({"error": {"message": message}}, status_code=status_code)


def openai_error_response(message: str, status_code: int = 400) -> ORJSONResponse:
    """OpenAI's error body (what the openai client parses into BadRequestError)."""
    return ORJSONResponse(
        {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": status_code,
            }
        },
        status_code=status_code,
    )


def sse(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def read_json(request: Request) -> Any:
    """The parsed body; RequestError (-> 400) for anything that is not JSON."""
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
