"""Response bodies: the non-streamed JSON, the server-sent events of a stream, usage and the
specrt statistics. Every stream ends with `data: [DONE]`, after its last choice or an error."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from specrt.server.errors import APIError, server_error
from specrt.server.parse import ParsedRequest
from specrt.server.runner import Failed


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(reason, reason)


def failure(item) -> APIError | None:
    """The error a queue item ends its request with (None when it is a normal output)."""
    if isinstance(item, Failed):
        return APIError(item.status, item.message, "server_error", None, item.code)
    if item.finished and item.finish_reason == "error":
        return server_error(f"the request failed: {item.error}")
    return None


def usage(out) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def spec_stats(engine, out, req: ParsedRequest) -> dict:
    s = {"request_id": out.request_id, "tag": req.tag, "speculative": bool(engine.speculative),
         "draft": engine.draft_kind}
    s.update(out.metrics or {})
    return s


class TextDelta:
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


def completion_body(engine, out, req: ParsedRequest, request_id: str, created: int, chat: bool) -> dict:
    reason = finish_reason(out.finish_reason)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": reason}
    if req.return_token_ids:
        choice["token_ids"] = list(out.token_ids)
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": req.model, "choices": [choice], "usage": usage(out), "specrt": spec_stats(engine, out, req)}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def stream_events(engine, q: asyncio.Queue, req: ParsedRequest, request_id: str, created: int,
                        chat: bool) -> AsyncIterator[str]:
    """The SSE events of one admitted request, from its queue to `data: [DONE]`."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    deltas = TextDelta(req.params.stop)

    def chunk(choice: dict | None, **extra) -> str:
        return _event({"id": request_id, "object": obj, "created": created, "model": req.model,
                       "choices": [] if choice is None else [choice], **extra})

    if chat:
        yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    while True:
        out = await q.get()
        err = failure(out)
        if err is not None:
            yield _event(err.body())
            break
        text = deltas.next(out.text, out.finished)
        new_ids = list(out.new_token_ids)
        if text or new_ids or out.finished:
            reason = finish_reason(out.finish_reason) if out.finished else None
            if chat:
                choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            if req.return_token_ids:
                choice["token_ids"] = new_ids
            extra = {"specrt": spec_stats(engine, out, req)} if out.finished else {}
            if out.finished and req.include_usage:
                extra["usage"] = None      # usage comes in its own chunk (OpenAI convention)
            yield chunk(choice, **extra)
        if out.finished:
            if req.include_usage:
                yield chunk(None, usage=usage(out))
            break
    yield "data: [DONE]\n\n"
