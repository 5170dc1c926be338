"""User-facing configuration: SamplingParams (per request) and SpecConfig (per engine).

Both validate every field on construction and raise ValueError naming the field, so a bad
value is refused where it is given, before it reaches the scheduler or a kernel. The ranges
fit the kernels' types: top_k and token counts are int32 on the device, seeds int64.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from specrt.ops import is_greedy

POLICIES = ("fixed", "confidence", "head", "budget")
ADMISSIONS = ("fifo", "acceptance")
ACCEPTANCE_METHODS = ("rejection", "coupled")
TREES = ("auto", "dynamic", "fixed", "chain")
MAX_TREE_NODES = 63            # the attention kernel's ancestor mask covers 64 keys
DEFAULT_TREE_NODES = 12
DEFAULT_PREFILL_CHUNK = 512   # prompt tokens per step: the pause it puts in the other streams stays short
MAX_PREFILL_CHUNK = 1 << 20
DEFAULT_TREE_BRANCHING = 4
logger = logging.getLogger("specrt.config")
INT32_MAX = 2 ** 31 - 1
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
TEMPERATURE_MAX = 100.0         # far past uniform for any real logits; larger values are typos
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024           # per stop string (the server holds back this many characters)
MAX_DRAFT_LENGTH = 64
MAX_BATCH_SIZE = 65536
MAX_BLOCK_SIZE = 1024
MAX_ACCEPTANCE_WINDOW = 65536
PENALTY_RANGE = 2.0                         # presence / frequency penalties lie in [-2, 2] (OpenAI)
REPETITION_PENALTY_RANGE = (0.01, 100.0)    # outside it a logit is all but erased or frozen: typos
LOGIT_BIAS_RANGE = 100.0                    # OpenAI: a bias lies in [-100, 100]
MAX_LOGPROBS = 20                           # top log-probabilities per token (OpenAI chat's top_logprobs)
MAX_TOKEN_LIST = 1 << 20                    # entries of logit_bias / allowed_token_ids / bad_words_ids
MAX_BAD_WORD_TOKENS = 64                    # tokens of one banned sequence

DEFAULT_KV_CACHE_BUDGET = 0.5               # SpecConfig.kv_cache_budget: half the free device memory
_MEMORY_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3,
                 "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3,
                 "tib": 1024 ** 4}


def parse_memory_size(text: str, name: str = "memory") -> float | int:
    """'2GiB', '512MB', '1000000' -> bytes (int); '0.5' (a number in (0, 1] with a point) -> that
    fraction of free device memory (float). The values of ``specrt serve --kv-cache-memory`` and
    of ``SpecConfig(kv_cache_memory=...)``; ValueError naming ``name`` otherwise."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"{name} must be bytes ('2GiB', '512MB', '1000000') or a fraction in (0, 1] of free "
                         f"memory ('0.5'), got {text!r:.40}")
    value = float(m.group(1))
    if not unit and value <= 1.0 and "." in m.group(1):
        if value <= 0.0:
            raise ValueError(f"{name}: a fraction must be in (0, 1], got {text!r:.40}")
        return value
    n = int(value * _MEMORY_UNITS[unit])
    if n < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {text!r:.40}")
    return n


# SpecConfig's defaults per policy (docs/policy.md, "Defaults"): the design's starting values (min 1,
# max 8, threshold 0.6, window 100) where they do not slow the policy down; fixed K=4 and budget
# max 4 / min 0 (K=8 measured slower for both; the budget policy must be able to switch off).
DEFAULT_ACCEPTANCE_WINDOW = 100
DEFAULTS = {
    "fixed": {"min_draft_length": 0, "max_draft_length": 4},
    "confidence": {"min_draft_length": 1, "max_draft_length": 8, "confidence_threshold": 0.6},
    "head": {"min_draft_length": 1, "max_draft_length": 8, "confidence_threshold": 0.6},
    "budget": {"min_draft_length": 0, "max_draft_length": 4},
}


