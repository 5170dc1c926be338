"""Budget-aware closing of structured output (issue 36): a request whose token budget is about to
become too small to finish its structure is steered to finish it, so that it ends with EOS
("stop") and a complete, valid output instead of being cut at max_tokens ("length").

    CloseTokens.of(tokenizer, eos, width)   per tokenizer: the token ids the closing walk tries
    close_walk(matcher, tokens, max_len)    a short completion from a matcher's state (a pure function
                                            of the state: the same walk wherever it is asked for)
    Closer                                  per request (in its GrammarState): the budget rule, walks
                                            memoized along the request's output and drafts
    (specrt.structured.narrowed_positions replays a finished output to find the rows it narrowed)

The closing walk: from the matcher's state, one step at a time until the grammar accepts: the
tokens the grammar forces, else the first allowed closer of a fixed list ('""', then closing
quotes and brackets, longest first), else (inside a lexeme: a patterned string, a bounded
number) ',', a minimal value ('0', '{}', 'null', 'false', ...) or a one-character token chosen
by a fixed look-ahead rule, else the allowed token of lowest id; at most ``max_len`` tokens (None
beyond, or when stuck). Its length L is the cost to close: an upper bound of the shortest close.

The rule at a row whose output token would be number p (0-based) of at most ``limit`` tokens
(max_tokens, or the context's end if sooner), n = limit - p tokens left, EOS included; only where
n <= HORIZON (every other row pays nothing); slack = n - 1 - L:
    no walk within n - 1        unchanged: the structure cannot finish in time (it ends "length")
    slack < MARGIN  (window)    only the walk's first token, EOS where the grammar may end, and the
                                checked tokens after which the walk still fits: slack stays >= 0,
                                so the output closes in time
    slack < MARGIN + GUARD      (band) the checked tokens after which the walk would no longer fit
                                are removed (a ', {' that opens an item too long to finish)
    otherwise                   unchanged
The checked tokens: every token the grammar allows at the row where it allows at most CHECK_ALL
(a regex, a choice, an enum), else the candidates it allows (the walk's list and JSON's usual
separators; inside a string, where the walk starts by closing it, those with a '"': the other
tokens stay in the string). A window inside a free string thus allows only ways to end it.

The rule is a deterministic function of (the tokens before the row, limit): draft rows, target
rows and autoregressive rows get the same mask, so greedy speculative output stays token-identical
to autoregressive output and sampling stays exact (the mask is part of the transform both sample
from). Every kind of structure takes it: where the walk finds no close (a close longer than
HORIZON - 1 tokens, a grammar it gets stuck in) the mask is the grammar's alone. What it costs:
nothing before the last HORIZON tokens; there, a walk per row (memoized along the walk, ~0.1-3
ms on SmolLM2's tokenizer), and a walk per checked token in a band or window. An output that
would have finished on its own within ~L + MARGIN + GUARD tokens of its limit may be changed
(L over-estimates; it stays valid).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

HORIZON = 64         # the rule looks only at rows with at most this many tokens left
MARGIN = 4           # window: slack below this, only tokens that keep the close within budget
GUARD = 12           # band above the window: checked tokens that break the budget are removed
CHECK_ALL = 32       # a row allowing at most this many tokens has each checked (else the candidates)
_MEMO_CAP = 1024     # walks a request keeps (cleared beyond)

# the walk's priority list (kept where the string is one token): an empty string first (a value
# where a string is due; never allowed inside a string), then closers (longest first: fewer
# tokens), the separator, then minimal values; inside a string the closers win over content
PRIORITY = ('""', '"}]}', '"}]', '"}}', '"]}', '"}', '"]', '"', '}]}', '}]', '}}', ']}', '}', ']', ',',
            '0', '[]', '{}', 'null', 'false', 'true', '1')
# what a model may choose in the window besides the walk's token: JSON's usual separators too
SEPARATORS = ('",', '"},', '"],', '},', '],', ', "', ' "', '", "', '{"', '[{', '[{"', '[', '{', '":', '": "',
              ':', ', {', '}, {', ' {', ' [', '["', ' ')
# one-character tokens tried inside a lexeme (a patterned string, a bounded number), in order:
# first one of each class a pattern uses, then the rest of the classes
CHARS = ("a0A.@-_/:+ ", "bcdefghijklmnopqrstuvwxyz123456789BCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass(frozen=True)
class CloseTokens:
    """One tokenizer's token ids for the closing walk and the window (each a single token)."""

    direct: tuple[int, ...]         # PRIORITY's closers and '""': taken as soon as allowed (they never loop)
    tiers: tuple[np.ndarray, ...]   # [P] int64 each: the rest of PRIORITY and CHARS[0], then CHARS[1]:
                                    # taken after a look ahead, a tier at a time
    enders: tuple[int, ...]         # tokens that end a lexeme (closers and ',')
    candidates: np.ndarray          # [K] int64: the tokens a window checks (sorted)
    openers: np.ndarray             # [J] int64: the candidates a band checks: those that may open more
    quoted: tuple[np.ndarray, np.ndarray]   # candidates and openers with a '"': the only ones that can
                                            # leave a string (inside one, the others are its text)
    string_closers: frozenset[int]  # the walk's closers that end a string ('"', '"}', ...)
    eos: frozenset[int]

    @staticmethod
    def of(tokenizer, eos_token_ids, width: int) -> "CloseTokens":
        """``width``: the mask's int32 words (ids beyond its bits are left out)."""
        def one(s: str) -> int | None:
            try:
                ids = tokenizer.encode(s, add_special_tokens=False)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: not a candidate
                return None
            return int(ids[0]) if len(ids) == 1 and 0 <= ids[0] < 32 * width else None

        def ids(strings) -> list[int]:
            out = []
            for s in strings:
                t = one(s)
                if t is not None and t not in out:
                    out.append(t)
            return out

        arr = lambda x: np.asarray(sorted(x) if isinstance(x, set) else x, np.int64)   # noqa: E731
        direct = ids(s for s in PRIORITY if s[0] in '"}]')
        first = [t for t in ids(PRIORITY[PRIORITY.index(","):] + tuple(CHARS[0])) if t not in direct]
        tiers = (arr(first), arr([t for t in ids(CHARS[1]) if t not in first and t not in direct]))
        both = PRIORITY + SEPARATORS
        opens = [s for s in both if any(c in s for c in ",[{")]
        quoted = (arr(set(ids(s for s in both if '"' in s))), arr(set(ids(s for s in opens if '"' in s))))
        return CloseTokens(tuple(direct), tiers, tuple(ids(s for s in PRIORITY if s[0] in '"}],' and s != '""')),
                           arr(set(ids(both))), arr(set(ids(opens))), quoted,
                           frozenset(ids(s for s in PRIORITY if s[0] == '"' and s != '""')),
                           frozenset(int(t) for t in eos_token_ids))


