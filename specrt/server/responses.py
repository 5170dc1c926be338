"""Response bodies: the non-streamed JSON, the server-sent events of a stream, usage and the
specrt statistics. Every stream ends with `data: [DONE]`, after its last choice or an error.
A stream cut off by the server still ends its choice with a finish_reason ("abort" when the
server shuts down, "error" when a step failed) before the error event and [DONE]."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from specrt.server.errors import APIError, server_error
from specrt.server.logprobs import chat_logprobs, completion_logprobs, token_strings
from specrt.server.parse import ParsedRequest
from specrt.server.runner import Failed


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(reason, reason)


def failed_reason(item) -> str:
    """The finish_reason of a request that ended in an error: "abort" when the server cut it off
    (shutting down), "error" otherwise."""
    if isinstance(item, Failed) and item.code == "server_shutting_down":
        return "abort"
    return "error"


def failure(item) -> APIError | None:
    """The error a queue item ends its request with (None when it is a normal output)."""
    if isinstance(item, Failed):
        return APIError(item.status, item.message, "server_error", None, item.code)
    if item.finished and item.finish_reason == "error":
        return server_error(f"the request failed: {item.error}")
    return None


def usage(out, req: ParsedRequest | None = None) -> dict:
    p, c = len(out.prompt_token_ids), 0 if req is not None and req.score_only else len(out.token_ids)
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


class Rendered:
    """A request's text and logprobs as sent so far (a whole response is one call of ``next``):
    echo puts the prompt first, score_only (echo with max_tokens 0) drops the generated token."""

    def __init__(self, engine, req: ParsedRequest, chat: bool):
        self.req, self.chat = req, chat
        self.strings = token_strings(engine.tokenizer) if req.params.logprobs is not None else None
        self.deltas = TextDelta(req.params.stop)
        self.prompt_sent = not req.echo
        self.tokens_sent = 0
        self.offset = 0                # completions' text_offset of the next token

    def next(self, out) -> tuple[str, list[int], dict | None]:
        """(text delta, new token ids, logprobs object of the new tokens or None)."""
        req = self.req
        text = "" if req.score_only else self.deltas.next(out.text, out.finished)
        ids, records = [], []
        if not req.score_only:
            ids = list(out.token_ids[self.tokens_sent:])
            records = list(out.logprobs[self.tokens_sent:]) if out.logprobs is not None else []
            self.tokens_sent = len(out.token_ids)
        lead_ids, lead_records = [], []
        if not self.prompt_sent:
            self.prompt_sent = True
            text = req.prompt_text + text
            lead_ids = list(out.prompt_token_ids)
            lead_records = out.prompt_logprobs or [None] * len(lead_ids)
        if self.strings is None:
            return text, ids, None
        if self.chat:
            return text, ids, chat_logprobs(self.strings, records)
        body, self.offset = completion_logprobs(self.strings, lead_ids + ids, list(lead_records) + records,
                                                self.offset)
        return text, ids, body


def completion_body(engine, out, req: ParsedRequest, request_id: str, created: int, chat: bool) -> dict:
    reason = finish_reason(out.finish_reason)
    text, ids, logprobs = Rendered(engine, req, chat).next(out)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if req.return_token_ids:
        choice["token_ids"] = ids
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": req.model, "choices": [choice], "usage": usage(out, req), "specrt": spec_stats(engine, out, req)}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def stream_events(engine, q: asyncio.Queue, req: ParsedRequest, request_id: str, created: int,
                        chat: bool) -> AsyncIterator[str]:
    """The SSE events of one admitted request, from its queue to `data: [DONE]`."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    rendered = Rendered(engine, req, chat)

    def chunk(choice: dict | None, **extra) -> str:
        return _event({"id": request_id, "object": obj, "created": created, "model": req.model,
                       "choices": [] if choice is None else [choice], **extra})

    if chat:
        yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    last = None
    while True:
        out = await q.get()
        err = failure(out)
        if err is not None:
            # cut off (a drain, a failed step): the choice still ends with a finish_reason, then
            # the usage so far (if asked), then the error event, then [DONE]
            reason = failed_reason(out)
            choice = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            choice.update({"logprobs": None, "finish_reason": reason})
            if req.return_token_ids:
                choice["token_ids"] = []
            yield chunk(choice, **({"usage": None} if req.include_usage else {}))
            if req.include_usage and last is not None:
                yield chunk(None, usage=usage(last, req))
            yield _event(err.body())
            break
        last = out
        text, new_ids, logprobs = rendered.next(out)
        if text or new_ids or out.finished or (logprobs is not None and not chat and logprobs["tokens"]):
            reason = finish_reason(out.finish_reason) if out.finished else None
            if chat:
                choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            if req.return_token_ids:
                choice["token_ids"] = new_ids
            extra = {"specrt": spec_stats(engine, out, req)} if out.finished else {}
            if out.finished and req.include_usage:
                extra["usage"] = None      # usage comes in its own chunk (OpenAI convention)
            yield chunk(choice, **extra)
        if out.finished:
            if req.include_usage:
                yield chunk(None, usage=usage(out, req))
            break
    yield "data: [DONE]\n\n"