def clamp_k(k: int, *limits: int) -> int:
    """Draft length k within [0, every limit]: the one place a draft length is clamped."""
    return max(0, min((k, *limits)))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(name: str, value, lo: int, hi: int, note: str = "") -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]{note}, got {value!r:.60}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r:.60}")


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 is greedy (top_k/top_p/min_p then do nothing), and so is
    any temperature below ``ops.TEMPERATURE_EPS`` (1e-5): ``ops.is_greedy``, the kernels' rule.

    top_k 0 (or -1) disables top-k; a top_k at or above the vocabulary size keeps every token,
    the same as 0 (the kernels' contract), so any value up to 2**31 - 1 is accepted. top_p 1.0
    disables top-p. min_p (0 = off) keeps the tokens whose probability is at least min_p times
    the largest. seed None draws a seed once at admission; a fixed seed makes the output
    reproducible (token-identical to autoregressive sampling under ``acceptance="coupled"``).

    Logit controls (specrt.sampling.controls; every position a step verifies or drafts sees the tokens
    before it, drafts included, exactly as an autoregressive step would):
    repetition_penalty (HF / vLLM, 1 = off) divides the positive logits and multiplies the
    negative ones of every token in the prompt or the output so far; presence_penalty and
    frequency_penalty (OpenAI, in [-2, 2], 0 = off) subtract ``presence + count * frequency``
    from the logit of every token generated ``count > 0`` times (the prompt does not count);
    logit_bias {token id: bias in [-100, 100]} is added first; allowed_token_ids keeps only
    those tokens; bad_words_ids bans sequences (transformers' ``bad_words_ids``: a one-token
    sequence is never emitted, a longer one never completed after its other tokens).
    logprobs: None, or return the log-probability of every generated token and the ``logprobs``
    most likely alternatives (0..20); prompt_logprobs: the same for the prompt's tokens (the
    model's own log-softmax there). See specrt.sampling.controls for the exact definitions.

    structured: the output must match a JSON schema (a dict or JSON text), "json_object", a
    choice (a list of strings), or a specrt.structured.Structured(kind, spec) (kinds
    "json_schema", "json_object", "regex", "grammar" (Lark / GBNF), "choice"); every drafted and
    verified position is masked (specrt.structured). The request ends where the grammar does
    (EOS is allowed only there), so it cannot be combined with ignore_eos or min_tokens.
    structured_close (default True): near the token budget the mask narrows to tokens that still
    finish the structure in time (specrt.structured.closing); False: the grammar's mask alone.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] | str | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: object = None          # specrt.structured.Structured (any form Structured.of takes); None: free text
    structured_close: bool = True      # structured output: steer it to finish within the token budget

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not 0 <= t <= TEMPERATURE_MAX:
            raise ValueError(f"temperature must be a finite number in [0, {TEMPERATURE_MAX:g}] (0 = greedy), "
                             f"got {t!r:.60}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r:.60}")
        _check_int("top_k", self.top_k, -1, INT32_MAX, " (0 or -1 disables it)")
        if self.top_k == -1:
            self.top_k = 0
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)")
        _check_bool("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX, " (a 64-bit integer, or None)")
        self.stop = self._check_stop(self.stop)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self._check_controls()

    def _check_controls(self) -> None:
        self.min_p = _real_in("min_p", self.min_p, 0.0, 1.0, " (0 disables it)")
        lo, hi = REPETITION_PENALTY_RANGE
        self.repetition_penalty = _real_in("repetition_penalty", self.repetition_penalty, lo, hi, " (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _real_in(name, getattr(self, name), -PENALTY_RANGE, PENALTY_RANGE, " (0 disables it)"))
        self.logit_bias = _check_logit_bias(self.logit_bias)
        self.allowed_token_ids = _check_allowed(self.allowed_token_ids)
        self.bad_words_ids = _check_bad_words(self.bad_words_ids)
        if self.allowed_token_ids is not None and self.bad_words_ids:
            banned = {w[0] for w in self.bad_words_ids if len(w) == 1}
            if banned.issuperset(self.allowed_token_ids):
                raise ValueError("bad_words_ids bans every token of allowed_token_ids: no token could be emitted")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, " (or None: no log-probabilities)")
        _check_bool("structured_close", self.structured_close)
        if self.structured is not None:
            from specrt.structured import Structured

            self.structured = Structured.of(self.structured)
            if self.ignore_eos or self.min_tokens:
                raise ValueError("structured output ends where its grammar does: it cannot be combined with "
                                 f"{'ignore_eos=True' if self.ignore_eos else 'min_tokens > 0'}")

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the field if a token id of a control lies outside the vocabulary."""
        lists = (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                 ("bad_words_ids", [max(w) for w in self.bad_words_ids or ()]))
        for name, ids in lists:
            top = max(ids, default=-1)
            if top >= vocab_size:
                raise ValueError(f"{name}: token id {top} is out of range for the vocabulary of {vocab_size} tokens")

    @property
    def has_penalties(self) -> bool:
        """A penalty or bias that the apply_penalties op applies."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def has_logit_controls(self) -> bool:
        """Anything that changes the logits before the sampling transform (min_tokens aside)."""
        return (self.has_penalties or self.allowed_token_ids is not None or bool(self.bad_words_ids)
                or self.structured is not None)

    @staticmethod
    def _check_stop(stop) -> list[str]:
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            return []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r:.80}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return stop

    @property
    def greedy(self) -> bool:
        """True when ``temperature`` is greedy (``ops.is_greedy``: 0 or below 1e-5): argmax decoding,
        no randomness drawn."""
        return is_greedy(self.temperature)


