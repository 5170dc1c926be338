"""Prompt -> token ids, bounded before any tokenizing and run on the tokenizer pool (never on
the event loop, never on the step thread).

A prompt longer than `max_prompt_chars` characters cannot fit the context and is refused
without being tokenized: tokenizing megabytes takes seconds (defect 2 of issue 14).

Chat messages are rendered with the model's template and the result tokenized with its special
tokens recognized (the template writes "<|im_start|>" etc.). A special-token string inside a
message's content or name is client text, though: with ``escape_special`` (the server's default,
`--allow-special-tokens-in-content` turns it off) it is tokenized as plain text, so a user
cannot close their turn and forge a system one (issue 39). Messages without such strings
tokenize exactly as before.
"""
from __future__ import annotations

import bisect
import json
import re
import secrets
import threading

from specrt.server.errors import APIError, bad


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, releasing the GIL while it runs where the tokenizer allows it:
    the `tokenizers` package holds the GIL for all of `encode`, not for `encode_batch`."""
    inner = getattr(tokenizer, "tokenizer", None)
    encode_batch = getattr(inner, "encode_batch", None)
    if encode_batch is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """The token ids of each text (one batched call where the tokenizer allows it)."""
    inner = getattr(tokenizer, "tokenizer", None)
    encode_batch = getattr(inner, "encode_batch", None)
    if encode_batch is None:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    return [list(e.ids) for e in encode_batch(texts, add_special_tokens=add_special_tokens)]


# an added token that is not marked special but reads as markup (Qwen's "<tool_call>", "[TOOL_CALLS]"):
# a control token all the same; added tokens of ordinary text (runs of spaces, words) are not
_CONTROL = re.compile(r"<[^\s<>]{1,64}>|\[[A-Z][A-Z_]{1,63}\]")


def is_control_token(content: str, special: bool) -> bool:
    """Whether an added token's string is one a client must not be able to forge in its text."""
    return bool(content) and (special or _CONTROL.fullmatch(content) is not None)


class _Specials:
    """A tokenizer's control-token strings and ids (its special added tokens, and the added tokens
    that read as markup, ``is_control_token``), and a copy of it that reads them as plain text."""

    def __init__(self, inner):
        decoder = inner.get_added_tokens_decoder()
        self.ids = {i for i, t in decoder.items() if is_control_token(t.content, t.special)}
        # longest first: where one special string contains another, the longer one is matched
        self.strings = sorted({decoder[i].content for i in self.ids}, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, self.strings))) if self.strings else None
        self._inner = inner
        self._plain = None
        self._lock = threading.Lock()

    def plain(self):
        """The tokenizer with ``encode_special_tokens`` on and the non-special control tokens no longer
        added tokens: every control string becomes ordinary tokens."""
        with self._lock:
            if self._plain is None:
                spec = json.loads(self._inner.to_str())
                spec["added_tokens"] = [t for t in spec.get("added_tokens", [])
                                        if t.get("special") or not is_control_token(t.get("content", ""), False)]
                plain = type(self._inner).from_str(json.dumps(spec))
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain


_SPECIALS: dict[int, tuple[object, _Specials | None]] = {}
_SPECIALS_LOCK = threading.Lock()


def _specials(tokenizer) -> _Specials | None:
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "get_added_tokens_decoder") or not hasattr(inner, "to_str"):
        return None
    with _SPECIALS_LOCK:
        hit = _SPECIALS.get(id(inner))
        if hit is None or hit[0] is not inner:
            hit = (inner, _Specials(inner))
            _SPECIALS[id(inner)] = hit     # the engine's one tokenizer (kept alive with its entry)
        return hit[1]


