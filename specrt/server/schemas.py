"""Request bodies as pydantic models: the HTTP schema (served in /openapi.json) and its checks.

Strict types (no "10" for 10, no true for 1; an integral float such as 10.0 is an integer),
ranges that fit the kernels' types (the same constants SamplingParams checks), unknown
fields refused. `api_error` turns pydantic's first error into an OpenAI-style 400 that names
the field. Context-dependent checks (prompt length, the model name) live in parse.py.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from specrt.config import (INT32_MAX, INT64_MAX, INT64_MIN, LOGIT_BIAS_RANGE, MAX_BAD_WORD_TOKENS, MAX_LOGPROBS,
                           MAX_STOP_CHARS,
                           MAX_STOP_STRINGS, MAX_TOKEN_LIST, PENALTY_RANGE, REPETITION_PENALTY_RANGE,
                           TEMPERATURE_MAX)
from specrt.server.errors import APIError, bad, show, type_name

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# bad_words: bounded before anything is tokenized (each word is tokenized twice, and every
# banned sequence is checked at every step of the request)
MAX_BAD_WORDS = 4096              # entries
MAX_BAD_WORD_CHARS = 1024         # characters of one entry (it must also be at most MAX_BAD_WORD_TOKENS tokens)
MAX_BAD_WORDS_CHARS = 65536       # characters of all entries together
# OpenAI fields accepted only at their neutral value (anything else: 400 "not supported")
NEUTRAL = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "function_call": ("none",), "parallel_tool_calls": (True, False),
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
MAX_SCHEMA_NAME_CHARS = 64
_SUFFIX_NOTE = "accepted only empty: inserting between a prompt and a suffix needs a fill-in-the-middle model"


_NEUTRAL_NOTE = "accepted only at its neutral value (OpenAI compatibility)"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = Field(None, description="send a last chunk with the token usage")
    continuous_usage_stats: Optional[bool] = Field(None, description="accepted, no effect")


class SpecrtOptions(_Strict):
    """The specrt extension object."""
    tag: Optional[str] = Field(None, description="label for the Prometheus metrics: 1-64 of [A-Za-z0-9_.:-] "
                                                 "(also from the X-Specrt-Tag header)")
    return_token_ids: Optional[bool] = Field(None, description="add the generated token ids to each choice")


def _same(v, neutral) -> bool:
    num = (int, float)
    if isinstance(neutral, num) and not isinstance(neutral, bool):
        return isinstance(v, num) and not isinstance(v, bool) and v == neutral
    return type(v) is type(neutral) and v == neutral


class _Common(_Strict):
    """Fields both endpoints take: sampling (OpenAI + vLLM-style extensions) and streaming."""

    model: Optional[str] = Field(None, description="the served model's name (see /v1/models)")
    temperature: Optional[float] = Field(None, ge=0, le=TEMPERATURE_MAX, allow_inf_nan=False,
                                         description="0 = greedy")
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1, le=INT32_MAX,
                                 description="0 or -1 disables; values >= the vocabulary size keep every token")
    max_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX, description="the prompt plus max_tokens must fit the "
                                      "model's context (else 400, param max_tokens)")
    min_tokens: Optional[int] = Field(None, ge=0, le=INT32_MAX, description="EOS is masked before this many tokens")
    ignore_eos: Optional[bool] = None
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Optional[Union[str, list[str]]] = Field(None, description=f"at most {MAX_STOP_STRINGS} strings of at "
                                                                    f"most {MAX_STOP_CHARS} characters")
    n: Optional[int] = Field(None, description="must be 1: one choice per request")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = Field(None, description="only with \"stream\": true (else 400)")
    specrt: Optional[SpecrtOptions] = None
    user: Any = Field(None, description="a string names the tenant whose history a scoped suffix drafter "
                                        "(draft 'suffix:scoped=1') drafts from; anything else has no effect")
    metadata: Any = Field(None, description="accepted, no effect")
    store: Any = Field(None, description="accepted, no effect")
    service_tier: Any = Field(None, description="accepted, no effect")
    min_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False,
                                   description="keep tokens at least min_p times as likely as the most likely; 0 = off")
    repetition_penalty: Optional[float] = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                                allow_inf_nan=False,
                                                description="1 = off; >1 discourages tokens of the prompt and output")
    presence_penalty: Optional[float] = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE, allow_inf_nan=False,
                                              description="subtracted once from every generated token's logit")
    frequency_penalty: Optional[float] = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE, allow_inf_nan=False,
                                               description="subtracted per occurrence from generated tokens' logits")
    logit_bias: Optional[dict[str, float]] = Field(
        None, description=f"token id (a string) -> bias in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}] added to "
                          "its logit")
    allowed_token_ids: Optional[list[int]] = Field(None, description="only these tokens may be generated")
    bad_words: Optional[list[str]] = Field(None, description=f"words never generated (each tokenized with and "
                                                             f"without a leading space): at most {MAX_BAD_WORDS} "
                                                             f"non-empty strings of at most {MAX_BAD_WORD_CHARS} "
                                                             f"characters and {MAX_BAD_WORD_TOKENS} tokens each, "
                                                             f"{MAX_BAD_WORDS_CHARS} characters in all")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="chat: most likely alternatives per token (needs logprobs)")
    best_of: Any = Field(None, description=_NEUTRAL_NOTE)
    suffix: Any = Field(None, description=_SUFFIX_NOTE)
    tools: Any = Field(None, description=_NEUTRAL_NOTE)
    functions: Any = Field(None, description=_NEUTRAL_NOTE)
    tool_choice: Any = Field(None, description=_NEUTRAL_NOTE)
    function_call: Any = Field(None, description=_NEUTRAL_NOTE)
    parallel_tool_calls: Any = Field(None, description=_NEUTRAL_NOTE)
    # structured output (at most one of these; specrt.structured)
    response_format: Any = Field(None, description="OpenAI: {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                                                   "or {\"type\": \"json_schema\", \"json_schema\": {\"name\", "
                                                   "\"schema\", \"strict\"}}: the output is JSON (matching the "
                                                   "schema)")
    guided_json: Optional[Union[dict[str, Any], str]] = Field(None, description="vLLM: a JSON schema the output "
                                                                                "matches")
    guided_regex: Optional[str] = Field(None, description="vLLM: a regular expression the whole output matches")
    guided_choice: Optional[list[str]] = Field(None, description="vLLM: the output is one of these strings")
    guided_grammar: Optional[str] = Field(None, description="vLLM: a grammar (Lark, or GBNF / EBNF) the output "
                                                            "matches")
    structured_close: Optional[bool] = Field(None, description="with structured output: near max_tokens, narrow "
                                                               "the mask so the structure still finishes in time "
                                                               "(default true; false: the grammar's mask alone)")

    @field_validator("top_k", "max_tokens", "min_tokens", "seed", "n", "top_logprobs", mode="before")
    @classmethod
    def _integral_float(cls, v):
        # JSON writers may spell 10 as 10.0; strict int would refuse it
        return int(v) if isinstance(v, float) and v.is_integer() else v

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral_only(cls, v, info):
        if v is None or any(_same(v, n) for n in NEUTRAL[info.field_name]):
            return v
        note = " (a fill-in-the-middle insertion)" if info.field_name == "suffix" else ""
        raise PydanticCustomError("unsupported", "'{name}' is not supported by this server{note} (got {got})",
                                  {"name": info.field_name, "got": show(v, 60), "note": note})

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v):
        if v is None:
            return v
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in RESPONSE_FORMATS:
            raise PydanticCustomError("invalid_value", "'response_format' must be an object with \"type\" one of "
                                      "{kinds}, got {got}", {"kinds": ", ".join(RESPONSE_FORMATS), "got": show(v, 60)})
        extra = sorted(set(v) - {"type", "json_schema"})
        if extra or (kind != "json_schema" and "json_schema" in v):
            raise PydanticCustomError("invalid_value", "'response_format' of type {kind} takes no field {field}",
                                      {"kind": kind, "field": show((extra or ["json_schema"])[0])})
        if kind != "json_schema":
            return {"type": kind}
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise PydanticCustomError("invalid_value", "'response_format.json_schema' must be an object with "
                                      "\"name\", \"schema\" (a JSON schema object) and \"strict\", got {got}",
                                      {"got": show(js, 60)})
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_SCHEMA_NAME_CHARS):
            raise PydanticCustomError("invalid_value", "'response_format.json_schema.name' must be a string of 1-{n} "
                                      "characters, got {got}", {"n": MAX_SCHEMA_NAME_CHARS, "got": show(name)})
        for key in ("strict",):
            if js.get(key) is not None and not isinstance(js[key], bool):
                raise PydanticCustomError("invalid_value", "'response_format.json_schema.strict' must be a boolean, "
                                          "got {got}", {"got": show(js[key])})
        unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
        if unknown:
            raise PydanticCustomError("invalid_value", "'response_format.json_schema' takes name, schema, strict and "
                                      "description, got {field}", {"field": show(unknown[0])})
        return {"type": kind, "json_schema": js}

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        if not isinstance(v, dict):
            raise PydanticCustomError("invalid_type", "'logit_bias' must be an object {\"token id\": bias}, got "
                                      "{got}", {"got": type_name(v)})
        if len(v) > MAX_TOKEN_LIST:
            raise PydanticCustomError("invalid_value", "'logit_bias' may hold at most {n} tokens",
                                      {"n": MAX_TOKEN_LIST})
        out = {}
        for key, bias in v.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
                raise PydanticCustomError("invalid_value", "'logit_bias' keys must be token ids (non-negative "
                                          "integers as strings), got {got}", {"got": show(key)})
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -LOGIT_BIAS_RANGE <= bias <= \
                    LOGIT_BIAS_RANGE:
                raise PydanticCustomError("invalid_value", "'logit_bias[{key}]' must be a number in [-{r}, {r}], got "
                                          "{got}", {"key": key, "r": f"{LOGIT_BIAS_RANGE:g}", "got": show(bias)})
            out[key] = float(bias)
        return out

    @field_validator("allowed_token_ids", mode="before")
    @classmethod
    def _token_list(cls, v):
        if v is None:
            return v
        if not isinstance(v, list) or not v or len(v) > MAX_TOKEN_LIST or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in v):
            raise PydanticCustomError("invalid_value", "'allowed_token_ids' must be a non-empty array of at most {n} "
                                      "token ids (integers >= 0)", {"n": MAX_TOKEN_LIST})
        return v

    @field_validator("bad_words", mode="before")
    @classmethod
    def _words(cls, v):
        if v is None:
            return v
        if not isinstance(v, list):
            raise PydanticCustomError("invalid_type", "'bad_words' must be an array of non-empty strings, got {got}",
                                      {"got": type_name(v)})
        if len(v) > MAX_BAD_WORDS:
            raise PydanticCustomError("invalid_value", "'bad_words' may hold at most {n} words, got {got}",
                                      {"n": MAX_BAD_WORDS, "got": len(v)})
        total = 0
        for i, w in enumerate(v):
            if not isinstance(w, str) or not w.strip():
                raise PydanticCustomError("invalid_value", "'bad_words' must be an array of non-empty strings; entry "
                                          "{i} is {got}", {"i": i, "got": show(w)})
            if len(w) > MAX_BAD_WORD_CHARS:
                raise PydanticCustomError("invalid_value", "'bad_words' entry {i} is {got} characters long; at most "
                                          "{n} characters", {"i": i, "got": len(w), "n": MAX_BAD_WORD_CHARS})
            total += len(w)
        if total > MAX_BAD_WORDS_CHARS:
            raise PydanticCustomError("invalid_value", "'bad_words' holds {got} characters in all; at most {n} "
                                      "characters", {"got": total, "n": MAX_BAD_WORDS_CHARS})
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n not in (None, 1):
            raise PydanticCustomError("unsupported", "'n' must be 1 (one choice per request), got {n}", {"n": n})
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None or isinstance(v, str):
            v = [] if v is None else [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise PydanticCustomError("invalid_type", "'stop' must be a string or an array of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise PydanticCustomError("invalid_value", "'stop' may hold at most {n} strings, got {got}",
                                      {"n": MAX_STOP_STRINGS, "got": len(v)})
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise PydanticCustomError("invalid_value", "'stop' strings may be at most {n} characters",
                                      {"n": MAX_STOP_CHARS})
        return [s for s in v if s]


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        ..., description="a string or an array of token ids; a batch of exactly one prompt is accepted too")
    max_tokens: Optional[int] = Field(None, ge=0, le=INT32_MAX, description="the prompt plus max_tokens must fit the "
                                      "model's context (else 400); 0 only with echo (score the prompt)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="log-probabilities of every token and "
                                                                             "this many most likely alternatives")
    echo: Optional[bool] = Field(None, description="prepend the prompt to the text (and its log-probabilities)")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _integral_logprobs(cls, v):
        return int(v) if isinstance(v, float) and v.is_integer() else v

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, p):
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]          # a batch of one prompt
        if isinstance(p, str):
            if not p:
                raise PydanticCustomError("invalid_value", "'prompt' is empty")
            return p
        if not isinstance(p, list):
            raise PydanticCustomError("invalid_type", "'prompt' must be a string or an array of token ids, "
                                      "got {got}", {"got": type_name(p)})
        if not p:
            raise PydanticCustomError("invalid_value", "'prompt' is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if all(isinstance(t, (str, list)) for t in p):
            raise PydanticCustomError("unsupported", "only one prompt per request is supported, got {n}",
                                      {"n": len(p)})
        raise PydanticCustomError("invalid_type", "'prompt' must be a string or an array of token ids (integers)")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; text content only (a string or an array of text parts)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal[CHAT_ROLES]
    content: Optional[Union[str, list[TextPart]]] = Field(None, validate_default=True)
    name: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content, info):
        if isinstance(content, list):        # [{"type": "text", "text": ...}, ...] -> one string
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise PydanticCustomError("unsupported", "'content[{j}]' must be a text part {\"type\": "
                                              "\"text\", \"text\": ...} (only text is supported)", {"j": j})
                parts.append(part["text"])
            return "".join(parts)
        if content is None and info.data.get("role") != "assistant":     # only an assistant may leave it out
            raise PydanticCustomError("invalid_type", "'content' must be a string or an array of text parts, "
                                      "got null")
        if content is not None and not isinstance(content, str):
            raise PydanticCustomError("invalid_type", "'content' must be a string or an array of text parts, "
                                      "got {got}", {"got": type_name(content)})
        return content

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, name):
        return name if isinstance(name, str) else None     # a non-string name is ignored, as before


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX, description="overrides max_tokens (the "
                                                 "same context check)")
    logprobs: Optional[bool] = Field(None, description="log-probabilities of the generated tokens")
    echo: Any = Field(None, description=_NEUTRAL_NOTE)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v in (None, False):
            return v
        raise PydanticCustomError("unsupported", "'echo' is not supported on /v1/chat/completions (got {got})",
                                  {"got": show(v, 60)})

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _integral(cls, v):
        return cls._integral_float(v)

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, msgs):
        if not isinstance(msgs, list) or not msgs:
            raise PydanticCustomError("invalid_type" if not isinstance(msgs, list) else "invalid_value",
                                      "'messages' must be a non-empty array of {role, content} objects")
        return msgs


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


# ----------------------------------------------------------------------------- pydantic error -> 400
def _path(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (("." if out else "") + str(part))
    return out


def _range_of(model: type[BaseModel], name: str) -> str:
    """'[lo, hi]' / '(lo, hi]' from a field's ge/gt/le constraints ('' without any)."""
    info = model.model_fields.get(name)
    lo = hi = None
    open_lo = False
    for m in info.metadata if info is not None else ():
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, open_lo = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
    if lo is None and hi is None:
        return ""
    return f" in {'(' if open_lo else '['}{lo:g}, {hi:g}]" if isinstance(hi, float) or isinstance(lo, float) \
        else f" in {'(' if open_lo else '['}{lo}, {hi}]"