def _real_in(name: str, value, lo: float, hi: float, note: str = "") -> float:
    if not _is_real(value) or not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a finite number in [{lo:g}, {hi:g}]{note}, got {value!r:.60}")
    return float(value)


def _token_id(name: str, t) -> int:
    if not _is_int(t) or not 0 <= t <= INT32_MAX:
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {t!r:.60}")
    return t


def _check_logit_bias(bias) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
    if len(bias) > MAX_TOKEN_LIST:
        raise ValueError(f"logit_bias may hold at most {MAX_TOKEN_LIST} tokens, got {len(bias)}")
    return {_token_id("logit_bias", t): _real_in(f"logit_bias[{t}]", b, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
            for t, b in bias.items()}


def _check_allowed(ids) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (or None), got {ids!r:.60}")
    if len(ids) > MAX_TOKEN_LIST:
        raise ValueError(f"allowed_token_ids may hold at most {MAX_TOKEN_LIST} tokens, got {len(ids)}")
    return sorted({_token_id("allowed_token_ids", t) for t in ids})


def _check_bad_words(words) -> list[list[int]]:
    if words is None:
        return []
    if not isinstance(words, (list, tuple)) or len(words) > MAX_TOKEN_LIST:
        raise ValueError(f"bad_words_ids must be a list of at most {MAX_TOKEN_LIST} token-id sequences, "
                         f"got {words!r:.60}")
    out = []
    for w in words:
        if not isinstance(w, (list, tuple)) or not 1 <= len(w) <= MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words_ids must hold non-empty lists of at most {MAX_BAD_WORD_TOKENS} token ids, "
                             f"got {w!r:.60}")
        out.append([_token_id("bad_words_ids", t) for t in w])
    return out