def _bits(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[len(ids)] bool: token ids allowed in a mask row of int32 words."""
    return ((words[ids >> 5] >> (ids & 31)) & 1).astype(bool)


def _mask(matcher, scratch: np.ndarray) -> np.ndarray:
    matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    return scratch


def _step(matcher, ct: CloseTokens, scratch: np.ndarray) -> list[int] | None:
    """The walk's next tokens from the matcher's (not accepting) state; None: stuck. The forced
    tokens, else the first allowed closer, else (inside a lexeme: a patterned string, a bounded
    number) of a tier's allowed tokens (',', minimal values, one character of each class; then
    the other characters) the first after which the grammar accepts or a lexeme may end, else
    the first that moves on (changes which of them may follow: '@' in an e-mail's name, where
    'a' or 'null' would loop), else the first allowed; else the allowed token of lowest id."""
    ff = matcher.compute_ff_tokens()
    for i, t in enumerate(ff):
        if t in ct.eos:
            ff = ff[:i]
            break
    if ff:
        return [int(t) for t in ff]
    for t in ct.direct:
        if matcher.validate_tokens([t]) == 1:
            return [t]
    m = _mask(matcher, scratch)
    first = None
    for tier in ct.tiers:
        here = _bits(m, tier)
        allowed = tier[here].tolist()
        moves = None
        for t in allowed:
            if matcher.try_consume_tokens([t]) != 1:
                continue
            ends = matcher.is_accepting() or any(matcher.validate_tokens([e]) == 1 for e in ct.enders)
            if moves is None and not ends and not np.array_equal(_bits(_mask(matcher, scratch), tier), here):
                moves = t
            matcher.rollback(1)
            if ends:
                return [t]
        if moves is not None:
            return [moves]
        if first is None and allowed:
            first = allowed[0]
        m = _mask(matcher, scratch)
    if first is not None:
        return [first]
    for w in np.flatnonzero(m):           # the allowed token of lowest id (EOS aside)
        word = int(m[w]) & 0xFFFFFFFF
        while word:
            b = (word & -word).bit_length() - 1
            t = int(w) * 32 + b
            if t not in ct.eos:
                return [t]
            word &= word - 1
    return None


class Walk(NamedTuple):
    """A closing walk: its tokens, and where its steps start (a tail from a step's start is the
    walk from the state there; not from inside a step of several forced tokens)."""

    tokens: tuple[int, ...]
    steps: tuple[int, ...]


def close_walk(matcher, ct: CloseTokens, max_len: int, scratch: np.ndarray) -> Walk | None:
    """The closing walk from the matcher's state (left as it was): the tokens to an accepting state
    (none if it accepts already), or None if it takes more than ``max_len`` tokens or gets stuck.
    ``scratch``: a [W] int32 buffer of the mask's width."""
    out: list[int] = []
    steps: list[int] = []
    try:
        while not matcher.is_accepting():
            if len(out) >= max_len or matcher.is_error():
                return None
            ts = _step(matcher, ct, scratch)
            if ts is None:
                return None
            k = matcher.try_consume_tokens(ts)
            steps.append(len(out))
            out += ts[:k]
            if k != len(ts):
                return None
        return Walk(tuple(out), tuple(steps)) if len(out) <= max_len else None
    finally:
        if out:
            matcher.rollback(len(out))