_KIND = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
         "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
         "bool_type": "a boolean", "bool_parsing": "a boolean", "string_type": "a string", "list_type": "an array",
         "model_type": "an object", "model_attributes_type": "an object", "dict_type": "an object"}
_BOUND = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _one(err: dict, model: type[BaseModel]) -> APIError:
    loc, kind, got = err["loc"], err["type"], err.get("input")
    where = _path(loc)
    rng = _range_of(model, where) if len(loc) == 1 else ""
    if kind == "extra_forbidden":
        known = " (known: tag, return_token_ids)" if loc[0] == "specrt" else ""
        return bad(f"unknown field '{where}'{known}", where, "unknown_field")
    if kind == "missing":
        return bad(f"'{where}' is required", where, "missing_field")
    if kind in _KIND:
        number = "a number" if kind == "finite_number" else None
        what = _KIND[kind] if number is None else "a finite number"
        code = "invalid_value" if kind == "finite_number" else "invalid_type"
        return bad(f"'{where}' must be {what}{rng}, got {type_name(got)} {show(got)}", where, code)
    if kind in _BOUND:
        info = model.model_fields.get(where)
        what = "a number" if info is not None and "float" in str(info.annotation) else "an integer"
        return bad(f"'{where}' must be {what}{rng}, got {show(got)}", where)
    if kind == "literal_error":
        return bad(f"'{where}' must be one of {err['ctx']['expected']}, got {show(got)}", where)
    if kind == "value_error":
        return bad(str(err["ctx"]["error"]), where)
    msg = err["msg"]
    if kind in ("unsupported", "invalid_type", "invalid_value"):      # ours (PydanticCustomError)
        field = str(loc[-1])
        if len(loc) > 1 and msg.startswith(f"'{field}"):
            msg = f"'{where}" + msg[len(field) + 1:]
        return bad(msg, where, kind)
    return bad(f"'{where}': {msg}", where)


def api_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    """The first error of a failed validation as a 400 naming the field; unknown fields first."""
    errors = exc.errors(include_url=False)
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    return _one(errors[0], model)