@dataclass
class SpecConfig:
    """Speculative decoding settings of one engine.

    policy: "fixed" (K = max_draft_length every step), "confidence" (stop drafting when the
    draft's probability of its own token falls below a threshold), "head" (a learned acceptance
    head estimates P(accept); stop when P(all drafted so far accepted) < the threshold), "budget"
    (batch-wide allocation of draft tokens by expected accepted tokens per unit of measured
    cost). "auto" (the default) chooses from ``adaptive_enabled``: "confidence" when it is True,
    else "fixed". So the design's config

        SpecConfig(min_draft_length=1, max_draft_length=8, confidence_threshold=0.6,
                   acceptance_window=100, adaptive_enabled=True)

    runs the confidence policy with that threshold, adapted per request over its last 100
    drafted positions.

    adaptive_enabled: True adapts the confidence / head policies' threshold to each request's
    recent acceptance (over ``acceptance_window`` drafted positions); False keeps it fixed; None
    (not said): True for those policies. True with policy="fixed" is refused (a fixed K cannot
    adapt); the budget policy always adapts (False is refused for it).

    A field set to a value that cannot apply to the chosen policy (a threshold or a window for
    "fixed", a threshold for "budget", a window for a non-adaptive threshold, min_draft_length
    > 0 for "fixed") is logged as a warning once at construction. Fields left at None that do
    not apply stay None; those that apply get the defaults below (DEFAULTS, docs/policy.md).

    acceptance: "rejection" (optimal acceptance rate) or "coupled" (output token-identical to
    autoregressive sampling with the same seed). overlap: pre-draft the next round while the
    target verifies (every policy; model and self:N drafters). admission: "fifo", or
    "acceptance" (when more requests wait than fit, admit those whose predicted acceptance is
    closest to the running batch's; none waits more than ``admission_max_wait`` steps past its
    turn). draft_kv_window: 0 (the draft attends to the whole context) or W > 0: the draft
    attends only to its first ``draft_kv_sinks`` tokens plus the last W (StreamingLLM-style,
    whole KV blocks), so its cost stops growing with the context; the target always verifies
    over the full context, so the output is exact (only acceptance can drop).
    kv_cache_memory: the KV cache's size, under the name of the server's ``--kv-cache-memory``
    flag and taking the same values: a fraction in (0, 1] of free device memory (``0.5``,
    ``"0.5"``) or bytes (``2 ** 31``, ``"2GiB"``, ``"512MB"``). ``kv_cache_budget`` is the same
    setting under its older name, still accepted, and the field the resolved value is read from
    (default 0.5); naming both with different values is an error.
    max_model_len: None (the models' own context) or a cap of at least 2 tokens (one prompt
    token and one generated token).

    tree: "dynamic" drafts a token tree per request (EAGLE-2: the draft's ``tree_branching`` best
    children of the best nodes of each depth, ``max_draft_length`` deep) and verifies every node
    in one target forward; each step keeps as many of the best nodes (up to ``max_tree_nodes``)
    as the measured verify cost per row repays, and drafting switches itself off while it is
    slower than plain decoding (specrt.policy.tree). "fixed": always ``max_tree_nodes`` nodes,
    never off. "chain": ``max_draft_length`` tokens in a line. "auto" (default): "dynamic" where
    the drafter grows trees (a draft model, a feature draft, self:N), the policy is "fixed" and
    overlap is off, else "chain". Steps with logit controls or log-probabilities draft chains.

    prefill_chunk: the most prompt tokens a step feeds (specrt.step.prefill): a longer prompt is fed in
    chunks of this size over several steps while the other requests keep decoding; 0 feeds every
    prompt whole in its first step (a long one then stalls every other stream until it is done).

    lookup: what drafts in front of a draft model (or self:N) where the request's history matches:
    "suffix[:key=value,...]" (the default; earlier requests' outputs included), "ngram[:min[:max]]",
    or None (the model alone). A ``draft="MODEL+..."`` string names its own lookup, which wins.
    Ignored for drafters that are lookups themselves.

    threads (CPU): the kernels' thread count; None takes torch's count when the process set one,
    else the physical cores this process may run on (specrt.step.threads.available_cores).
    adaptive_threads: time steps at half the count now and then and run at the faster (a core
    taken by another process stalls every parallel loop at the full count); False pins it.
    """

    min_draft_length: int | None = None
    max_draft_length: int | None = None
    confidence_threshold: float | None = None
    acceptance_window: int | None = None
    adaptive_enabled: bool | None = None
    policy: str = "auto"
    acceptance: str = "rejection"
    overlap: bool = False
    max_batch_size: int = 32
    block_size: int = 16
    kv_cache_budget: float | int = DEFAULT_KV_CACHE_BUDGET   # fraction of free device memory, or bytes
    max_model_len: int | None = None
    prefix_sharing: bool = True
    admission: str = "fifo"
    admission_max_wait: int = 64
    draft_kv_window: int = 0
    draft_kv_sinks: int = 4
    tree: str = "auto"
    max_tree_nodes: int = DEFAULT_TREE_NODES
    tree_branching: int = DEFAULT_TREE_BRANCHING
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    lookup: str | None = "suffix"
    threads: int | None = None
    adaptive_threads: bool = True
    # the serve flag's name for kv_cache_budget (str or number); None: not given
    kv_cache_memory: float | int | str | None = field(default=None, repr=False, compare=False)
    # max_draft_length was named (else the policy's default, which a drafter may replace: suffix)
    max_draft_length_named: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._resolve_policy()
        d = DEFAULTS[self.policy]
        self.max_draft_length_named = self.max_draft_length is not None
        if self.max_draft_length is None:
            self.max_draft_length = d["max_draft_length"]
        _check_int("max_draft_length", self.max_draft_length, 0, MAX_DRAFT_LENGTH)
        named_min = self.min_draft_length is not None
        if not named_min:
            self.min_draft_length = clamp_k(d["min_draft_length"], self.max_draft_length)
        _check_int("min_draft_length", self.min_draft_length, 0, self.max_draft_length,
                   " (at most max_draft_length)")
        c = self.confidence_threshold
        if c is not None and (not _is_real(c) or not math.isfinite(c) or not 0.0 <= c <= 1.0):
            raise ValueError(f"confidence_threshold must be a number in [0, 1], got {c!r:.60}")
        if self.acceptance_window is not None:
            _check_int("acceptance_window", self.acceptance_window, 1, MAX_ACCEPTANCE_WINDOW)
        self._resolve_applicable(d)
        if self.lookup is not None and (not isinstance(self.lookup, str)
                                        or self.lookup.split(":", 1)[0] not in ("suffix", "ngram")):
            raise ValueError(f"lookup must be 'suffix[:key=value,...]', 'ngram[:min[:max]]' or None, "
                             f"got {self.lookup!r:.60}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or not 1 <= self.threads <= 4096):
            raise ValueError(f"threads must be an integer in [1, 4096] or None, got {self.threads!r:.60}")
        for name in ("overlap", "prefix_sharing", "adaptive_threads"):
            _check_bool(name, getattr(self, name))
        if self.acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_METHODS}, got {self.acceptance!r:.60}")
        _check_int("max_batch_size", self.max_batch_size, 1, MAX_BATCH_SIZE)
        _check_int("prefill_chunk", self.prefill_chunk, 0, MAX_PREFILL_CHUNK, " (0: whole prompts at once)")
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        self._resolve_kv_cache_memory()
        self._check_budget(self.kv_cache_budget)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2, INT32_MAX, " (or None: the models' own context)")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r:.60}")
        _check_int("admission_max_wait", self.admission_max_wait, 0, INT32_MAX)
        _check_int("draft_kv_window", self.draft_kv_window, 0, INT32_MAX, " (0: the whole context)")
        _check_int("draft_kv_sinks", self.draft_kv_sinks, 0, INT32_MAX)
        if self.tree not in TREES:
            raise ValueError(f"tree must be one of {TREES}, got {self.tree!r:.60}")
        _check_int("max_tree_nodes", self.max_tree_nodes, 1, MAX_TREE_NODES)
        _check_int("tree_branching", self.tree_branching, 1, 16)
        if self.tree in ("dynamic", "fixed") and self.policy != "fixed":
            raise ValueError(f"tree={self.tree!r} grows trees of up to max_tree_nodes nodes under policy='fixed', got "
                             f"policy={self.policy!r}: use tree='chain' with that policy")

    def _resolve_policy(self) -> None:
        a = self.adaptive_enabled
        if a is not None:
            _check_bool("adaptive_enabled", a)
        if self.policy == "auto":
            self.policy = "confidence" if a else "fixed"
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be 'auto' or one of {POLICIES}, got {self.policy!r:.60}")
        if a is True and self.policy == "fixed":
            raise ValueError("adaptive_enabled=True needs a dynamic policy, but policy='fixed' drafts "
                             "max_draft_length tokens every step: pass policy='confidence', 'head' or "
                             "'budget', or policy='auto' (adaptive_enabled=True then means 'confidence')")
        if a is False and self.policy == "budget":
            raise ValueError("adaptive_enabled=False cannot apply to policy='budget' (it always adapts K to "
                             "measured acceptance and cost): use policy='fixed' or 'confidence' for a fixed rule")

    def _resolve_applicable(self, d: dict) -> None:
        """Fill the defaults of the fields the policy uses; warn about named fields it ignores."""
        p = self.policy
        uses_threshold = p in ("confidence", "head")
        if self.adaptive_enabled is None:
            self.adaptive_enabled = p != "fixed"
        adaptive = bool(self.adaptive_enabled) or p == "budget"
        ignored = []
        if self.confidence_threshold is None:
            if uses_threshold:
                self.confidence_threshold = d["confidence_threshold"]
        elif not uses_threshold:
            ignored.append(f"confidence_threshold={self.confidence_threshold!r}")
        if self.acceptance_window is None:
            if adaptive:
                self.acceptance_window = DEFAULT_ACCEPTANCE_WINDOW
        elif not adaptive:
            ignored.append(f"acceptance_window={self.acceptance_window!r}")
        if p == "fixed" and self.min_draft_length > 0:
            ignored.append(f"min_draft_length={self.min_draft_length!r}")
        if ignored:
            why = {"fixed": "drafts max_draft_length tokens every step",
                   "budget": "plans K from measured acceptance and cost, with no threshold"}.get(
                p, "uses a fixed threshold (adaptive_enabled=False): no acceptance window")
            logger.warning("SpecConfig: %s ha%s no effect: policy=%r %s", ", ".join(ignored),
                           "ve" if len(ignored) > 1 else "s", p, why)

    def _resolve_kv_cache_memory(self) -> None:
        """kv_cache_memory (the serve flag's name) sets kv_cache_budget (the field the engine reads)."""
        if self.kv_cache_memory is None:
            return
        value = self.kv_cache_memory
        if isinstance(value, str):
            value = parse_memory_size(value, "kv_cache_memory")
        else:
            self._check_budget(value, "kv_cache_memory")
        budget = self.kv_cache_budget
        if budget != DEFAULT_KV_CACHE_BUDGET and budget != value:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r:.40} and kv_cache_budget={budget!r:.40} name "
                             "the same setting (kv_cache_budget is its older name): give one of them")
        self.kv_cache_budget = self.kv_cache_memory = value

    @staticmethod
    def _check_budget(budget, name: str = "kv_cache_budget") -> None:
        if isinstance(budget, float) and math.isfinite(budget) and 0.0 < budget <= 1.0:
            return
        if _is_int(budget) and 1 <= budget <= INT64_MAX:
            return
        raise ValueError(f"{name} must be a fraction in (0, 1] of free memory (float) or a byte count "
                         f"(int >= 1), got {budget!r:.60}")
