"""The endpoints: POST /v1/completions, POST /v1/chat/completions (both also as server-sent
events with `"stream": true`), GET /v1/models, GET /health, GET /metrics (the GET ones answer
HEAD too)."""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from specrt.server.errors import APIError, ClientGone, bad, server_error
from specrt.server.parse import ParseCancelled, ParsedRequest, parse_request
from specrt.server.responses import completion_body, failure, stream_events
from specrt.server.runner import Failed, Refused

logger = logging.getLogger("specrt.server")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
router = APIRouter()


def _body_schema(name: str) -> dict:
    """openapi_extra for a route that reads its own body: point the spec at the pydantic model."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "unknown client"


async def read_body(request: Request, state) -> bytes:
    """The request body, within the size limit and the read timeout (a client that announces more
    than it sends is dropped with a 408 after `body_timeout_s`)."""
    limit, timeout = state.max_body_bytes, state.settings.body_timeout_s
    length = request.headers.get("content-length")
    if length is not None:
        if not re.fullmatch(r"[0-9]{1,19}", length.strip()):
            raise bad("invalid Content-Length header", None, "invalid_header")
        if int(length) > limit:
            raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes",
                           "invalid_request_error", None, "request_too_large")
    chunks: list[bytes] = []
    received = 0

    async def read() -> None:
        nonlocal received
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                               None, "request_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        logger.warning("%s %s: request body timed out after %g s (%d of %s bytes); connection closed",
                       _client(request), request.url.path, timeout, received, length or "?")
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", "invalid_request_error",
                       None, "request_timeout") from None
    except ClientDisconnect:
        logger.info("%s %s: client disconnected while sending the request body (%d of %s bytes)",
                    _client(request), request.url.path, received, length or "?")
        raise ClientGone() from None
    return b"".join(chunks)


async def _admit(state, req: ParsedRequest, request_id: str) -> asyncio.Queue:
    if not state.runner.alive:
        raise server_error("the engine thread is not running", "engine_down", 503)
    q = state.runner.submit(request_id, req.prompt_ids, req.params, req.tag, req.tenant)
    try:
        first = await q.get()
    except BaseException:
        state.runner.abort(request_id)
        raise
    if isinstance(first, Refused):
        code = "context_length_exceeded" if "context" in first.message else "invalid_value"
        raise bad(first.message, "prompt", code)
    if isinstance(first, Failed):
        raise failure(first)
    return q


async def _final(q: asyncio.Queue):
    while True:
        item = await q.get()
        if isinstance(item, Failed) or item.finished:
            return item


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _guarded(runner, request_id: str, events):
    """Pass the events through; a stream that ends early (client gone) aborts its request."""
    finished = False
    try:
        async for e in events:
            yield e
        finished = True
    finally:
        if not finished:
            runner.abort(request_id)      # free its KV blocks


async def _complete(request: Request, state, q: asyncio.Queue, req: ParsedRequest, request_id: str,
                    created: int, chat: bool):
    collect = asyncio.ensure_future(_final(q))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():
            collect.cancel()
            state.runner.abort(request_id)      # the client left (or we were cancelled): free the KV blocks
    if collect not in done:
        return Response(status_code=499)
    out = collect.result()
    err = failure(out)
    if err is not None:
        raise err
    return JSONResponse(completion_body(state.engine, out, req, request_id, created, chat))


PARSE_POLL_S = 0.25     # how often a request waiting for its parse checks for a drain


def _grammar_compiler(eng):
    """The engine's structured-output compiler (LLMEngine.intake; a tensor-parallel engine's rank 0)."""
    intake = getattr(eng, "intake", None)
    return getattr(intake, "compile_structured", None)


async def _parse(request: Request, state, raw: bytes, chat: bool) -> ParsedRequest:
    """parse_request on the tokenizer pool. A client that goes away, or a drain that begins,
    while it runs sets its cancel flag (the parse stops at its next check) and nobody waits for
    it any longer: a long parse never outlives its client, nor holds up a shutdown."""
    eng = state.engine
    cancel = threading.Event()
    parse = functools.partial(parse_request, raw, chat, request.headers.get("x-specrt-tag"),
                              model_name=state.model_name, tags=state.tags, tokenizer=eng.tokenizer,
                              max_model_len=eng.max_model_len, max_prompt_chars=state.max_prompt_chars,
                              vocab_size=eng.vocab_size,
                              escape_special_tokens=not state.settings.allow_special_tokens_in_content,
                              cancel=cancel, compile_structured=_grammar_compiler(eng))
    fut = asyncio.get_running_loop().run_in_executor(state.pool, parse)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    state.parses.add(cancel)
    try:
        while True:
            done, _ = await asyncio.wait({fut, gone}, timeout=PARSE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if fut in done:
                try:
                    return fut.result()
                except ParseCancelled:
                    raise server_error("the server is shutting down", "server_shutting_down", 503) from None
            if gone in done:
                logger.info("%s %s: client disconnected while its request was parsed", _client(request),
                            request.url.path)
                raise ClientGone()
            if state.draining:
                raise server_error("the server is shutting down", "server_shutting_down", 503)
    finally:
        state.parses.discard(cancel)
        gone.cancel()
        if not fut.done():
            cancel.set()
            fut.cancel()          # nobody reads its result (a thread still running it ends on its own)


async def _handle(request: Request, chat: bool):
    state = request.app.state.specrt
    if state.draining:
        raise server_error("the server is shutting down", "server_shutting_down", 503)
    raw = await read_body(request, state)
    eng = state.engine
    req = await _parse(request, state, raw, chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    q = await _admit(state, req, request_id)
    if req.stream:
        events = stream_events(eng, q, req, request_id, created, chat)
        return StreamingResponse(_guarded(state.runner, request_id, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(request, state, q, req, request_id, created, chat)


@router.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"))
async def completions(request: Request):
    """OpenAI text completion (`"stream": true` for server-sent events)."""
    return await _handle(request, chat=False)


@router.post("/v1/chat/completions", openapi_extra=_body_schema("ChatCompletionRequest"))
async def chat_completions(request: Request):
    """OpenAI chat completion, rendered with the model's chat template."""
    return await _handle(request, chat=True)


