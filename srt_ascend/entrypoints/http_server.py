"""The HTTP server: SGLang's native API (this module) and the OpenAI API (openai_api.py).

    app = create_app(tokenizer_manager, server_args)
    uvicorn.run(app, host=..., port=...)        # what launch_server does

JSON goes through orjson. A bad request is HTTP 400 with {"error": {"message": ...}} (SGLang's
shape) and the server keeps serving; a client that disconnects has its requests aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from srt_ascend.entrypoints.auth import ApiKeyMiddleware, admin_allowed, unauthorized_response
from srt_ascend.entrypoints.generate_input import (
    AbortRequest,
    GenerateItem,
    GenerateReqInput,
    GenerateRequest,
)
from srt_ascend.entrypoints.health import HealthProbe
from srt_ascend.entrypoints.http_utils import (
    SSE_DONE,
    BodyNotReceived,
    HTTPStatusError,
    NativeError,
    ORJSONResponse,
    install_openapi,
    is_json_type,
    json_body_spec,
    parse_body,
    read_json,
    route_error_response,
    sse,
)
from srt_ascend.entrypoints.openai_api import OPENAI_BODY_MODELS, add_openai_routes
from srt_ascend.entrypoints.serving import (
    ClientDisconnected,
    Serving,
    sglang_logprob_entries,
    until_disconnected,
)
from srt_ascend.managers.io_struct import TokenizedGenerateReq
from srt_ascend.managers.tokenizer_manager import RequestError, ServerBusyError, TokenizerManager
from srt_ascend.server_args import ServerArgs

logger = logging.getLogger(__name__)

VERSION = "srt_ascend-0.1.0"


def create_app(tokenizer_manager: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    """The FastAPI app serving `tokenizer_manager`. The manager's event loop is bound when the
    app starts; the caller owns the manager and shuts it down after the server stops."""
    serving = Serving(tokenizer_manager, server_args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer_manager.loop = asyncio.get_running_loop()
        yield

    app = FastAPI(title="srt_ascend", version=VERSION, lifespan=lifespan)
    app.state.serving = serving
    app.state.health = HealthProbe(lambda: serving.admit(1), serving.probe_generation)
    app.state.max_body_bytes = server_args.max_request_body_bytes
    if server_args.api_key or server_args.admin_api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=server_args.api_key, admin_api_key=server_args.admin_api_key
        )

    def refuse(
        request: Request, message: str, status_code: int = 400, param: str | None = None
    ) -> ORJSONResponse:
        """The route's error shape: the Responses API's, SGLang's OpenAI one, or native."""
        if status_code == 400:
            serving.metrics.observe_bad_request()
        return route_error_response(request.url.path, message, status_code, param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return refuse(request, str(exc), param=exc.param)

    @app.exception_handler(HTTPStatusError)
    async def on_status_error(request: Request, exc: HTTPStatusError):
        return refuse(request, str(exc), exc.status_code, exc.param)

    @app.exception_handler(ServerBusyError)
    async def on_busy(request: Request, exc: ServerBusyError):
        return refuse(request, str(exc), 503)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_exception(request: Request, exc: StarletteHTTPException):
        response = refuse(request, str(exc.detail), exc.status_code)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected):
        logger.info("client left before the answer to %s; its requests were aborted", exc)
        return Response(status_code=499)

    @app.exception_handler(BodyNotReceived)
    async def on_body_not_received(request: Request, exc: BodyNotReceived):
        logger.info("client left (or timed out) before sending the body of %s", exc)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return refuse(request, f"{loc}: {first.get('msg', 'invalid request')}")

    app.include_router(router)
    add_openai_routes(app, serving)
    install_openapi(app, [GenerateRequest, AbortRequest, NativeError, *OPENAI_BODY_MODELS])
    return app


router = APIRouter()


def _serving(request: Request) -> Serving:
    return request.app.state.serving


@router.api_route(
    "/generate", methods=["POST", "PUT"], openapi_extra=json_body_spec(GenerateRequest, NativeError)
)
async def generate(request: Request):
    serving = _serving(request)
    # checking the body and building its requests take time linear in its size (token ids,
    # prompts): both run in the tokenizer thread, not on the event loop
    obj = await serving.tm.off_loop(
        GenerateReqInput.from_json, await read_json(request), serving.check_prompt_count
    )
    serving.admit(len(obj.prompts) * obj.n)
    items = await obj.items(serving.tm.tokenize_async)
    reqs = await serving.tm.off_loop(_make_requests, serving, items, obj.stream)
    serving.check_unique_rids(reqs)
    await serving.attach_grammars(reqs)
    # the samples of a prompt share its prefill through the radix cache (a disaggregated
    # server's samples are each paired with one on the other server: no extra prefill)
    if obj.n > 1 and serving.args.disaggregation_mode == "null":
        await until_disconnected(request, serving.cache_prompts(reqs, obj.n))
    if obj.stream:
        return StreamingResponse(
            _stream_generate(serving, obj, reqs), media_type="text/event-stream"
        )
    outs = await until_disconnected(request, serving.run_all(reqs))
    outs = [_finish_output(serving, obj, o) for o in outs]
    return ORJSONResponse(outs[0] if obj.is_single else outs)


