"""The ``logprobs`` fields of the responses, in OpenAI's shapes:

- completions: ``{"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
  "text_offset": [int]}`` (a prompt token that starts the text has null log-probabilities;
  ``top_logprobs`` holds the requested alternatives and always the sampled token, so up to
  logprobs + 1 entries; ``text_offset`` counts characters of the token strings from the start of
  the returned text);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}``.

A token's string is its UTF-8 text, or ``"bytes:\\xNN..."`` when its bytes are not valid UTF-8 on
their own (a piece of a multi-byte character). A log-probability of -inf (a token the sampling
transform removed) is reported as -9999.0, OpenAI's floor (JSON has no infinity). What the
numbers are: specrt.sampling.controls.
"""
from __future__ import annotations

import json
import math
import re

from specrt.sampling.controls import TokenLogprob

FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the alphabet of byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_types(tokenizer) -> set[str]:
    inner = getattr(tokenizer, "tokenizer", None)
    try:
        dec = json.loads(inner.to_str()).get("decoder") or {}
    except (AttributeError, ValueError, TypeError):
        return set()
    parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
    return {d.get("type") for d in parts if isinstance(d, dict)}


class TokenStrings:
    """Token id -> its bytes and its string, cached (one per tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self._bytes_of = _byte_decoder() if "ByteLevel" in types else None
        self._sentencepiece = "Metaspace" in types or "ByteFallback" in types
        self._special = set()
        inner = getattr(tokenizer, "tokenizer", None)
        if inner is not None and hasattr(inner, "get_added_tokens_decoder"):
            self._special = {i for i, t in inner.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        if self._bytes_of is not None and all(c in self._bytes_of for c in piece):
            return bytes(self._bytes_of[c] for c in piece)
        if self._sentencepiece:
            m = _BYTE_PIECE.match(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit


def _lp(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def completion_logprobs(strings: TokenStrings, token_ids: list[int], records: list[TokenLogprob | None],
                        offset: int = 0) -> tuple[dict, int]:
    """The completions ``logprobs`` object of these tokens, and the text offset after them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, rec in zip(token_ids, records):
        text = strings.get(t)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if rec is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {strings.get(a)[0]: _lp(v) for a, v in rec.top}
        top.setdefault(text, _lp(rec.logprob))
        out["token_logprobs"].append(_lp(rec.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def _chat_entry(strings: TokenStrings, token_id: int, logprob: float) -> dict:
    text, raw = strings.get(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(raw)}


def chat_logprobs(strings: TokenStrings, records: list[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object of these (generated) tokens."""
    return {"content": [{**_chat_entry(strings, r.token_id, r.logprob),
                         "top_logprobs": [_chat_entry(strings, a, v) for a, v in r.top]} for r in records],
            "refusal": None}


_STRINGS: dict[int, tuple[object, TokenStrings]] = {}


def token_strings(tokenizer) -> TokenStrings:
    """The TokenStrings of a tokenizer (one per tokenizer, kept while the process serves it)."""
    hit = _STRINGS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _STRINGS[id(tokenizer)] = (tokenizer, TokenStrings(tokenizer))
    return hit[1]
