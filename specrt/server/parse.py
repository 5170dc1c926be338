"""Request body (bytes) -> ParsedRequest: JSON, Unicode, the schema, the model name, the tag,
SamplingParams and the prompt's token ids. Runs on the tokenizer pool, off the event loop."""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

from pydantic import ValidationError

from specrt.config import MAX_BAD_WORD_TOKENS, SamplingParams
from specrt.structured import Structured
from specrt.server.errors import APIError, bad, show, type_name
from specrt.server.schemas import ChatCompletionRequest, CompletionRequest, api_error
from specrt.server.prompts import encode_texts, prompt_token_ids

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
    echo: bool = False           # completions: the prompt leads the text (and the logprobs, if asked)
    prompt_text: str = ""        # the prompt as text (echo)
    score_only: bool = False     # completions with echo and max_tokens 0: the generated token is dropped
    tenant: str | None = None    # the OpenAI "user" field: whose history a scoped suffix drafter reads


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


_CONTROLS = ("temperature", "top_p", "top_k", "min_tokens", "seed", "ignore_eos", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "allowed_token_ids", "structured_close")


class ParseCancelled(Exception):
    """The client went away (or the server is stopping) while its request was being parsed."""


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise ParseCancelled()


BAD_WORDS_CHUNK = 256      # texts tokenized per call; the cancel flag is checked between calls


def _bad_words_ids(words: list[str] | None, tokenizer, cancel: threading.Event | None = None) -> list[list[int]] | None:
    """vLLM's bad_words: each word's tokens as it starts the text and after a space (when they differ).
    Linear in the words (a set of the sequences seen; the schema bounds their number and length),
    tokenized in batches, stopping when ``cancel`` is set."""
    if not words:
        return None
    texts = [t for w in words for t in (w.lstrip(), " " + w.lstrip())]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for start in range(0, len(texts), BAD_WORDS_CHUNK):
        _check_cancel(cancel)
        for j, ids in enumerate(encode_texts(tokenizer, texts[start:start + BAD_WORDS_CHUNK], False)):
            if not ids:
                continue
            if len(ids) > MAX_BAD_WORD_TOKENS:
                w = words[(start + j) // 2]
                raise bad(f"'bad_words' entry {show(w)} is {len(ids)} tokens long; at most {MAX_BAD_WORD_TOKENS}",
                          "bad_words")
            key = tuple(ids)
            if key not in seen:
                seen.add(key)
                out.append(ids)
    return out or None


def _logprob_fields(req, chat: bool) -> tuple[int | None, int | None]:
    """(SamplingParams.logprobs, .prompt_logprobs) from the endpoint's fields."""
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None, None
    if req.top_logprobs is not None:
        raise bad("'top_logprobs' is a chat field; /v1/completions takes 'logprobs': an integer (0-20)",
                  "top_logprobs")
    return req.logprobs, req.logprobs if req.echo else None


STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _structured(req) -> tuple[Structured | None, str | None]:
    """(the Structured record, the field that gave it) from OpenAI's response_format or vLLM's
    guided_* fields (at most one of them); (None, None) for free text. 400 naming the field when
    its schema, regex or grammar is invalid, or when llguidance is not installed."""
    fmt = req.response_format
    given = [name for name in STRUCTURED_FIELDS if getattr(req, name) is not None
             and not (name == "response_format" and fmt["type"] == "text")]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad(f"give at most one of {', '.join(STRUCTURED_FIELDS)}; got {' and '.join(given)}", given[1])
    name = given[0]
    field = "response_format.json_schema.schema" if name == "response_format" and fmt["type"] == "json_schema" \
        else name
    try:
        if name == "response_format":
            return (Structured("json_object") if fmt["type"] == "json_object" else
                    Structured("json_schema", fmt["json_schema"]["schema"])), field
        kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}[name]
        return Structured(kind, getattr(req, name)), field
    except ValueError as e:
        raise bad(_field_message(str(e), field), field) from None
    except ImportError as e:
        raise bad(f"'{name}' is not available on this server: {e}", name, "unsupported") from None


def _field_message(message: str, field: str) -> str:
    """'structured: X' (specrt.structured's messages) -> "'field': X"."""
    return f"'{field}': {message[len('structured: '):]}" if message.startswith("structured: ") else message


