"""Request body (bytes) -> ParsedRequest: JSON, Unicode, the schema, the model name, the tag,
SamplingParams and the prompt's token ids. Runs on the tokenizer pool, off the event loop."""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

from pydantic import ValidationError

from specrt.config import SamplingParams
from specrt.server.errors import APIError, bad, show, type_name
from specrt.server.schemas import ChatCompletionRequest, CompletionRequest, api_error
from specrt.server.prompts import prompt_token_ids

_TAG_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tag: str
    return_token_ids: bool
    model: str


class TagSet:
    """Tags seen so far; bounded (Prometheus label cardinality): later new tags become "other"."""

    def __init__(self, max_tags: int):
        self.max_tags = max_tags
        self._tags = {"default"}
        self._lock = threading.Lock()      # parsing runs on several pool threads

    def tag_for(self, tag) -> str:
        if tag is None:
            return "default"
        if not isinstance(tag, str) or not _TAG_RE.match(tag):
            raise bad(f"the request tag must be 1-64 characters of [A-Za-z0-9_.:-], got {show(tag, 80)}",
                      "specrt.tag")
        with self._lock:
            if tag not in self._tags:
                if len(self._tags) >= self.max_tags:
                    return "other"
                self._tags.add(tag)
        return tag


def decode_json(raw: bytes):
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("the request body is not valid UTF-8", None, "invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad(f"malformed JSON in the request body: {e.msg} at line {e.lineno} column {e.colno}",
                  None, "invalid_json") from None
    except RecursionError:
        raise bad("the request body's JSON is nested too deeply", None, "invalid_json") from None
    except ValueError as e:        # e.g. an integer of more than 4300 digits
        raise bad(f"the request body holds a number that cannot be read: {str(e)[:120]}", None,
                  "invalid_json") from None


def _surrogate_path(x, path: str) -> str | None:
    if isinstance(x, str):
        return None if not any("\ud800" <= c <= "\udfff" for c in x) else path
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        if isinstance(k, str) and _surrogate_path(k, "") is not None:
            return (path + "." if path else "") + ascii(k)
        sub = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else k)
        found = _surrogate_path(v, sub)
        if found is not None:
            return found
    return None


def check_unicode(body) -> None:
    """Refuse lone UTF-16 surrogates ("\\ud800" in JSON): they are not text, and no tokenizer
    or UTF-8 response can hold them."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    path = _surrogate_path(body, "") or None
    raise bad(f"'{path}' holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode text",
              path, "invalid_unicode")


def _sampling_params(req, chat: bool, max_model_len: int) -> SamplingParams:
    kw = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_tokens", "seed", "ignore_eos")
          if getattr(req, name) is not None}
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    # OpenAI's completions default is 16; chat runs to the end of the context (the engine stops there)
    kw["max_tokens"] = max_tokens if max_tokens is not None else (max_model_len if chat else 16)
    if req.stop:
        kw["stop"] = req.stop
    try:
        return SamplingParams(**kw)
    except ValueError as e:     # cross-field checks (min_tokens <= max_tokens); the message names the field
        name = str(e).split(" ", 1)[0]
        raise bad(str(e), name if name in kw else None) from None


def parse_request(raw: bytes, chat: bool, header_tag: str | None, *, model_name: str, tags: TagSet,
                  tokenizer, max_model_len: int, max_prompt_chars: int) -> ParsedRequest:
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type_name(body)}", None, "invalid_type")
    check_unicode(body)
    schema = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise api_error(e, schema) from None
    if req.model is not None and req.model != model_name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                       "invalid_request_error", "model", "model_not_found")
    ext = req.specrt
    tag = tags.tag_for(ext.tag if ext is not None and ext.tag is not None else header_tag)
    params = _sampling_params(req, chat, max_model_len)
    prompt = [m.model_dump(exclude_none=True) | {"content": m.content or ""} for m in req.messages] if chat \
        else req.prompt
    ids = prompt_token_ids(prompt, chat, tokenizer, max_model_len, max_prompt_chars)
    so = req.stream_options
    return ParsedRequest(prompt_ids=ids, params=params, stream=bool(req.stream),
                         include_usage=bool(so is not None and so.include_usage), tag=tag,
                         return_token_ids=bool(ext is not None and ext.return_token_ids), model=model_name)
