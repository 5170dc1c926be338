"""OpenAI-compatible HTTP server: `specrt serve`.

    specrt serve --target-model builtin --draft-model builtin --speculative-decoding --draft-length 5

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text 0.0.4).

Threading model (the one rule): the engine is touched by exactly ONE thread, the step
thread of `EngineRunner`. HTTP handlers (asyncio event loop) never call into the engine;
they put commands ("add", "abort") on a thread-safe queue and await a per-request
asyncio.Queue that the step thread feeds with `loop.call_soon_threadsafe`. A slow or
vanished client therefore never stalls decoding: the step thread never waits on a
client, it only enqueues. A client that disconnects (or whose handler is cancelled)
sends "abort", which finishes the request and frees its KV blocks.

Extensions to the OpenAI schema (all optional):
- request: `top_k`, `min_tokens`, `ignore_eos` (vLLM-style, top level) and a `specrt`
  object `{"tag": str, "return_token_ids": bool}`; the tag may also come from the
  `X-Specrt-Tag` header. Tags label the Prometheus metrics (`tag="..."`).
- response: `"specrt": {...}` with the request's speculative statistics (steps,
  drafted/accepted tokens, acceptance per position, tokens per target forward, ...).
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import queue
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

try:   # module level: FastAPI resolves the handlers' (string) annotations in this module's globals
    from fastapi import Request
except ImportError:      # pragma: no cover - `pip install specrt[serve]`
    Request = None

logger = logging.getLogger("specrt.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_TAGS = 64                     # distinct Prometheus tag values; later new tags become "other"
_TAG_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ----------------------------------------------------------------------------- the step thread
@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Admitted:
    """First item on a request's queue once the engine accepted it."""
    request_id: str


@dataclass
class _Refused:
    """First item on a request's queue when add_request raised (bad input)."""
    message: str
    param: str | None = None


@dataclass
class _Failed:
    """The step loop raised while the request was in flight (server-side failure)."""
    message: str


@dataclass
class _Cmd:
    kind: str                       # "add" | "abort" | "stop"
    request_id: str | None = None
    args: tuple = ()
    stream: _Stream | None = None
    done: threading.Event | None = None


class EngineRunner:
    """Owns the engine and the single thread that steps it."""

    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}     # step thread only
        self.num_in_flight = 0                     # read by /metrics (int: atomic under the GIL)
        self.steps = 0
        self.failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="specrt-engine-step", daemon=True)
        self._thread.start()

    # -- called from the event loop (never blocks on the engine)
    def submit(self, request_id: str, prompt, params, tag: str) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(_Cmd("add", request_id, (prompt, params, tag), _Stream(loop, q)))
        return q

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Cmd("abort", request_id))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._cmds.put(_Cmd("stop"))
            self._thread.join(timeout)

    def sync(self, timeout: float = 10.0) -> bool:
        """Block (not from the event loop) until every command queued so far was handled."""
        ev = threading.Event()
        self._cmds.put(_Cmd("sync", done=ev))
        return ev.wait(timeout)

    # -- the step thread
    def _deliver(self, s: _Stream, item) -> None:
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:          # that client's event loop is closed: nobody is listening
            pass

    def _handle(self, cmd: _Cmd) -> bool:
        if cmd.kind == "stop":
            return False
        if cmd.kind == "sync":
            cmd.done.set()
        elif cmd.kind == "add":
            prompt, params, tag = cmd.args
            try:
                self.engine.add_request(prompt, params, request_id=cmd.request_id, tag=tag)
            except ValueError as e:
                self._deliver(cmd.stream, _Refused(str(e), _param_of(str(e), "prompt")))
            except Exception as e:    # not the request's fault: a 500 for it, the server goes on
                logger.exception("add_request failed")
                self._deliver(cmd.stream, _Failed(f"could not queue the request: {type(e).__name__}: {e}"))
            else:
                self._streams[cmd.request_id] = cmd.stream
                self._deliver(cmd.stream, _Admitted(cmd.request_id))
        elif cmd.kind == "abort":
            if self._streams.pop(cmd.request_id, None) is not None:
                try:
                    self.engine.abort_request(cmd.request_id)
                except Exception:
                    logger.exception("abort_request failed")
        self.num_in_flight = len(self._streams)
        return True

    def _pending_finished(self) -> bool:
        return bool(getattr(self.engine, "_finished_pending", None))

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished() and not self._pending_finished()
            cmds = []
            try:
                cmds.append(self._cmds.get(block=idle))
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            for cmd in cmds:
                if not self._handle(cmd):
                    self._shutdown()
                    return
            if not (self.engine.has_unfinished() or self._pending_finished()):
                continue
            try:
                outs = self.engine.step()
                self.steps += 1
            except Exception as e:    # a bug in a step must not take the server down
                logger.exception("engine step failed")
                self.failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._fail_all(self.last_error)
                continue
            for out in outs:
                s = self._streams.get(out.request_id)
                if s is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                self._deliver(s, out)
            self.num_in_flight = len(self._streams)

    def _fail_all(self, message: str) -> None:
        for rid, s in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort after a failed step")
            self._deliver(s, _Failed(f"the engine failed: {message}"))
        self._streams.clear()
        try:
            self.engine.step()       # drain the aborted requests (frees their bookkeeping)
        except Exception:
            pass
        self.num_in_flight = 0

    def _shutdown(self) -> None:
        for rid, s in list(self._streams.items()):
            self.engine.abort_request(rid)
            self._deliver(s, _Failed("the server is shutting down"))
        self._streams.clear()
        self.num_in_flight = 0


