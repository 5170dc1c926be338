"""The app factory: engine (built or given), warm-up, state, middleware, error handlers, routes,
and the OpenAPI document (/openapi.json) with the request schemas."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrt.server.errors import APIError, ClientGone
from specrt.server.middleware import GateAndCount
from specrt.server.routes import router
from specrt.server.schemas import REQUEST_MODELS
from specrt.server.settings import DEFAULT_BODY_TIMEOUT_S, DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, \
    DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, MAX_TAGS, ServerSettings
from specrt.server.state import ServerState
from specrt.step.warmup import warm_up as engine_warm_up

logger = logging.getLogger("specrt.server")
VERSION = "0.1.0"


def warm_up(engine, num_requests: int = 4, max_tokens: int = 8, prompts: list[str] | None = None) -> None:
    """A few short greedy requests (``prompts``: typical ones, e.g. --warmup-prompts) so kernels,
    caches and the cost model settle before serving, and the cost model calibrated on them; then
    the served metrics start from zero."""
    engine_warm_up(engine, prompts, num_requests, max_tokens)
    engine.reset_metrics()


def drain_on_exit_signals(state: ServerState):
    """Chain a drain in front of the server's SIGTERM/SIGINT handlers (uvicorn installs its own
    before the app starts): the first signal stops admitting and gives the requests in flight
    `drain_timeout_s` to finish while the server waits for them. Returns the undo function."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None          # signals only reach the main thread (in-process test servers)
    saved = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue                  # default/ignored: nobody to hand the signal on to

        def handler(signum, frame, previous=previous):
            state.begin_drain(state.settings.drain_timeout_s)
            previous(signum, frame)

        saved[sig] = previous
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, previous in saved.items():
            signal.signal(sig, previous)
    return restore


def _default_model_name(target) -> str:
    if target is None:
        return "specrt"
    return "specrt-builtin" if str(target) == "builtin" else str(target).rstrip("/").rsplit("/", 1)[-1]


def error_response(err: APIError, headers: dict | None = None) -> JSONResponse:
    if err.status in (408, 413):       # the body was not read to its end: this connection is done
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)          # logged once where it happened; nobody reads this

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, msg, "invalid_request_error", None, code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", "server_error",
                                       None, "internal_error"))


def _openapi(app: FastAPI):
    """FastAPI's document plus the request models (the routes read their own bodies)."""
    def build():
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                         ref_template="#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema
    return build


def create_app(engine=None, *, target: str | None = None, draft: str | None = None, spec=None, device=None,
               dtype=None, seed: int | None = None, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, warmup: bool = True, max_tags: int = MAX_TAGS,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
               max_prompt_chars: int | None = None, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
               warmup_prompts: list[str] | None = None, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
               keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
               max_connections_per_client: int | None = None,
               allow_special_tokens_in_content: bool = False) -> FastAPI:
    """Build the FastAPI app. Pass a ready `engine` (an LLMEngine) or the arguments to build one
    (`target`, `draft` (None: plain autoregressive decoding), `spec`, `device`, `dtype`).
    The engine is warmed up (when `warmup`; on `warmup_prompts`, typical prompts, when given)
    before this returns, i.e. before a port opens.
    The step thread starts here; `app.state.specrt.close()` (or the app's shutdown) ends it.

    The connection-level settings (`header_timeout_s`, `keep_alive_timeout_s`,
    `max_connections_per_client`) take effect when uvicorn runs the app with
    `specrt.server.connections.uvicorn_options(app.state.specrt.settings)`, as `specrt serve` does.
    `allow_special_tokens_in_content`: False (the default) tokenizes special-token strings in chat
    messages as plain text, so a client cannot forge a turn with "<|im_end|><|im_start|>system"."""
    settings = ServerSettings(model_name=model_name or _default_model_name(target), api_key=api_key,
                              max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                              max_connections=max_connections, max_prompt_chars=max_prompt_chars,
                              max_tags=max_tags, drain_timeout_s=drain_timeout_s, header_timeout_s=header_timeout_s,
                              keep_alive_timeout_s=keep_alive_timeout_s,
                              max_connections_per_client=max_connections_per_client,
                              allow_special_tokens_in_content=allow_special_tokens_in_content)
    if engine is None:
        if target is None:
            raise ValueError("create_app needs an engine or a target model")
        from specrt import LLMEngine

        engine = LLMEngine(target, draft, spec, device, dtype, seed)
    if warmup:
        warm_up(engine, num_requests=min(4, engine.spec.max_batch_size), prompts=warmup_prompts)
    state = ServerState(engine, settings)

    @asynccontextmanager
    async def lifespan(app):
        restore = drain_on_exit_signals(state)
        try:
            yield
        finally:
            restore()
            await asyncio.get_running_loop().run_in_executor(None, state.close)

    app = FastAPI(title="specrt", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json",
                  description="OpenAI-compatible speculative-decoding server (specrt extensions: top_k, "
                              "min_tokens, ignore_eos, the `specrt` request object and response statistics).")
    app.state.specrt = state
    _install_error_handlers(app)
    app.add_middleware(GateAndCount, state=state, error_response=error_response)
    app.include_router(router)
    app.openapi = _openapi(app)
    return app
