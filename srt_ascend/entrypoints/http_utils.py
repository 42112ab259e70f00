"""Small HTTP helpers shared by the native and OpenAI routes: orjson bodies, SSE frames, the
bounded JSON body reader and the OpenAPI description of the request bodies."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from srt_ascend.managers.tokenizer_manager import RequestError

SSE_DONE = b"data: [DONE]\n\n"
JSON_TYPES = ("application/json",)


class HTTPStatusError(Exception):
    """A refused request with its status code (401, 405, 413, 415, 503, ...); the app answers
    it with the route's error shape (native, OpenAI or Responses; `param`: the field at fault,
    which the Responses shape reports)."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class NativeErrorDetail(BaseModel):
    message: str


class NativeError(BaseModel):
    """SGLang's native error body."""

    error: NativeErrorDetail


def error_response(message: str, status_code: int = 400) -> ORJSONResponse:
    """SGLang's native error body."""
    return ORJSONResponse({"error": {"message": message}}, status_code=status_code)


def openai_error_body(message: str, status_code: int = 400) -> dict:
    """SGLang's OpenAI-route error body (`openai_protocol.OpenAIError`)."""
    kind = "BadRequestError" if status_code == 400 else _ERROR_TYPES.get(status_code, "Error")
    return {
        "object": "error",
        "message": message,
        "type": kind,
        "param": None,
        "code": status_code,
    }


_ERROR_TYPES = {
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    415: "UnsupportedMediaType",
    503: "ServiceUnavailable",
}


def openai_error_response(message: str, status_code: int = 400) -> ORJSONResponse:
    return ORJSONResponse(openai_error_body(message, status_code), status_code=status_code)


_HTTP_CODES = {s.value for s in HTTPStatus}


def responses_error_body(message: str, status_code: int = 400, param: str | None = None) -> dict:
    """The Responses API's error body (SGLang's on /v1/responses*, `ResponsesError`): a
    refused request (4xx) is an `invalid_request_error`, naming the field at fault in `param`
    where one is; other statuses carry their HTTP phrase as the type."""
    if 400 <= status_code < 500:
        kind = "invalid_request_error"
    else:
        kind = HTTPStatus(status_code).phrase if status_code in _HTTP_CODES else "error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


def responses_error_response(
    message: str, status_code: int = 400, param: str | None = None
) -> ORJSONResponse:
    body = responses_error_body(message, status_code, param)
    return ORJSONResponse(body, status_code=status_code)


def route_error_response(
    path: str, message: str, status_code: int = 400, param: str | None = None
) -> ORJSONResponse:
    """The error shape of the route at `path`: the Responses API's on /v1/responses*,
    SGLang's OpenAI one on other /v1/ routes, SGLang's native one elsewhere."""
    if path.startswith("/v1/responses"):
        return responses_error_response(message, status_code, param)
    if path.startswith("/v1/"):
        return openai_error_response(message, status_code)
    return error_response(message, status_code)


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validated request model; RequestError naming the first bad field otherwise. A
    top-level field the model does not have is refused unless it is null (clients may send
    nulls for SGLang fields they do not use), as /generate refuses what it does not support."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if model.model_config.get("extra") == "forbid":
        for key in [k for k in body if k not in model.model_fields]:
            if body[key] is not None:
                raise RequestError(f"{key} is not supported by this server", param=key)
            del body[key]
    try:
        obj = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        param = str(err["loc"][0]) if err["loc"] else None
        raise RequestError(f"{loc}: {err['msg']}", param=param) from e
    unsupported = getattr(obj, "unsupported", None)
    bad = unsupported() if unsupported is not None else None
    if bad is not None:
        raise RequestError(f"{bad} is not supported by this server", param=bad)
    return obj


def sse(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def is_json_type(content_type: str | None) -> bool:
    """application/json or application/*+json, any parameters (charset) allowed."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime in JSON_TYPES or (mime.startswith("application/") and mime.endswith("+json"))


class BodyNotReceived(Exception):
    """The client went away (or was disconnected by the read deadline, see http_protocol)
    before its whole request body arrived; there is nobody to answer."""


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most `limit` bytes (HTTPStatusError 413 beyond, read no further);
    BodyNotReceived if the connection closes first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPStatusError(413, f"the request body is larger than {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPStatusError(413, f"the request body is larger than {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise BodyNotReceived(f"{request.method} {request.url.path}") from e
    return b"".join(chunks)


async def read_json(request: Request) -> Any:
    """The parsed JSON body. HTTPStatusError 415 unless the Content-Type is JSON (so a
    cross-site form or text/plain POST cannot reach a route), 413 past the app's body size
    limit (`app.state.max_body_bytes`); RequestError (400) for a body that is not JSON."""
    if not is_json_type(request.headers.get("content-type")):
        raise HTTPStatusError(
            415, "the request body must be JSON: send the header Content-Type: application/json"
        )
    body = await read_body(request, request.app.state.max_body_bytes)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e


# ---- OpenAPI --------------------------------------------------------------------------------

_REF = "#/components/schemas/{model}"


def json_body_spec(model: type[BaseModel], error_model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that reads a JSON body by hand: the body is `model`, and
    400/401/413/415/503 answers carry `error_model`."""

    def json_of(m: type[BaseModel]) -> dict:
        return {"application/json": {"schema": {"$ref": _REF.format(model=m.__name__)}}}

    error = {"content": json_of(error_model)}
    return {
        "requestBody": {"required": True, "content": json_of(model)},
        "responses": {
            "400": {"description": "Bad request (the message names the problem)", **error},
            "401": {"description": "Missing or wrong API key (with --api-key)", **error},
            "413": {"description": "Request body too large", **error},
            "415": {"description": "Content-Type is not application/json", **error},
            "503": {"description": "Queue full or server shutting down", **error},
        },
    }


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """The app's /openapi.json also describes `models` (referenced by `json_body_spec`)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                s = model.model_json_schema(ref_template=_REF)
                components.update(s.pop("$defs", {}))
                components[model.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
