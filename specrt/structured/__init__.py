"""Structured output: a request's output held to a JSON schema, any JSON object, a regular
expression, a grammar (Lark, or llama.cpp's GBNF / EBNF) or a choice of strings, by token masks
from llguidance (``pip install 'specrt[structured]'``).

    Structured(kind, spec)                  the typed record of SamplingParams.structured, validated
                                            (without a tokenizer) on construction
    GrammarCompiler(tokenizer, V, eos)      one per engine: compiles each (kind, spec) once, at submit
                                            time (bounded LRU); the server compiles on its parse pool
    Grammar                                 a compiled grammar: ``matcher()`` is a request's fresh matcher
    GrammarState                            a request's matcher at its committed output, moved over draft
                                            tokens and back (specrt.sampling.controls holds it)

Exact under speculation: the mask of a row that follows drafts [:o] is the matcher's after those o
drafts, on draft and target rows alike (specrt.sampling.transform.apply_controls), so every verified
position is masked as autoregressive decoding would mask it. EOS is allowed only where the grammar
may end; once it must end, EOS is the only token allowed. A draft token the grammar refuses ends
the masking of that request's later rows: the target refuses that draft (probability 0), so no
row after it is ever read.

Within the token budget: in a request's last tokens (max_tokens, or the context's end) the mask is
narrowed so that the structure still finishes in time (specrt.structured.closing; off with
SamplingParams(structured_close=False)): a function of the row's tokens and limit, so exact too.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from specrt.structured.closing import Closer, CloseTokens

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
EXTRA = "pip install 'specrt[structured]'"       # the extra that installs llguidance
MAX_SPEC_CHARS = 1 << 20                          # a schema, regex or grammar: at most 1 MiB of text
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 4096                           # characters of one choice
GRAMMAR_CACHE_SIZE = 256                          # compiled grammars an engine keeps (LRU)
_VALID_CACHE_SIZE = 1024                          # (kind, spec) pairs known to validate
# JSON schemas: compact JSON with one space after ',' and ':' (a schema's "x-guidance" object
# overrides these: llguidance's JSON options); free whitespace lets a small model loop on blanks
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance():
    """The llguidance module; ImportError naming the extra when it is not installed."""
    try:
        import llguidance as llg
    except ImportError:
        raise ImportError(f"structured output needs the llguidance package: {EXTRA}") from None
    return llg


@dataclass(frozen=True)
class Structured:
    """What a request's output must match. kind: "json_schema" (spec: a JSON schema, dict or JSON
    text), "json_object" (any JSON object; spec ignored), "regex" (spec: the pattern, matched in
    full), "grammar" (spec: a Lark grammar, or GBNF / EBNF as llama.cpp writes it) or "choice"
    (spec: a list of strings, one of which is the output). ValueError naming ``structured`` on a
    bad spec; ImportError naming the extra without llguidance."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured: kind must be one of {KINDS}, got {self.kind!r:.60}")
        object.__setattr__(self, "spec", _normalize(self.kind, self.spec))
        _validate(self.kind, self.spec)

    @classmethod
    def of(cls, value) -> "Structured":
        """SamplingParams.structured's accepted forms: a Structured; a dict (a JSON schema); a list
        or tuple of strings (a choice); "json_object"; a string holding a JSON schema. A regex or
        a grammar is named: Structured("regex", ...), Structured("grammar", ...)."""
        if isinstance(value, Structured):
            return value
        if isinstance(value, dict):
            return cls("json_schema", value)
        if isinstance(value, (list, tuple)):
            return cls("choice", value)
        if isinstance(value, str):
            if value == "json_object":
                return cls("json_object")
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError):
                schema = None
            if isinstance(schema, dict):
                return cls("json_schema", value)
            raise ValueError("structured: a string must be 'json_object' or a JSON schema; name a regex or a "
                             "grammar: Structured('regex', ...), Structured('grammar', ...)")
        raise ValueError(f"structured must be a JSON schema (dict or JSON text), 'json_object', a list of choices "
                         f"or a Structured(kind, spec), got {type(value).__name__}")

    def grammar_text(self) -> str:
        """The llguidance grammar (JSON text) of this record."""
        return _grammar_text(self.kind, self.spec)


def _grammar_text(kind: str, spec) -> str:
    llg = llguidance()
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    try:
        return llg.grammar_from("grammar", spec)     # Lark as is; GBNF / EBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured: invalid grammar: {str(e)[:300]}") from None