@router.get("/v1/models")
@router.head("/v1/models", include_in_schema=False)
async def models(request: Request):
    state = request.app.state.specrt
    eng = state.engine
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "specrt",
        "max_model_len": eng.max_model_len,
        "specrt": {"speculative": bool(eng.speculative), "draft": eng.draft_kind,
                   "max_draft_length": eng.spec.max_draft_length, "policy": eng.spec.policy,
                   "acceptance": eng.spec.acceptance, "max_batch_size": eng.spec.max_batch_size,
                   "kv_cache_tokens": eng.kv_cache_tokens}}]}


@router.get("/health")
@router.head("/health", include_in_schema=False)
async def health(request: Request):
    state = request.app.state.specrt
    runner = state.runner
    ok = runner.alive and not state.draining
    status = "ok" if ok else "draining" if state.draining else "engine thread stopped"
    body = {"status": status, "in_flight": runner.num_in_flight, "engine_failures": runner.failures}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
@router.head("/metrics", include_in_schema=False)
async def metrics(request: Request):
    state = request.app.state.specrt
    eng, runner = state.engine, state.runner
    lines = [
        "# HELP specrt_requests_in_flight Requests admitted and not yet finished",
        "# TYPE specrt_requests_in_flight gauge",
        f"specrt_requests_in_flight {runner.num_in_flight}",
        "# HELP specrt_kv_blocks_free Free KV-cache blocks",
        "# TYPE specrt_kv_blocks_free gauge",
        f"specrt_kv_blocks_free {eng.num_free_blocks()}",
        "# HELP specrt_kv_blocks_total KV-cache blocks",
        "# TYPE specrt_kv_blocks_total gauge",
        f"specrt_kv_blocks_total {state.num_kv_blocks}",
        "# HELP specrt_engine_step_failures_total Engine steps that raised (their requests failed)",
        "# TYPE specrt_engine_step_failures_total counter",
        f"specrt_engine_step_failures_total {runner.failures}",
        "# HELP specrt_http_requests_total HTTP requests by path and status",
        "# TYPE specrt_http_requests_total counter",
    ]
    for (path, status), n in sorted(state.http_requests.items()):
        lines.append(f'specrt_http_requests_total{{path="{path}",status="{status}"}} {n}')
    return Response(eng.metrics.prometheus() + "\n".join(lines) + "\n", media_type=None,
                    headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})