class Closer:
    """The budget rule of one request (module docstring). Walks are memoized by the drafts after the
    committed output they start from (``advance`` re-keys them as the output grows): a walk's
    tail is the walk from the state after its first token, so a row that follows it costs a
    look-up. A memoized answer equals a fresh one: no mask depends on what was asked before."""

    __slots__ = ("tokens", "limit", "memo", "scratch", "narrowed")

    def __init__(self, tokens: CloseTokens, limit: int, width: int):
        self.tokens = tokens
        self.limit = limit                    # the most output tokens the request may have
        # drafts after the committed output -> (the walk's tokens, or None: none within max_len; max_len)
        self.memo: dict[tuple[int, ...], tuple[tuple[int, ...] | None, int]] = {}
        self.scratch = np.zeros(width, np.int32)
        self.narrowed = 0                     # rows narrowed (any: draft, verify, rejected)

    def advance(self, tokens: list[int]) -> None:
        """``tokens`` were appended to the committed output."""
        k, head = len(tokens), tuple(tokens)
        if k:
            self.memo = {a[k:]: v for a, v in self.memo.items() if len(a) >= k and a[:k] == head}

    def reset(self) -> None:
        self.memo = {}

    def walk(self, matcher, key: tuple[int, ...], max_len: int) -> tuple[int, ...] | None:
        """The walk (at most ``max_len`` tokens, else None) from the matcher, standing after the
        committed output + ``key``."""
        hit = self.memo.get(key)
        if hit is not None:
            w, c = hit
            if w is not None:
                return w if len(w) <= max_len else None
            if c >= max_len:
                return None
        walk = close_walk(matcher, self.tokens, max_len, self.scratch)
        if len(self.memo) > _MEMO_CAP:
            self.memo = {}
        w = None if walk is None else walk.tokens
        self.memo[key] = (w, max_len)
        if walk is not None:                   # its tails: the walks from its later steps' states
            for i in walk.steps[1:] + (len(w),):
                self.memo.setdefault(key + w[:i], (w[i:], max_len))
        return w

    def narrow(self, matcher, ahead: list[int], position: int, words: np.ndarray) -> bool:
        """Apply the rule to ``words`` (the row's grammar mask, int32, in place) for the row after
        ``ahead`` whose output token is number ``position``; True if it changed the row."""
        n = self.limit - position
        if n > HORIZON:
            return False
        key = tuple(ahead)
        w = self.walk(matcher, key, n - 1)           # the close and its EOS must fit in n
        if w is None:
            return False
        slack = n - 1 - len(w)
        if slack >= MARGIN + GUARD:
            return False
        ct, window = self.tokens, slack < MARGIN
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        # the tokens checked: all the grammar allows where they are few, else the candidates; inside
        # a string (the walk closes it first) only those with a '"': the others stay in the string
        if allowed.size <= CHECK_ALL:
            checked = allowed
        else:
            pools = ct.quoted if w and w[0] in ct.string_closers else (ct.candidates, ct.openers)
            pool = pools[0] if window else pools[1]
            checked = pool[_bits(words, pool)]
        keep, drop = [], []
        for t in checked.tolist():
            if (w and t == w[0]) or t in ct.eos:     # on the walk, or the end (allowed where it may end)
                keep.append(t)
                continue
            if matcher.try_consume_tokens([t]) != 1:
                continue
            after = self.walk(matcher, key + (t,), n - 2)
            matcher.rollback(1)
            (keep if after is not None else drop).append(t)
        old = words.copy()
        if not window:                          # band: remove the checked tokens that break the budget
            d = np.asarray(drop, np.int64)
            np.bitwise_and.at(words, d >> 5, ~(np.int32(1) << (d & 31).astype(np.int32)))
        else:                                   # window: the walk's token, EOS and the safe checked ones
            if w:
                keep.append(w[0])
            else:                               # it accepts: EOS may end it here
                keep += [int(e) for e in allowed if int(e) in ct.eos]
            k = np.asarray(sorted(set(keep)), np.int64)
            words[:] = 0
            np.bitwise_or.at(words, k >> 5, (np.int32(1) << (k & 31).astype(np.int32)))
            words &= old                        # never a token the grammar refuses
        if not words.any():                     # (cannot happen: the walk's token is allowed)
            words[:] = old
        if np.array_equal(words, old):
            return False
        self.narrowed += 1
        return True