def _escaped_chat_ids(tokenizer, specials: _Specials, messages: list[dict], max_prompt_chars: int,
                      max_model_len: int) -> list[int]:
    """Render with a private marker in place of each special string in the messages, put the
    strings back, tokenize the whole text (template tokens as before) and replace each special
    token that came from a message by the plain-text tokens of its string."""
    nonce = secrets.token_hex(8)
    found: list[str] = []

    def mark(m: re.Match) -> str:
        found.append(m.group(0))
        return f"\ue000{nonce}:{len(found) - 1}\ue001"

    marked = []
    for m in messages:
        m = dict(m)
        for key in ("content", "name"):
            if isinstance(m.get(key), str):
                m[key] = specials.pattern.sub(mark, m[key])
        marked.append(m)
    text = chat_text(tokenizer, marked, max_prompt_chars, max_model_len)
    parts = re.split(f"\ue000{nonce}:([0-9]+)\ue001", text)
    pieces, starts, ends, pos = [], [], [], 0
    for k, part in enumerate(parts):
        if k % 2:
            part = found[int(part)]
            starts.append(pos)
            ends.append(pos + len(part))
        pieces.append(part)
        pos += len(part)
    full = "".join(pieces)
    enc = tokenizer.tokenizer.encode_batch([full], add_special_tokens=False)[0]
    plain = specials.plain()
    ids: list[int] = []
    for i, (start, end) in zip(enc.ids, enc.offsets):
        k = bisect.bisect_left(starts, end) - 1          # the last escaped span starting before `end`
        if i in specials.ids and k >= 0 and ends[k] > start:
            # (an added token that strips spaces may cover a little more than the string)
            ids += plain.encode_batch([full[start:end]], add_special_tokens=False)[0].ids
        else:
            ids.append(i)
    return ids


def too_long(what: str, param: str, message: str) -> APIError:
    return APIError(400, f"{what} {message}", "invalid_request_error", param, "context_length_exceeded")


def _check_chars(n_chars: int, max_prompt_chars: int, max_model_len: int, param: str) -> None:
    if n_chars > max_prompt_chars:
        subject = "the prompt has" if param == "prompt" else "the messages hold"
        raise too_long(subject, param, f"{n_chars} characters, more than the {max_prompt_chars} this server "
                       f"accepts for the model's context of {max_model_len} tokens")


def _check_tokens(ids: list[int], max_model_len: int, param: str) -> list[int]:
    if not ids:
        raise bad("the prompt is empty: at least one token is required", param)
    if len(ids) > max_model_len - 1:
        raise too_long("the prompt", param, f"has {len(ids)} tokens; the model's context of {max_model_len} tokens "
                       f"holds at most {max_model_len - 1} prompt tokens")
    return ids


def chat_text(tokenizer, messages: list[dict], max_prompt_chars: int, max_model_len: int) -> str:
    """Render chat messages with the model's chat template (bounded in size before and after)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template, so it cannot take chat messages; send the text as "
                       "a plain prompt to /v1/completions", "invalid_request_error", None, "no_chat_template")
    chars = sum(len(m["content"]) + len(m.get("name", "")) for m in messages)
    _check_chars(chars, max_prompt_chars, max_model_len, "messages")
    if len(messages) > max_model_len:
        raise too_long("the messages", "messages", f"are {len(messages)}, more than the model's context of "
                       f"{max_model_len} tokens can hold")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:     # template errors (raise_exception, undefined) are the request's fault
        raise bad(f"the chat template could not render these messages: {e}", "messages") from None
    _check_chars(len(text), max_prompt_chars, max_model_len, "messages")
    return text


def _has_special(specials: _Specials | None, messages: list[dict]) -> bool:
    if specials is None or specials.pattern is None:
        return False
    texts = [v for m in messages for v in (m.get("content"), m.get("name")) if isinstance(v, str)]
    return any(s in t for t in texts for s in specials.strings)


def prompt_token_ids(prompt, chat: bool, tokenizer, max_model_len: int, max_prompt_chars: int,
                     escape_special: bool = True) -> list[int]:
    """Token ids of a parsed prompt: a string, token ids, or chat messages (list of dicts).
    ``escape_special``: special-token strings in the messages are tokenized as plain text (a
    completions prompt is the client's whole text, and is tokenized as given)."""
    if chat:
        specials = _specials(tokenizer) if escape_special else None
        if _has_special(specials, prompt):
            return _check_tokens(_escaped_chat_ids(tokenizer, specials, prompt, max_prompt_chars, max_model_len),
                                 max_model_len, "messages")
        text = chat_text(tokenizer, prompt, max_prompt_chars, max_model_len)
        # like HF apply_chat_template(tokenize=True): the template writes its own special tokens
        return _check_tokens(encode_text(tokenizer, text, False), max_model_len, "messages")
    if isinstance(prompt, str):
        _check_chars(len(prompt), max_prompt_chars, max_model_len, "prompt")
        return _check_tokens(encode_text(tokenizer, prompt), max_model_len, "prompt")
    return _check_tokens(list(prompt), max_model_len, "prompt")
