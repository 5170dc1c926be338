"""The speculative engine: one step = admit, plan K, draft, verify K+1 positions, commit.

    scheduler.admit()                 -> batch; policy.plan -> K per request; KV slots reserved
    drafter.propose                   -> DraftProposal: draft_token_ids [B, K], draft_probs [B, K, V] | None
    build_verify_batch; target(...)   -> logits of every request's pending token + drafts
    verify.accept                     -> verify_greedy / rejection_sample on the device
    host:                             ONE device->host copy of (tokens, counts); commit accepted, roll back
                                      the rest (truncate the block table, no copy); stop checks; metrics

State per request: the target's KV holds positions [0, target_cached); the last context token
is "pending" (fed in the next step together with the drafts). A drafter with a KV of its own
holds [0, draft_cached). Preemption frees the blocks and resets both to 0: the request
recomputes its context later (see specrt.scheduler for what that reproduces).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from specrt.config import SamplingParams, SpecConfig
from specrt.drafters import Drafter, DraftProposal, DraftSettings, make_drafter, module_bytes, no_drafts
from specrt.kv_cache import PagedKVCache, kv_cache_blocks
from specrt.loading import (ModelLoader, check_quantize, default_loader, quantized_loader, resolve_engine_dtype,
                            resolve_model_path)
from specrt.attention import KVWindow
from specrt.health import HealthRanges
from specrt.metrics import EngineMetrics, StepSample
from specrt.intake import RequestIntake
from specrt.models import load_generation_config, load_tokenizer
from specrt.policy import CostModel, make_policy
from specrt.scheduler import Request, RequestOutput, RequestStatus, Scheduler
from specrt.verify import VerifyResult, accept, build_verify_batch, commit_logprobs, to_host

logger = logging.getLogger(__name__)
DRAFT_SIZE_LIMIT = 1 / 3     # draft weight bytes / target's above which the engine warns (the design's ~1/3)
HEALTH_CHECK_EVERY_S = 10.0  # how often the step checks the health ranges (the log itself is rate-limited)


class LLMEngine:
    """Continuous-batching speculative engine (thread-compatible: one thread steps).

    ``target_quantize`` / ``draft_quantize`` (None, "int8", "q8_0", "q4_0", "q4_1"): load that model with
    weight-only quantized layers that stay quantized; ``draft_dtype``: the draft model's activation
    dtype (default: the engine's ``dtype``). Greedy output stays token-identical to autoregressive
    decoding of the same target (a quantized target is a different model: compare against itself).

    Hooks (public, for tensor parallelism, benchmarks and tests): ``model_loader(path, role,
    dtype, device)`` loads each model; ``wrap_drafter(drafter) -> drafter`` wraps or adjusts
    the drafter built from ``draft``; ``agree_ks(ks) -> ks`` replaces every step's K (tensor
    parallel: rank 0's, broadcast)."""

    def __init__(self, target: str | Path, draft: str | Path | None = None, spec: SpecConfig | None = None,
                 device: str | torch.device | None = None, dtype=None, seed: int | None = None, *,
                 target_quantize: str | None = None, draft_quantize: str | None = None, draft_dtype=None,
                 model_loader: ModelLoader | None = None, wrap_drafter: Callable[[Drafter], Drafter] | None = None,
                 agree_ks: Callable[[list[int]], list[int]] | None = None, health: HealthRanges | None = None):
        self.spec = spec or SpecConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        load = model_loader or default_loader
        target_path = resolve_model_path(target, "target")
        dtype = resolve_engine_dtype(dtype, self.device, target_path)
        # weight-only quantized models stay quantized (specrt.models.quant); draft_dtype: the draft's activations
        draft_load = quantized_loader(load, check_quantize(draft_quantize, "draft_quantize"), draft_dtype)
        if draft_load is not load and (not isinstance(draft, (str, Path)) or str(draft).startswith(("ngram", "self:"))
                                       or str(draft) == "none"):
            raise ValueError(f"draft_quantize / draft_dtype apply to a draft model, got draft={draft!r}")
        self.target = quantized_loader(load, check_quantize(target_quantize, "target_quantize"))(
            target_path, "target", dtype, self.device)
        self.tokenizer = load_tokenizer(target_path)
        self.generation_config = load_generation_config(target_path)
        self.vocab_size = self.target.config.vocab_size
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.target.config.eos_token_ids))
        window = KVWindow(self.spec.draft_kv_sinks, self.spec.draft_kv_window) if self.spec.draft_kv_window else None
        settings = DraftSettings(self.vocab_size, self.eos_token_ids, self.spec.acceptance == "coupled", self.device,
                                 kv_window=window)
        self.drafter = make_drafter(draft, target_path, self.target, settings, draft_load, dtype,
                                    accept_head=self.spec.policy == "head")
        if self.drafter is not None and wrap_drafter is not None:
            self.drafter = wrap_drafter(self.drafter)
        configs = {"target": self.target.config, **(self.drafter.cache_configs() if self.drafter else {})}
        self.max_model_len = min(c.max_model_len for c in configs.values())
        if self.spec.max_model_len:
            self.max_model_len = min(self.max_model_len, self.spec.max_model_len)
        self._kv_configs, self._kv_dtype = configs, dtype
        self.policy = make_policy(self.spec)
        self.resize_kv_cache(kv_cache_blocks(list(configs.values()), self.spec, dtype, self.device, self.max_model_len))
        self.costs = CostModel()
        info = {"overlap": self._overlap_status(), "draft_size": self._draft_size_guard(),
                "kv_cache_tokens": self.kv_cache_tokens}
        self.metrics = EngineMetrics(health=health, labels={"model": target_path.name, "draft": self.draft_kind},
                                     info=info)
        self._agree_ks = agree_ks
        self.intake = RequestIntake(self.tokenizer, self.target.config, self.max_model_len, seed)
        self._lock = threading.RLock()
        self._finished_pending: list[Request] = []
        self._health_checked = time.monotonic()

    def _overlap_status(self) -> dict:
        """Whether overlap (pre-drafting) runs, and why not when it was asked for and cannot (logged once)."""
        status = {"requested": self.spec.overlap, "active": False, "note": ""}
        if not self.spec.overlap:
            return status
        if self.drafter is None:
            status["note"] = "no drafter: nothing to pre-draft"
        elif not getattr(self.drafter, "supports_pre_draft", False):
            status["note"] = (f"the {self.draft_kind} drafter has no model to run ahead (its proposals cost "
                              f"microseconds): overlap does nothing")
        else:
            status["active"] = True
            if self.device.type != "cuda":
                status["note"] = "on a CPU nothing runs concurrently: pre-drafting only moves draft work earlier"
            elif getattr(self.drafter, "reads_target_kv", False):
                status["note"] = ("self:N pre-drafts read the target's KV: on CUDA they run after the "
                                  "verification (the guess is ready with it; only the rest overlaps the host)")
        if not status["active"]:
            logger.warning("overlap=True has no effect: %s", status["note"])
        return status

    def _draft_size_guard(self) -> dict | None:
        """Warn when a draft forward reads over ~1/3 of the target's weight bytes (the design's
        limit: beyond it drafting rarely pays). Returns the sizes (for stats)."""
        draft = self.drafter.size_bytes() if self.drafter is not None else None
        if draft is None:
            return None
        target = module_bytes(self.target)
        ratio = draft / max(target, 1)
        if ratio > DRAFT_SIZE_LIMIT:
            logger.warning("the draft (%s, %.1f MB of weights) is %.0f%% of the target's %.1f MB: over ~1/3 a "
                           "draft rarely pays for itself (use a smaller or quantized draft, or fewer self:N layers)",
                           self.draft_kind, draft / 1e6, 100 * ratio, target / 1e6)
        return {"draft_bytes": draft, "target_bytes": target, "ratio": ratio, "over_limit": ratio > DRAFT_SIZE_LIMIT}

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def draft_kind(self) -> str:
        """The drafter's name, for display ("model", "self", "ngram", "none")."""
        return self.drafter.name if self.drafter is not None else "none"

    @property
    def kv_cache_tokens(self) -> int:
        """Token positions the KV cache holds (all requests together)."""
        return self.kv.num_blocks * self.kv.block_size

    def resize_kv_cache(self, num_blocks: int) -> None:
        """(Re)build the KV cache with ``num_blocks`` blocks; only while no request is queued."""
        if getattr(self, "scheduler", None) is not None and self.scheduler.has_unfinished():
            raise RuntimeError("resize_kv_cache() needs an idle engine")
        self.kv = PagedKVCache(self._kv_configs, num_blocks, self.spec.block_size, self._kv_dtype, self.device,
                               enable_prefix_sharing=self.spec.prefix_sharing)
        self.scheduler = Scheduler(self.spec.max_batch_size, self.kv, self.spec.max_draft_length,
                                   admission=self.spec.admission, max_wait=self.spec.admission_max_wait,
                                   predict=self.policy.predicted_acceptance)
        if self.drafter is not None:
            self.drafter.bind(self.kv)
        if getattr(self, "metrics", None) is not None:
            self.metrics.info["kv_cache_tokens"] = self.kv_cache_tokens

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, tag: str = "default") -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        return self.add_requests([prompt], [params], [tag], [request_id])[0]

    def add_requests(self, prompts: Sequence, params: Sequence[SamplingParams | None], tags: Sequence[str] | None = None,
                     request_ids: Sequence[str | None] | None = None) -> list[str]:
        """Validate every request, then queue them all; ValueError (naming the request) and
        nothing queued if any is bad."""
        reqs = self.intake.check(prompts, params, tags, request_ids, in_use=self.scheduler.requests)
        with self._lock:
            self.intake.assign(reqs)
            for r in reqs:
                self.scheduler.add(r)
        return [r.request_id for r in reqs]

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            req = self.scheduler.requests.get(request_id)
            if req is not None and not req.finished:
                self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def reset_metrics(self) -> None:
        """Start the acceptance statistics (``metrics``) afresh; the cost model is kept."""
        self.metrics = self.metrics.fresh()

    def calibrate(self, batch_sizes: Sequence[int] = (1, 4), rounds: int = 4, run: int = 4,
                  prompts: Sequence | None = None) -> None:
        """Seed the cost model (what the budget policy plans with, and the autoregressive step time
        the speedup estimate divides by) with measured steps of both kinds, so that serving starts
        with the costs known: for each batch size, throwaway requests decode ``rounds`` x (``run``
        plain steps, then ``run`` steps drafting max_draft_length tokens). ``prompts`` (text or
        token ids: typical requests) are what they decode (cut to fit; synthetic ones without).
        Needs an idle engine; metrics and outputs are left as they were."""
        if not self.speculative or self.spec.max_draft_length == 0:
            return
        with self._lock:
            if self.has_unfinished():
                raise RuntimeError("calibrate() needs an idle engine (requests are queued or running)")
            saved, self.metrics = self.metrics, self.metrics.fresh()
            K, steps = self.spec.max_draft_length, 2 * rounds * run
            gen = max(1, min(steps * (K + 1) + 1, self.max_model_len // 2))
            pool = self._calibration_prompts(prompts, self.max_model_len - gen - 1)
            try:
                for B in batch_sizes:
                    B = max(1, min(int(B), self.spec.max_batch_size))
                    # an explicit seed: calibration draws nothing from the engine's seed stream
                    params = SamplingParams(temperature=0.0, ignore_eos=True, seed=0, max_tokens=gen)
                    ids = [self.add_request(pool[b % len(pool)], params, tag="calibration") for b in range(B)]
                    for i in range(steps + 1):           # + the prefill step
                        self._step(forced_k=0 if i == 0 or ((i - 1) // run) % 2 == 0 else K)
                    for rid in ids:
                        self.abort_request(rid)
                    self._drain_finished()
            finally:
                self.metrics = saved

    def _calibration_prompts(self, prompts: Sequence | None, longest: int) -> list[list[int]]:
        """Token-id prompts of at most ``longest`` tokens (their last ones): the given ones, or
        synthetic prompts of up to 32 tokens."""
        if prompts:
            out = []
            for p in prompts:
                ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
                if ids:
                    out.append(ids[-max(longest, 1):])
            if out:
                return out
        V, plen = self.vocab_size, max(1, min(32, self.max_model_len // 4, longest))
        return [[3 + (b * 131 + j * 17) % max(V - 3, 1) for j in range(plen)] for b in range(64)]

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one speculative step over the running batch; returns the requests that changed."""
        with self._lock:
            return self._step(forced_k=None)

    def _step(self, forced_k: int | None) -> list[RequestOutput]:
        """``forced_k`` (calibration): every request drafts this many; no acceptance evidence."""
        self._t_step0 = time.perf_counter()
        if self.drafter is not None:
            self.drafter.fence()                         # a pre-draft still running (CUDA) before KV writes
        for r in self.scheduler.admit():                 # refused for good: the cache can never hold them
            self._finish(r, r.finish_reason, r.error)
        batch = list(self.scheduler.running)
        if not batch:
            return self._drain_finished()
        try:
            outs = self._run(batch, forced_k)
        except Exception:   # noqa: BLE001 - whatever it was, only the requests it belongs to may fail
            logger.warning("a step over %d requests raised; retrying them one by one", len(batch), exc_info=True)
            outs = self._isolate(batch, forced_k)
        if forced_k is None and time.monotonic() - self._health_checked >= HEALTH_CHECK_EVERY_S:
            self._health_checked = time.monotonic()
            self.metrics.draft_misaligned = getattr(self.drafter, "draft_params", None) is not None
            self.metrics.check_health()
        return outs + self._drain_finished(exclude={o.request_id for o in outs})

    def _run(self, batch: list[Request], forced_k: int | None) -> list[RequestOutput]:
        """One speculative step over ``batch``. If it raises before the commit, every request is
        as before it (so the step can be retried without the culprit)."""
        t_step = time.perf_counter()
        saved = self.scheduler.save(batch)
        try:
            ks, limits = self._plan(batch, forced_k)     # K per request
            batch, ks = self._reserve(batch, ks)         # KV slots for the pending token + K drafts
            if not batch:
                return []
            before = [(len(r.output_token_ids), len(r.text)) for r in batch]
            proposal = self._propose(batch, ks, limits)
            next_ks, stops = self._plan_pre_draft(batch, ks, proposal)   # overlap: slots before the verify
            t_verify = time.perf_counter()
            vb = build_verify_batch(batch, proposal, self.kv, self.device)
            if self.drafter is not None:
                self.drafter.mark_verify()
            logits, _ = self.target(vb.input_ids, vb.positions, vb.attn_metadata, self.kv["target"],
                                    logits_indices=vb.logits_indices)                           # [R, V]
            verified = accept(vb, logits, self.spec.acceptance if self.speculative else None,
                              self.eos_token_ids)                                               # [B, K+1], [B]
            pre, pre_s = self._pre_draft(batch, ks, proposal, next_ks, stops)   # overlap: on the draft stream
            result = to_host(vb, verified, pre)                 # the step's one device->host sync
        except Exception:
            self.scheduler.restore(saved)
            raise
        samples = self._commit(batch, proposal, result, verify_s=time.perf_counter() - t_verify - pre_s)
        if forced_k is None:                             # calibration requests are synthetic: no evidence
            for r, n, a in zip(batch, proposal.num_draft_tokens, result.num_accepted):
                self.policy.observe(r, n, a)
        step_s = time.perf_counter() - t_step
        total_s = time.perf_counter() - self._t_step0    # the whole step, admission included
        self._record_costs(vb, proposal, step_s - pre_s, total_s)
        emitted = sum(len(r.output_token_ids) - before[i][0] for i, r in enumerate(batch))
        if self.speculative and forced_k is None:
            self.policy.step_done(emitted, step_s)
        self._record_samples(samples, vb, proposal, total_s)
        return [r.output(*before[i]) for i, r in enumerate(batch)]

    def _record_samples(self, samples: list, vb, proposal: DraftProposal, step_s: float) -> None:
        """Per request: its share of the step's time and, once plain steps were measured, what its
        emitted tokens would have cost autoregressively (the speedup estimate's numerator): each
        further token a plain decode step's share by the fit; the first token of each request one
        plain step over this batch by the fit, or, in a step that prefills, this step's measured
        time besides drafting (the target's prefill is what autoregressive decoding pays too)."""
        n = len(vb.num_draft_tokens)
        t_next = self.costs.ar_step_time(n, vb.num_context_tokens, n) if self.speculative else None
        if t_next is not None:
            self.metrics.info["autoregressive_step_fit"] = self.costs.plain_fit_info()
            ar_tokens = vb.num_query_tokens - sum(proposal.num_draft_tokens)   # what a plain step feeds
            t_first = (max(step_s - proposal.cost.seconds, 1e-9) if ar_tokens > n
                       else self.costs.ar_step_time(ar_tokens, vb.num_context_tokens, n))
        for r, sample in samples:
            sample.step_s = step_s / n
            if t_next is not None:
                sample.ar_est_s = (t_first + (sample.emitted - 1) * t_next) / n
            r.stats.add(sample)
            self.metrics.add(r.tag, sample)

    def _isolate(self, batch: list[Request], forced_k: int | None) -> list[RequestOutput]:
        """The step over ``batch`` raised: run it request by request; a request whose step still
        raises on its own is failed (its KV freed), the others go on."""
        outs = []
        for r in batch:
            if r.status != RequestStatus.RUNNING:
                continue
            try:
                outs += self._run([r], forced_k)
            except Exception as e:   # noqa: BLE001 - attributable to this request alone
                logger.warning("request %s failed: %s", r.request_id, e, exc_info=True)
                self._finish(r, "error", f"{type(e).__name__}: {e}")
        return outs

    def _k_cap(self, r: Request, ahead: int = 0) -> int:
        """The most tokens r may draft (after ``ahead`` more tokens): room in max_tokens and the context."""
        remaining = r.params.max_tokens - r.num_generated - ahead - 1
        room = self.max_model_len - r.context_len - ahead - 1
        return max(0, min(self.spec.max_draft_length, remaining, room))

    def _plan(self, batch: list[Request], forced_k: int | None):
        if self.drafter is None:
            return [0] * len(batch), None
        if forced_k is None and not self.drafter.caps_vary and self.policy.dormant(len(batch)):
            ks, limits = [0] * len(batch), None        # an off policy skipping its plan (BudgetPolicy.dormant)
        else:
            limits = self.drafter.limit(batch, [self._k_cap(r) for r in batch])
            if forced_k is not None:
                ks = [min(forced_k, c) for c in limits.caps]
            else:
                catchup = self.drafter.catchup(batch)
                t0 = time.perf_counter()
                ks = self.policy.plan(batch, limits.caps, self.costs, catchup=catchup)
                self.metrics.record_plan(time.perf_counter() - t0)
                ks = [min(k, c) for k, c in zip(ks, limits.caps)]
        return (self._agree_ks(ks) if self._agree_ks is not None else ks), limits

    def _reserve(self, batch: list[Request], ks: list[int]):
        kept, kept_k, preempted, failed = self.scheduler.reserve(batch, ks)
        for _ in preempted:
            self.metrics.record_preemption()
        for r in failed:
            self._finish(r, r.finish_reason, r.error)
        return kept, kept_k

    def _propose(self, batch: list[Request], ks: list[int], limits) -> DraftProposal:
        if self.drafter is None:
            return no_drafts(len(batch), self.device)
        return self.drafter.propose(batch, ks, limits, self.policy.should_stop if self.policy.stops_early else None,
                                    self.policy.pre_draft_length)

    def _plan_pre_draft(self, batch: list[Request], ks: list[int], proposal: DraftProposal):
        """Overlap: the next step's K per request (0: no pre-draft) as the policy would plan it if
        every draft of this step is accepted, the stop rules it would apply, and their KV slots
        (reserved now: copy-on-write copies then precede the verification)."""
        B = len(batch)
        if not (self.spec.overlap and self.drafter is not None and self.metrics.info["overlap"]["active"]):
            return [0] * B, None
        next_ks, stops = [], []
        for r, n, k in zip(batch, proposal.num_draft_tokens, ks):
            nk = self.policy.next_k(r, k, n, self._k_cap(r, n + 1)) if n > 0 else 0
            next_ks.append(nk)
            stops.append(self.policy.pre_stop(r, n) if nk else None)
        if not any(next_ks):
            return next_ks, None
        return self.drafter.reserve_pre_draft(batch, proposal, next_ks), stops

    def _pre_draft(self, batch: list[Request], ks: list[int], proposal: DraftProposal, next_ks: list[int],
                   stops: list | None):
        """Overlap: while this round verifies, draft the next one for requests that drafted,
        assuming every draft is accepted. Returns ({row: PreDraft}, the host seconds it added on a
        CPU, where nothing overlaps)."""
        if not any(next_ks):
            return {}, 0.0
        t0 = time.perf_counter()
        pre = self.drafter.pre_draft(batch, ks, proposal, next_ks, stops)
        return pre, (time.perf_counter() - t0 if self.device.type == "cpu" else 0.0)

    def _record_costs(self, vb, proposal: DraftProposal, step_s: float, total_s: float) -> None:
        """Feed the cost model: the drafting, and everything else the step cost (planning, the
        verify forward, sampling, bookkeeping) as the verify sample, marked by whether anything
        was drafted (a multi-token verify can cost a jump over a plain decode step); a steady
        plain step's whole time (``total_s``, admission included) is an autoregressive step sample."""
        cost = proposal.cost
        draft_s = cost.measured_seconds() if cost.forwards else cost.seconds
        if cost.forwards:
            self.costs.add_draft(cost.forwards, cost.tokens_fed, cost.attended, draft_s)
        self.costs.add_verify(vb.num_query_tokens, vb.num_context_tokens, max(step_s - draft_s, 1e-9),
                              drafted=sum(proposal.num_draft_tokens) > 0, requests=len(vb.num_draft_tokens),
                              step_seconds=total_s)

    # -- commit
    def _commit(self, batch, proposal: DraftProposal, result: VerifyResult, verify_s: float) -> list:
        """Keep what was accepted (KV rollback of the rest), emit, stop checks. A request whose
        bookkeeping raises (e.g. its text cannot be decoded) fails alone. Returns [(request,
        StepSample)] for the statistics (recorded once the step's time is known)."""
        for _ in range(proposal.pre_drafts_used):
            self.metrics.record_overlap(used=True)
        share = (max(sum(proposal.num_draft_tokens), 1), verify_s / len(batch))
        samples = []
        for b, r in enumerate(batch):
            try:
                samples.append((r, self._commit_one(r, b, proposal, result, *share)))
            except Exception as e:   # noqa: BLE001
                logger.warning("request %s failed: %s", r.request_id, e, exc_info=True)
                self._finish(r, "error", f"{type(e).__name__}: {e}")
        return samples

    def _commit_one(self, r: Request, b: int, proposal: DraftProposal, result: VerifyResult, drafted_total: int,
                    verify_share: float) -> StepSample:
        n, a = proposal.num_draft_tokens[b], result.num_accepted[b]
        emitted = result.output_token_ids[b][:a + 1]
        L = r.context_len
        r.target_cached = L + a
        pre = result.pre_drafts.get(b)
        kept = pre is not None and a == n and emitted[-1] == result.pre_draft_guess[b]
        held = self.drafter.on_commit(r, b, proposal, pre, kept) if self.drafter is not None else None
        if held is not None:
            r.draft_cached = held
        surplus = self.kv.num_tokens(r.request_id) - max(r.target_cached, 0 if held is None else held)
        if surplus > 0:
            self.kv.rollback(r.request_id, surplus)
        if pre is not None:
            self.metrics.record_overlap(used=False)
        hidden_s = pre.seconds if kept and self.device.type == "cuda" else 0.0
        share = proposal.cost.seconds * (n / drafted_total) + (pre.seconds if pre is not None else 0.0)
        sample = StepSample(n, a, len(emitted), share, verify_share, hidden_s, context_len=L,
                            temperature=r.params.temperature)
        reason = r.append_tokens(emitted, self.eos_token_ids, self.max_model_len, self.tokenizer.decode,
                                 commit_logprobs(r, b, result))
        sample.emitted = len(r.output_token_ids) - (L - len(r.prompt_token_ids))
        if reason is not None:
            self._finish(r, reason)
        else:
            # a lagging draft KV does not hold back the target's prefix sharing: its blocks
            # are registered target-only, and a later request's draft recomputes them
            self.kv.commit(r.request_id, r.token_ids[:r.target_cached], all_caches_upto=held)
        return sample

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(r, reason, error)
        if self.kv.has_request(r.request_id):
            self.kv.free(r.request_id)
        self.metrics.record_finish(reason, len(r.prompt_token_ids))
        self._finished_pending.append(r)

    def _drain_finished(self, exclude=frozenset()) -> list[RequestOutput]:
        """Outputs of requests that finished outside the step's outputs (``exclude``: their ids),
        e.g. aborted or failed; forget all finished."""
        outs = []
        for r in self._finished_pending:
            if r.request_id not in exclude:
                outs.append(r.output(len(r.output_token_ids), len(r.text)))
            self.scheduler.release(r)
        self._finished_pending = []
        return outs