def _normalize(kind: str, spec):
    """The canonical spec: JSON text (key order kept: it is the order properties are generated
    in) for a schema, a tuple for a choice; the cache key with the kind."""
    if kind == "json_object":
        return ""
    if kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or len(spec) > MAX_CHOICES or not all(
                isinstance(c, str) and c and len(c) <= MAX_CHOICE_CHARS for c in spec):
            raise ValueError(f"structured: a choice must be a list of 1..{MAX_CHOICES} non-empty strings of at most "
                             f"{MAX_CHOICE_CHARS} characters, got {spec!r:.80}")
        return tuple(spec)
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"structured: the JSON schema is not valid JSON: {str(e)[:120]}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"structured: a JSON schema must be an object, got {type(spec).__name__}")
        try:
            spec = json.dumps(spec, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"structured: the JSON schema cannot be written as JSON: {str(e)[:120]}") from None
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"structured: a {kind} must be a non-empty string, got {spec!r:.60}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"structured: the {kind} is {len(spec)} characters long; at most {MAX_SPEC_CHARS}")
    return spec


_valid: OrderedDict = OrderedDict()
_valid_lock = threading.Lock()


def _validate(kind: str, spec) -> None:
    """ValueError naming ``structured`` if llguidance refuses the grammar (checked once per spec)."""
    key = (kind, spec)
    with _valid_lock:
        if key in _valid:
            _valid.move_to_end(key)
            return
    llg = llguidance()
    with _refusals(kind):
        err = llg.LLMatcher.validate_grammar(_grammar_text(kind, spec), limits=parser_limits())
    if err:
        raise ValueError(f"structured: invalid {kind.replace('_', ' ')}: {_first_line(err)}")
    with _valid_lock:
        _valid[key] = True
        if len(_valid) > _VALID_CACHE_SIZE:
            _valid.popitem(last=False)


class _refusals:
    """Whatever llguidance raises on a hostile spec (a Rust panic arrives as a BaseException)
    becomes the ValueError naming ``structured`` that a bad spec gets."""

    def __init__(self, kind: str):
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, ValueError) or not (
                isinstance(exc, Exception) or type(exc).__name__ == "PanicException"):
            return False
        raise ValueError(f"structured: invalid {self.kind.replace('_', ' ')}: {_first_line(str(exc))}") from None


def _first_line(err: str) -> str:
    """llguidance's (multi-line) error as one line of at most 300 characters."""
    return " ".join(err.split())[:300]


def parser_limits():
    """llguidance's bounds on a grammar's size and on the work of building it and of each mask
    (its defaults: lexer fuel ~20 ms to build a grammar's lexer, ~15 ms per mask at most)."""
    return llguidance().LLParserLimits(verbose_errors=False)