def _make_requests(
    serving: Serving, items: list[GenerateItem], stream: bool
) -> list[TokenizedGenerateReq]:
    return [
        serving.make_request(
            it.input_ids,
            it.sampling_params,
            stream,
            rid=it.rid,
            return_logprob=it.return_logprob,
            logprob_start_len=it.logprob_start_len,
            top_logprobs_num=it.top_logprobs_num,
            extra_key=it.extra_key,
            token_ids_logprob=it.token_ids_logprob,
            bootstrap=it.bootstrap,
        )
        for it in items
    ]


@router.get("/health")
@router.get("/ready")
async def ready(request: Request) -> Response:
    """200 while serving; 503 once shutting down (so load balancers stop sending work). Open
    without a key, as SGLang's auth leaves it (a probe carries no secret; the answer is a
    status code alone)."""
    return Response(status_code=503 if _serving(request).tm.draining else 200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token generation went through the whole runtime, else 503 (also while
    shutting down, or when the queue is full). Probes are bounded (HealthProbe): one
    generation in flight, its answer reused for a second, admitted like any request."""
    if _serving(request).tm.draining:
        return Response(status_code=503)
    healthy = await request.app.state.health.check()
    return Response(status_code=200 if healthy else 503)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request):
    serving = _serving(request)
    cfg = serving.tm.runner.config
    return ORJSONResponse(
        {
            "model_path": serving.args.model_path,
            "tokenizer_path": serving.args.tokenizer,
            "served_model_name": serving.args.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "context_length": serving.tm.context_len,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
    )


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request):
    """The server args (and derived sizes) plus `internal_states[0]`, SGLang's layout."""
    serving = _serving(request)
    state = await serving.internal_state()
    return ORJSONResponse({**serving.server_info(), "internal_states": [state], "version": VERSION})


@router.post("/flush_cache")
async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0.0)):
    """Empties the radix cache; refused (400) while requests run, after waiting up to
    `timeout` seconds for them to finish. POST only; a body, if any, must be JSON (so no
    web page can trigger it with a form)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json_type(content_type):
        raise HTTPStatusError(415, "the Content-Type of /flush_cache must be application/json")
    tm = _serving(request).tm
    deadline = time.monotonic() + timeout
    while not await tm.flush_cache():
        if time.monotonic() >= deadline:
            return Response("Cache not flushed: requests are running.\n", status_code=400)
        await asyncio.sleep(0.05)
    return Response("Cache flushed.\n", status_code=200)


@router.post("/abort_request", openapi_extra=json_body_spec(AbortRequest, NativeError))
async def abort_request(request: Request):
    """{"rid": ...} aborts one request, {"abort_all": true} every one; their KV is freed.
    Aborting all is an admin operation: with --admin-api-key only that key may (401)."""
    body = parse_body(AbortRequest, await read_json(request))
    if not body.rid and not body.abort_all:
        raise RequestError("give the rid of the request to abort, or abort_all: true")
    serving = _serving(request)
    if body.abort_all:
        args, header = serving.args, request.headers.get("authorization")
        if not admin_allowed(header, args.api_key, args.admin_api_key):
            return unauthorized_response(request.url.path)
    serving.tm.abort("" if body.abort_all else body.rid)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request):
    serving = _serving(request)
    body = serving.metrics.render(await serving.tm.internal_state())
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _finish_output(serving: Serving, obj: GenerateReqInput, out: dict) -> dict:
    """SGLang's logprob entries; their text only with return_text_in_logprobs."""
    texts = serving.token_texts if obj.return_text_in_logprobs else None
    return sglang_logprob_entries(out, texts)


async def _stream_generate(serving: Serving, obj: GenerateReqInput, reqs) -> AsyncIterator[bytes]:
    """SSE: `data: {output}` per step with cumulative text (batch items carry "index"), then
    `data: [DONE]`. Leaving early (client gone) aborts every request of the body."""
    try:
        async with contextlib.aclosing(serving.stream_all(reqs)) as outs:
            async for i, out in outs:
                out = _finish_output(serving, obj, out)
                if not obj.is_single:
                    out["index"] = i
                yield sse(out)
    except RequestError as e:
        yield sse({"error": {"message": str(e), "type": "invalid_request_error", "code": 400}})
    yield SSE_DONE