# ----------------------------------------------------------------------------- request parsing
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "ignore_eos", "seed", "stop")


def _param_of(message: str, default: str | None = None) -> str | None:
    first = message.split(" ", 1)[0]
    if first in _SAMPLING_FIELDS or first in ("prompt", "messages"):
        return first
    if message.startswith("prompt"):
        return "prompt"
    return default


def _type_name(x) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(x), type(x).__name__)


def _check_int(body: dict, name: str, lo: int | None = None, hi: int | None = None, param: str | None = None):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(f"'{name}' must be an integer, got {_type_name(v)} {json.dumps(v)[:40]}", param or name,
                   "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(f"'{name}' must be an integer {rng}, got {v}", param or name)
    return v


def _check_number(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(f"'{name}' must be a number, got {_type_name(v)} {json.dumps(v)[:40]}", name, "invalid_type")
    if not math.isfinite(v):
        raise _bad(f"'{name}' must be a finite number, got {v}", name)
    return float(v)


def _check_bool(body: dict, name: str, obj: str = ""):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(f"'{obj}{name}' must be a boolean, got {_type_name(v)}", obj + name, "invalid_type")
    return v


# OpenAI fields we accept only at their neutral value (anything else: 400 "not supported")
_NEUTRAL = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
}
_IGNORED = ("user", "metadata", "store", "service_tier")      # accepted, no effect
_COMMON = {"model", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "ignore_eos", "seed", "stop",
           "n", "stream", "stream_options", "specrt"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ParsedRequest:
    prompt: Any                      # str (completions) or list[int]
    params: Any                      # SamplingParams
    stream: bool
    include_usage: bool
    tag: str
    return_token_ids: bool
    model: str


def _same(v, neutral) -> bool:
    num = (int, float)
    if isinstance(neutral, num) and not isinstance(neutral, bool):
        return isinstance(v, num) and not isinstance(v, bool) and v == neutral
    return type(v) is type(neutral) and v == neutral


class ServerState:
    def __init__(self, engine, model_name: str, api_key: str | None, max_body_bytes: int, max_tags: int = MAX_TAGS):
        self.engine = engine
        self.runner = EngineRunner(engine)
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_tags = max_tags
        self.tags: set[str] = {"default"}
        self.created = int(time.time())
        self.http_requests: dict[tuple[str, int], int] = {}

    # -- tags
    def tag_for(self, tag: str | None) -> str:
        if tag is None:
            return "default"
        if not isinstance(tag, str) or not _TAG_RE.match(tag):
            raise _bad("the request tag must be 1-64 characters of [A-Za-z0-9_.:-], "
                       f"got {json.dumps(tag)[:80]}", "specrt.tag")
        if tag not in self.tags:
            if len(self.tags) >= self.max_tags:
                return "other"                  # bound the Prometheus label cardinality
            self.tags.add(tag)
        return tag

    # -- parsing
    def parse(self, body: Any, chat: bool, header_tag: str | None) -> ParsedRequest:
        from specrt.config import SamplingParams

        if not isinstance(body, dict):
            raise _bad(f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_type")
        allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
        for k, v in body.items():
            if k in allowed or k in _IGNORED:
                continue
            if k in _NEUTRAL:
                if v is None or any(_same(v, n) for n in _NEUTRAL[k]):
                    continue
                raise _bad(f"'{k}' is not supported by this server (got {json.dumps(v)[:60]})", k, "unsupported")
            raise _bad(f"unknown field '{k}'", k, "unknown_field")

        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad(f"'model' must be a string, got {_type_name(model)}", "model", "invalid_type")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "invalid_request_error", "model", "model_not_found")
        n = _check_int(body, "n", 1)
        if n not in (None, 1):
            raise _bad(f"'n' must be 1 (one choice per request), got {n}", "n", "unsupported")
        stream = _check_bool(body, "stream") or False
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not isinstance(so, dict):
                raise _bad(f"'stream_options' must be an object, got {_type_name(so)}", "stream_options",
                           "invalid_type")
            for k in so:
                if k not in ("include_usage", "continuous_usage_stats"):
                    raise _bad(f"unknown field 'stream_options.{k}'", f"stream_options.{k}", "unknown_field")
            include_usage = _check_bool(so, "include_usage", "stream_options.") or False
        ext = body.get("specrt")
        tag = header_tag
        return_ids = False
        if ext is not None:
            if not isinstance(ext, dict):
                raise _bad(f"'specrt' must be an object, got {_type_name(ext)}", "specrt", "invalid_type")
            for k in ext:
                if k not in ("tag", "return_token_ids"):
                    raise _bad(f"unknown field 'specrt.{k}' (known: tag, return_token_ids)", f"specrt.{k}",
                               "unknown_field")
            if ext.get("tag") is not None:
                tag = ext["tag"]
            return_ids = _check_bool(ext, "return_token_ids", "specrt.") or False
        tag = self.tag_for(tag)

        # sampling parameters: types here, ranges by SamplingParams (its ValueError names the field)
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p"):
            v = _check_number(body, name)
            if v is not None:
                kw[name] = v
        for name in ("top_k", "min_tokens", "seed"):
            v = _check_int(body, name)
            if v is not None:
                kw[name] = v
        max_name = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            max_name = "max_completion_tokens"
        max_tokens = _check_int(body, max_name, 1)
        if max_tokens is None:
            # OpenAI's completions default is 16; chat runs to the end of the context (engine stops there)
            max_tokens = self.engine.max_model_len if chat else 16
        kw["max_tokens"] = max_tokens
        v = _check_bool(body, "ignore_eos")
        if v is not None:
            kw["ignore_eos"] = v
        stop = body.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise _bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
            if len(stop) > 16:
                raise _bad(f"'stop' may hold at most 16 strings, got {len(stop)}", "stop")
            stop = [s for s in stop if s]
            if stop:
                kw["stop"] = stop
        try:
            params = SamplingParams(**kw)
        except ValueError as e:
            raise _bad(str(e), _param_of(str(e))) from None
        if max_name == "max_completion_tokens" and "max_tokens" in body and body["max_tokens"] is not None:
            _check_int(body, "max_tokens", 1)

        prompt = self._chat_prompt(body) if chat else self._completion_prompt(body)
        return ParsedRequest(prompt, params, stream, include_usage, tag, return_ids, self.model_name)

    def _completion_prompt(self, body: dict):
        if "prompt" not in body or body["prompt"] is None:
            raise _bad("'prompt' is required", "prompt", "missing_field")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]          # a batch of one prompt
        if isinstance(p, str):
            if not p:
                raise _bad("'prompt' is empty", "prompt")
            return p
        if isinstance(p, list):
            if not p:
                raise _bad("'prompt' is empty", "prompt")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return [int(t) for t in p]
            if all(isinstance(t, (str, list)) for t in p):
                raise _bad(f"only one prompt per request is supported, got {len(p)}", "prompt", "unsupported")
            raise _bad("'prompt' must be a string or an array of token ids (integers)", "prompt", "invalid_type")
        raise _bad(f"'prompt' must be a string or an array of token ids, got {_type_name(p)}", "prompt",
                   "invalid_type")

    def _chat_prompt(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if msgs is None:
            raise _bad("'messages' is required", "messages", "missing_field")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' must be a non-empty array of {role, content} objects", "messages",
                       "invalid_type" if not isinstance(msgs, list) else "invalid_value")
        clean = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(f"'{where}' must be an object, got {_type_name(m)}", where, "invalid_type")
            role = m.get("role")
            if role not in _CHAT_ROLES:
                raise _bad(f"'{where}.role' must be one of {list(_CHAT_ROLES)}, got {json.dumps(role)[:40]}",
                           f"{where}.role")
            content = m.get("content")
            if isinstance(content, list):       # [{"type": "text", "text": ...}, ...]
                parts = []
                for j, part in enumerate(content):
                    text_part = isinstance(part, dict) and part.get("type") == "text"
                    if not (text_part and isinstance(part.get("text"), str)):
                        raise _bad(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}} "
                                   "(only text is supported)", f"{where}.content", "unsupported")
                    parts.append(part["text"])
                content = "".join(parts)
            if content is None and role == "assistant":
                content = ""
            if not isinstance(content, str):
                raise _bad(f"'{where}.content' must be a string or an array of text parts, got {_type_name(content)}",
                           f"{where}.content", "invalid_type")
            msg = {"role": role, "content": content}
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            clean.append(msg)
        tok = self.engine.tokenizer
        try:
            text = tok.apply_chat_template(clean, add_generation_prompt=True)
        except Exception as e:     # template errors (raise_exception, undefined) are the request's fault
            raise _bad(f"the chat template could not render these messages: {e}", "messages") from None
        # like HF apply_chat_template(tokenize=True): the template writes its own special tokens
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise _bad("the rendered chat prompt is empty", "messages")
        return ids

    # -- responses
    def stats(self, out, req: ParsedRequest) -> dict:
        s = {"request_id": out.request_id, "tag": req.tag, "speculative": bool(self.engine.speculative),
             "draft": self.engine.draft_kind}
        s.update(out.metrics or {})
        return s

    @staticmethod
    def usage(out) -> dict:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(reason, reason)


