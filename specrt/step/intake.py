"""Request intake: what a caller passes (prompt text or token ids, SamplingParams, an id, a
tag) becomes a Request, or a ValueError naming what is wrong. A batch of requests is checked
whole before any is queued, and seeds are drawn only for requests that are queued."""
from __future__ import annotations

import itertools
import operator
import random

from specrt.config import SamplingParams
from specrt.models import check_prompt_length
from specrt.step.scheduler import Request
from specrt.structured import Grammar, GrammarCompiler, Structured

MAX_TENANT_CHARS = 256


def tokenize_prompt(prompt, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """(token ids, text or None) of a prompt given as text or as token ids. ValueError naming the
    problem for anything else: an empty prompt, a token id that is not an integer (100.7, "100",
    True), one outside the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, (bytes, dict, set)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    token_ids = []
    for t in prompt:
        try:
            if isinstance(t, bool):
                raise TypeError
            token_ids.append(operator.index(t))      # int, numpy and torch integers; not floats or strings
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__})") from None
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:8]}")
    return token_ids, None


class RequestIntake:
    def __init__(self, tokenizer, model_config, max_model_len: int, seed: int | None = None):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self._rng = random.Random(seed)       # seeds of unseeded requests
        self._ids = itertools.count()
        # structured output's grammars over this tokenizer; EOS = every token that ends a request
        # (the engine's eos_token_ids: the tokenizer's and the model config's)
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size,
                                        set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids))

    def compile_structured(self, structured: Structured) -> Grammar:
        """The compiled grammar (cached): the server calls this on its parse threads, so that the
        step thread finds it compiled; ValueError naming ``structured`` if it does not compile."""
        return self.grammars.compile(structured)

    def check(self, prompts, params, tags=None, request_ids=None, in_use=(), tenants=None) -> list[Request]:
        """One Request per prompt (seed and id still to assign); ValueError naming the first bad one."""
        n = len(prompts)
        tags, request_ids, tenants = tags or ["default"] * n, request_ids or [None] * n, tenants or [None] * n
        if not len(params) == len(tags) == len(request_ids) == len(tenants) == n:
            raise ValueError(f"got {n} prompts, {len(params)} params, {len(tags)} tags, {len(request_ids)} request ids, "
                             f"{len(tenants)} tenants")
        out = []
        for i, (prompt, p, rid, tag, tenant) in enumerate(zip(prompts, params, request_ids, tags, tenants)):
            try:
                if tenant is not None and (not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS):
                    raise ValueError(f"tenant must be a string of at most {MAX_TENANT_CHARS} characters or None, "
                                     f"got {tenant!r:.40}")
                out.append(self._check_one(prompt, p if p is not None else SamplingParams(), rid, tag, in_use))
                out[-1].tenant = tenant
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if n > 1 else str(e)) from None
        return out

    def assign(self, requests: list[Request]) -> None:
        """Draw the seeds of unseeded requests and name the unnamed ones (as they are queued)."""
        for r in requests:
            r.seed = r.params.seed if r.params.seed is not None else self._rng.getrandbits(63)
            r.request_id = r.request_id if r.request_id is not None else f"req-{next(self._ids)}"

    def calibration_prompts(self, prompts, longest: int) -> list[list[int]]:
        """Token-id prompts of at most ``longest`` tokens (their last ones) for the engine's
        calibration: the given ones (text or ids), or synthetic prompts of up to 32 tokens."""
        out = []
        for p in prompts or ():
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            if ids:
                out.append(ids[-max(longest, 1):])
        if out:
            return out
        V, plen = self.model_config.vocab_size, max(1, min(32, self.max_model_len // 4, longest))
        return [[3 + (b * 131 + j * 17) % max(V - 3, 1) for j in range(plen)] for b in range(64)]

    def _check_one(self, prompt, params, request_id, tag: str, in_use) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check_token_ids(self.model_config.vocab_size)
        token_ids, text = tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        check_prompt_length(self.model_config, len(token_ids), 0, self.max_model_len - 1)
        if len(token_ids) + params.min_tokens > self.max_model_len:   # else it would end unmet at the context's end
            raise ValueError(f"min_tokens ({params.min_tokens}) cannot be met: the prompt has {len(token_ids)} tokens "
                             f"and the context holds {self.max_model_len}")
        if request_id is not None and str(request_id) in in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")
        grammar = self.compile_structured(params.structured) if params.structured is not None else None
        return Request(request_id=None if request_id is None else str(request_id), prompt_token_ids=token_ids,
                       params=params, seed=0, prompt=text, tag=tag, grammar=grammar,
                       max_output=self.max_model_len - len(token_ids))