def _sampling_params(req, chat: bool, max_model_len: int, tokenizer, vocab_size: int,
                     cancel: threading.Event | None = None, compile_structured=None) -> SamplingParams:
    kw = {name: getattr(req, name) for name in _CONTROLS if getattr(req, name) is not None}
    structured, structured_field = _structured(req)
    if structured is not None:
        kw["structured"] = structured
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens == 0:
        if chat or not req.echo:
            raise bad("'max_tokens' must be an integer in [1, 2147483647] (0 only with 'echo': the prompt is "
                      "scored, nothing generated)", "max_tokens")
        max_tokens = 1          # one token is generated and dropped (score_only)
    # OpenAI's completions default is 16; chat runs to the end of the context (the engine stops there)
    kw["max_tokens"] = max_tokens if max_tokens is not None else (max_model_len if chat else 16)
    if req.stop:
        kw["stop"] = req.stop
    if req.logit_bias:
        kw["logit_bias"] = {int(t): b for t, b in req.logit_bias.items()}
    words = _bad_words_ids(req.bad_words, tokenizer, cancel)
    if words:
        kw["bad_words_ids"] = words
    kw["logprobs"], kw["prompt_logprobs"] = _logprob_fields(req, chat)
    try:
        params = SamplingParams(**kw)
        params.check_token_ids(vocab_size)
    except ValueError as e:     # cross-field checks (min_tokens <= max_tokens); the message names the field
        m = re.match(r"[a-z_]+", str(e))
        name = m.group(0) if m else None
        name = "bad_words" if name == "bad_words_ids" else name
        if name == "structured":
            raise bad(str(e).replace("structured output", f"'{structured_field}'", 1), structured_field) from None
        raise bad(str(e).replace("bad_words_ids", "bad_words") if req.bad_words else str(e),
                  name if name in kw or name == "bad_words" else None) from None
    if structured is not None and compile_structured is not None:
        _check_cancel(cancel)
        try:                    # compiled here, on the parse pool: the step thread finds it in the cache
            compile_structured(structured)
        except ValueError as e:
            raise bad(_field_message(str(e), structured_field), structured_field) from None
        except ImportError as e:
            raise bad(f"'{structured_field}' is not available on this server: {e}", structured_field,
                      "unsupported") from None
    return params


def _requested_tokens(req, chat: bool) -> tuple[str, int] | None:
    """(field, value) of the generation length the client asked for, or None (the default)."""
    if chat and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return ("max_tokens", req.max_tokens) if req.max_tokens is not None else None


def check_context(n_prompt: int, requested: tuple[str, int] | None, max_model_len: int) -> None:
    """A prompt plus an explicit max_tokens beyond the context is a 400 (as OpenAI and vLLM
    answer), not a generation cut short at the context. Without max_tokens the generation runs
    to the context (chat) or 16 tokens (completions), whichever comes first."""
    if requested is None:
        return
    name, n = requested
    if n_prompt + n > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but {n_prompt + n} "
                       f"were requested ({n_prompt} in the prompt + {n} in '{name}'); reduce '{name}' to at most "
                       f"{max_model_len - n_prompt} or shorten the prompt", "invalid_request_error", name,
                       "context_length_exceeded")


def parse_request(raw: bytes, chat: bool, header_tag: str | None, *, model_name: str, tags: TagSet,
                  tokenizer, max_model_len: int, max_prompt_chars: int, vocab_size: int | None = None,
                  escape_special_tokens: bool = True, cancel: threading.Event | None = None,
                  compile_structured=None) -> ParsedRequest:
    """``escape_special_tokens``: special-token strings in chat messages ("<|im_end|>") are
    tokenized as plain text, never as control tokens (a user cannot forge a turn).
    ``cancel``: set by the server when the client goes away; the parse stops (ParseCancelled).
    ``compile_structured(Structured)``: the engine's grammar compiler (structured output is
    compiled here, off the step thread; a grammar that does not compile is a 400)."""
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
    if req.stream_options is not None and not req.stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    ext = req.specrt
    tag = tags.tag_for(ext.tag if ext is not None and ext.tag is not None else header_tag)
    _check_cancel(cancel)
    params = _sampling_params(req, chat, max_model_len, tokenizer,
                              vocab_size if vocab_size is not None else tokenizer.vocab_size, cancel, compile_structured)
    _check_cancel(cancel)
    prompt = [m.model_dump(exclude_none=True) | {"content": m.content or ""} for m in req.messages] if chat \
        else req.prompt
    ids = prompt_token_ids(prompt, chat, tokenizer, max_model_len, max_prompt_chars,
                           escape_special=escape_special_tokens)
    check_context(len(ids), _requested_tokens(req, chat), max_model_len)
    so = req.stream_options
    echo = bool(not chat and req.echo)
    prompt_text = (req.prompt if isinstance(req.prompt, str) else tokenizer.decode(ids)) if echo else ""
    return ParsedRequest(prompt_ids=ids, params=params, stream=bool(req.stream),
                         include_usage=bool(so is not None and so.include_usage), tag=tag,
                         return_token_ids=bool(ext is not None and ext.return_token_ids), model=model_name,
                         echo=echo, prompt_text=prompt_text, score_only=echo and req.max_tokens == 0,
                         tenant=req.user[:256] if isinstance(req.user, str) and req.user else None)