class _TextDelta:
    """Streams text deltas that never need to be taken back: with stop strings, hold back the
    last (longest stop - 1) characters until the request finishes (the engine cuts the text at
    a stop string that may span steps); hold back a trailing U+FFFD (an incomplete UTF-8 char)."""

    def __init__(self, stop: list[str]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta


# ----------------------------------------------------------------------------- the app
def create_app(engine=None, *, target: str | None = None, draft: str | None = None, spec=None, device=None,
               dtype=None, seed: int | None = None, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, warmup: bool = True, max_tags: int = MAX_TAGS):
    """Build the FastAPI app. Pass a ready `engine` (an LLMEngine) or the arguments to build one
    (`target`, `draft` (None: plain autoregressive decoding), `spec`, `device`, `dtype`).
    The engine is warmed up (when `warmup`) before this returns, i.e. before a port opens.
    The step thread starts here; `app.state.specrt.runner.stop()` (or the app's shutdown) ends it."""
    if Request is None:
        raise ImportError("specrt serve needs fastapi and uvicorn: pip install 'specrt[serve]'")
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from specrt.engine import LLMEngine
    from specrt.llm import LLM

    if engine is None:
        if target is None:
            raise ValueError("create_app needs an engine or a target model")
        engine = LLMEngine(target, draft, spec, device, dtype, seed)
    if warmup:
        llm = LLM.__new__(LLM)            # reuse LLM.warmup on this engine
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        llm.warmup(num_requests=min(4, engine.spec.max_batch_size), max_tokens=8)
        # served metrics start at zero: reset in place (also through engine wrappers that delegate)
        engine.metrics.__init__(engine.metrics.window_s)
    if model_name is None:
        model_name = "specrt-builtin" if str(target) == "builtin" else (
            str(target).rstrip("/").rsplit("/", 1)[-1] if target is not None else "specrt")
    state = ServerState(engine, model_name, api_key, max_body_bytes, max_tags)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.runner.stop)

    app = FastAPI(title="specrt", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.specrt = state

    def error_response(err: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

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

    def _count(path: str, status: int) -> None:
        key = (path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
               else "other", status)
        state.http_requests[key] = state.http_requests.get(key, 0) + 1

    def _authorized(scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
        # constant-time compare (hmac.compare_digest on bytes of any length)
        return hmac.compare_digest(token.encode("latin-1"), state.api_key.encode("utf-8"))

    class _AuthAndCount:
        """Pure ASGI middleware (keeps streaming and disconnect semantics intact): API key check
        on everything but /health, and a per-path/status request counter for /metrics."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            path = scope.get("path", "")
            if state.api_key is not None and path != "/health" and not _authorized(scope):
                _count(path, 401)
                resp = error_response(APIError(401, "missing or invalid API key (send 'Authorization: Bearer "
                                               "<key>')", "invalid_request_error", None, "invalid_api_key"))
                return await resp(scope, receive, send)

            async def counting_send(message):
                if message["type"] == "http.response.start":
                    _count(path, message["status"])
                await send(message)

            return await self.app(scope, receive, counting_send)

    app.add_middleware(_AuthAndCount)

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > state.max_body_bytes:
                    raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of "
                                        f"{state.max_body_bytes} bytes", "invalid_request_error", None,
                                   "request_too_large")
            except ValueError:
                raise _bad("invalid Content-Length header", None, "invalid_header") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > state.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {state.max_body_bytes} bytes",
                               "invalid_request_error", None, "request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise _bad("the request body is empty; send a JSON object", None, "invalid_json")
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _bad("the request body is not valid UTF-8", None, "invalid_json") from None
        except json.JSONDecodeError as e:
            raise _bad(f"malformed JSON in the request body: {e.msg} at line {e.lineno} column {e.colno}",
                       None, "invalid_json") from None
        except RecursionError:
            raise _bad("the request body's JSON is nested too deeply", None, "invalid_json") from None

    async def wait_disconnect(request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def admit(req: ParsedRequest, request_id: str) -> asyncio.Queue:
        if not state.runner.alive:
            raise APIError(503, "the engine thread is not running", "server_error", None, "engine_down")
        q = state.runner.submit(request_id, req.prompt, req.params, req.tag)
        try:
            first = await q.get()
        except BaseException:
            state.runner.abort(request_id)
            raise
        if isinstance(first, _Refused):
            raise _bad(first.message, first.param, "context_length_exceeded" if "context" in first.message
                       else "invalid_value")
        if isinstance(first, _Failed):
            raise APIError(500, first.message, "server_error", None, "engine_error")
        return q

    async def handle(request: Request, chat: bool):
        body = await read_json(request)
        req = state.parse(body, chat, request.headers.get("x-specrt-tag"))
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        q = await admit(req, request_id)
        if req.stream:
            return StreamingResponse(stream_events(q, req, request_id, created, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(collect_final(q))
        disconnect = asyncio.ensure_future(wait_disconnect(request))
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
        if isinstance(out, _Failed):
            raise APIError(500, out.message, "server_error", None, "engine_error")
        if out.finish_reason == "error":
            raise APIError(500, f"the request failed: {out.error}", "server_error", None, "engine_error")
        stats = state.stats(out, req)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None, "finish_reason": _finish_reason(out.finish_reason)}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None,
                      "finish_reason": _finish_reason(out.finish_reason)}
        if req.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        return JSONResponse({"id": request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": req.model, "choices": [choice],
                             "usage": state.usage(out), "specrt": stats})

    async def collect_final(q: asyncio.Queue):
        while True:
            item = await q.get()
            if isinstance(item, _Failed) or item.finished:
                return item

    async def stream_events(q: asyncio.Queue, req: ParsedRequest, request_id: str, created: int, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        deltas = _TextDelta(req.params.stop)
        finished = False

        def chunk(choice: dict | None, **extra) -> str:
            payload = {"id": request_id, "object": obj, "created": created, "model": req.model,
                       "choices": [] if choice is None else [choice], **extra}
            return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            while True:
                item = await q.get()
                if isinstance(item, _Failed):
                    finished = True
                    err = APIError(500, item.message, "server_error", None, "engine_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                out = item
                if out.finished and out.finish_reason == "error":
                    finished = True
                    err = APIError(500, f"the request failed: {out.error}", "server_error", None, "engine_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                text = deltas.next(out.text, out.finished)
                new_ids = list(out.new_token_ids)
                reason = _finish_reason(out.finish_reason) if out.finished else None
                if text or new_ids or out.finished:
                    if chat:
                        choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                                  "finish_reason": reason}
                    else:
                        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                    if req.return_token_ids:
                        choice["token_ids"] = new_ids
                    extra = {"specrt": state.stats(out, req)} if out.finished else {}
                    if out.finished and req.include_usage:
                        extra["usage"] = None      # usage comes in its own chunk (OpenAI convention)
                    yield chunk(choice, **extra)
                if out.finished:
                    finished = True
                    if req.include_usage:
                        yield chunk(None, usage=state.usage(out))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                state.runner.abort(request_id)    # client disconnected / cancelled: free its KV blocks

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        eng = state.engine
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "specrt",
            "max_model_len": eng.max_model_len,
            "specrt": {"speculative": bool(eng.speculative), "draft": eng.draft_kind,
                       "max_draft_length": eng.spec.max_draft_length, "policy": eng.spec.policy,
                       "acceptance": eng.spec.acceptance, "max_batch_size": eng.spec.max_batch_size}}]}

    @app.get("/health")
    async def health():
        ok = state.runner.alive
        body = {"status": "ok" if ok else "engine thread stopped", "in_flight": state.runner.num_in_flight,
                "engine_failures": state.runner.failures}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        eng = state.engine
        text = eng.metrics.prometheus()
        extra = [
            "# HELP specrt_requests_in_flight Requests admitted and not yet finished",
            "# TYPE specrt_requests_in_flight gauge",
            f"specrt_requests_in_flight {state.runner.num_in_flight}",
            "# HELP specrt_kv_blocks_free Free KV-cache blocks",
            "# TYPE specrt_kv_blocks_free gauge",
            f"specrt_kv_blocks_free {eng.num_free_blocks()}",
            "# HELP specrt_kv_blocks_total KV-cache blocks",
            "# TYPE specrt_kv_blocks_total gauge",
            f"specrt_kv_blocks_total {eng.kv.manager.num_blocks}",
            "# HELP specrt_engine_step_failures_total Engine steps that raised (their requests failed)",
            "# TYPE specrt_engine_step_failures_total counter",
            f"specrt_engine_step_failures_total {state.runner.failures}",
            "# HELP specrt_http_requests_total HTTP requests by path and status",
            "# TYPE specrt_http_requests_total counter",
        ]
        for (path, status), n in sorted(state.http_requests.items()):
            extra.append(f'specrt_http_requests_total{{path="{path}",status="{status}"}} {n}')
        return Response(text + "\n".join(extra) + "\n", media_type=None,
                        headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    return app


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specrt serve", description="OpenAI-compatible server for specrt.")
    p.add_argument("--target-model", required=True, help="HF model folder or 'builtin'")
    p.add_argument("--draft-model", default=None,
                   help="draft model folder, 'builtin', 'ngram[:N[:M]]' or 'self:N' (used with --speculative-decoding)")
    p.add_argument("--speculative-decoding", action="store_true",
                   help="decode speculatively with the draft (without it: plain autoregressive decoding)")
    p.add_argument("--draft-length", type=int, default=5, help="draft tokens per step (K); the max for "
                   "adaptive policies unless --max-draft-length is given")
    p.add_argument("--min-draft-length", type=int, default=0)
    p.add_argument("--max-draft-length", type=int, default=None)
    p.add_argument("--confidence-threshold", type=float, default=0.3)
    p.add_argument("--acceptance-window", type=int, default=32)
    p.add_argument("--adaptive", dest="adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="adapt the confidence threshold to each request's acceptance")
    p.add_argument("--draft-policy", default="fixed", choices=["fixed", "confidence", "head", "budget"])
    p.add_argument("--acceptance", default="rejection", choices=["rejection", "coupled"])
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="pre-draft the next round while the target verifies")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (also $SPECRT_API_KEY)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=None, help="seed for the seeds of unseeded requests")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def engine_kwargs(args) -> dict:
    """argparse namespace -> LLMEngine arguments; raises ValueError with a clear message."""
    import torch

    from specrt.config import SpecConfig

    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    draft = None
    if args.speculative_decoding:
        draft = args.draft_model
        if draft is None:
            if args.target_model != "builtin":
                raise ValueError("--speculative-decoding needs --draft-model "
                                 "(a folder, 'builtin', 'ngram' or 'self:N')")
            draft = "builtin"
    elif args.draft_model is not None:
        logger.warning("--draft-model is ignored without --speculative-decoding (serving plain decoding)")
    max_k = args.max_draft_length if args.max_draft_length is not None else args.draft_length
    spec = SpecConfig(min_draft_length=args.min_draft_length, max_draft_length=max_k,
                      confidence_threshold=args.confidence_threshold, acceptance_window=args.acceptance_window,
                      adaptive_enabled=args.adaptive, policy=args.draft_policy, acceptance=args.acceptance,
                      overlap=args.overlap, max_batch_size=args.max_batch_size, max_model_len=args.max_model_len)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    return dict(target=args.target_model, draft=draft, spec=spec, device=args.device, dtype=dtype, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_body_bytes < 1024:
        print("specrt serve: --max-body-bytes must be >= 1024", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("SPECRT_API_KEY") or None
    try:
        kw = engine_kwargs(args)
    except ValueError as e:
        print(f"specrt serve: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    import uvicorn

    t0 = time.perf_counter()
    engine = None
    try:
        if args.tensor_parallel_size > 1:   # the server spawns its own workers: no external launcher
            from specrt.distributed import create_engine

            engine = create_engine(**kw, tensor_parallel_size=args.tensor_parallel_size)
        app = create_app(engine, **({} if engine is not None else kw), model_name=args.served_model_name,
                         api_key=api_key, max_body_bytes=args.max_body_bytes, warmup=args.warmup)
    except ValueError as e:
        print(f"specrt serve: {e}", file=sys.stderr)
        if engine is not None:
            engine.close()
        return 2
    eng = app.state.specrt.engine
    logger.info("engine ready in %.1fs (speculative=%s, draft=%s, K=%d, policy=%s, acceptance=%s); "
                "serving '%s' on http://%s:%d", time.perf_counter() - t0, eng.speculative, eng.draft_kind,
                eng.spec.max_draft_length, eng.spec.policy, eng.spec.acceptance, app.state.specrt.model_name,
                args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("binding to %s without --api-key: anyone who can reach this address can use the server",
                       args.host)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                    access_log=args.log_level == "debug")
    finally:
        if engine is not None:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