class Grammar:
    """A compiled grammar over one tokenizer; ``matcher()`` gives each request its own matcher."""

    __slots__ = ("structured", "_template", "eos_token_ids", "mask_width", "close_tokens")

    def __init__(self, structured: Structured, template, eos_token_ids: frozenset[int], mask_width: int,
                 close_tokens: CloseTokens | None = None):
        self.structured = structured
        self._template = template
        self.eos_token_ids = eos_token_ids
        self.mask_width = mask_width           # int32 words of a mask row (at least the logits' V bits)
        self.close_tokens = close_tokens       # the closing walk's tokens (specrt.structured.closing); None: no closing

    def matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles Structured records for one tokenizer, each (kind, spec) once (the last
    GRAMMAR_CACHE_SIZE kept). Thread-safe: the server compiles on its parse threads while the step
    thread masks. ``tokenizer``: specrt.models.Tokenizer (its tokenizer.json is what llguidance
    reads); ``vocab_size``: the logits' V; ``eos_token_ids``: every token that ends a request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer = None
        self._close_tokens: CloseTokens | None = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built once: ~0.5 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llg = llguidance()
                tok = self.tokenizer
                n_vocab = max(self.vocab_size, tok.vocab_size)
                try:
                    self._ll_tokenizer = llg.LLTokenizer(tok.tokenizer.to_str(), n_vocab=n_vocab,
                                                         eos_token=sorted(self.eos_token_ids))
                except Exception as e:  # noqa: BLE001 - llguidance raises a bare ValueError/RuntimeError
                    raise ValueError(f"structured: this model's tokenizer is not supported by llguidance: "
                                     f"{str(e)[:200]}") from None
            return self._ll_tokenizer

    def close_tokens(self, width: int) -> CloseTokens:
        """The closing walk's token ids in this tokenizer (built once)."""
        with self._lock:
            if self._close_tokens is None:
                self._close_tokens = CloseTokens.of(self.tokenizer, self.eos_token_ids, width)
            return self._close_tokens

    def compile(self, structured: Structured) -> Grammar:
        key = (structured.kind, structured.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        lltok = self.ll_tokenizer()
        llg = llguidance()
        with _refusals(structured.kind):
            template = llg.LLMatcher(lltok, structured.grammar_text(), log_level=0, limits=parser_limits())
        if template.is_error():
            raise ValueError(f"structured: invalid {structured.kind.replace('_', ' ')}: "
                             f"{_first_line(template.get_error())}")
        width = bitmask_width(lltok.vocab_size)
        grammar = Grammar(structured, template, self.eos_token_ids, width, self.close_tokens(width))
        first = np.zeros((1, grammar.mask_width), np.int32)       # the first mask: builds the lexer here too
        GrammarState(grammar, template).fill(first, 0)
        if not first.any():
            raise ValueError(f"structured: no token of this model's vocabulary can start the "
                             f"{structured.kind.replace('_', ' ')}")
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row's allowed-token bitmask (bit t % 32 of word t // 32 = token t allowed)."""
    return (vocab_size + 31) // 32


class GrammarState:
    """A request's matcher: at its committed output (``committed`` tokens) plus ``ahead``, the draft
    tokens it was last moved over. ``sync`` follows the output (lazily: nothing else has to say
    when tokens are committed, preempted or restored); ``seek`` moves over a row's drafts, reusing
    the drafts it stands on already (a verify's rows come in order, one more token each).
    ``limit``: the most output tokens the request may have; given, ``fill`` steers the output to
    close within it (specrt.structured.closing)."""

    __slots__ = ("grammar", "matcher", "committed", "ahead", "closer")

    def __init__(self, grammar: Grammar, matcher=None, limit: int | None = None):
        self.grammar = grammar
        self.matcher = grammar.matcher() if matcher is None else matcher
        self.committed = 0
        self.ahead: list[int] = []
        ct = grammar.close_tokens
        self.closer = Closer(ct, limit, grammar.mask_width) if limit is not None and ct is not None else None

    def sync(self, output_token_ids: list[int]) -> None:
        """Move to the committed output; the drafts it stood on that were accepted cost nothing."""
        n = len(output_token_ids)
        if n == self.committed:
            return
        if n < self.committed:                  # a restored step: start over (rare)
            self.matcher = self.grammar.matcher()
            self.committed, self.ahead = 0, []
            if self.closer is not None:
                self.closer.reset()
        new = output_token_ids[self.committed:]
        k = _common_prefix(self.ahead, new)
        self._back(len(self.ahead) - k)
        self.committed += k
        self.ahead = []
        if self.closer is not None:
            self.closer.advance(new)
        for t in new[k:]:
            if t in self.grammar.eos_token_ids:   # the request ends here
                self.committed = n
                return
            if self.matcher.try_consume_tokens([t]) != 1:
                raise ValueError(f"structured: output token {t} at position {self.committed} does not continue "
                                 f"the {self.grammar.structured.kind.replace('_', ' ')} (do allowed_token_ids or "
                                 f"bad_words_ids exclude every token the grammar allows there?)")
            self.committed += 1

    def seek(self, drafts: list[int]) -> bool:
        """Stand after the committed output + ``drafts``; False if a draft is EOS or refused by the
        grammar (the matcher then stands before it: no row after it is ever read)."""
        k = _common_prefix(self.ahead, drafts)
        self._back(len(self.ahead) - k)
        del self.ahead[k:]
        for t in drafts[k:]:
            if t in self.grammar.eos_token_ids or self.matcher.try_consume_tokens([t]) != 1:
                return False
            self.ahead.append(t)
        return True

    def forced(self, output_token_ids: list[int], limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar forces right after the committed output (its
        canonical tokenization of the bytes every continuation starts with; empty where the next
        token is a choice or the grammar may end)."""
        self.sync(output_token_ids)
        self.seek([])
        out = []
        for t in self.matcher.compute_ff_tokens()[:limit]:
            if t in self.grammar.eos_token_ids:
                break
            out.append(int(t))
        return out

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """The allowed tokens after the current position into bitmask[row] ([W >= mask_width] int32 rows,
        C-contiguous), narrowed by the budget rule where it applies (specrt.structured.closing)."""
        v = bitmask[row, :self.grammar.mask_width]                  # contiguous: a row's leading words
        self.matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)
        if self.matcher.is_error():
            raise ValueError(f"structured: {_first_line(self.matcher.get_error())}")
        if self.closer is not None:
            self.closer.narrow(self.matcher, self.ahead, self.committed + len(self.ahead), v)

    def _back(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"structured: the grammar matcher could not roll back {n} tokens: "
                               f"{_first_line(self.matcher.get_error())}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    k, n = 0, min(len(a), len(b))
    while k < n and a[k] == b[k]:
        k += 1
    return k


def narrowed_positions(grammar, output_token_ids: list[int], limit: int) -> list[int]:
    """The positions of a finished output whose row the rule narrowed, replayed (the rule is a
    function of the tokens before a row); for reports (bench.structured)."""
    st = GrammarState(grammar, limit=limit)
    row = np.zeros((1, grammar.mask_width), np.int32)
    out = []
    for i, t in enumerate(output_token_ids):
        st.sync(output_token_ids[:i])
        st.seek([])
        before = st.closer.narrowed
        st.fill(row, 0)
        if st.closer.narrowed > before:
            out.append(i)
        if t in grammar.eos_token_ids:
            break
    return out
