"""The speculative engine: one step = admit, plan K, draft, verify K+1 positions, commit.

    scheduler.admit()                 -> batch; policy.plan -> K per request; KV slots reserved
    drafter.propose                   -> DraftProposal: draft_token_ids [B, K], draft_probs [B, K, V] | None
    build_verify_batch; target(...)   -> logits of every request's pending token + drafts (and every fed
                                      row's hidden state for a drafter that wants it: observe_target)
    verify.accept                     -> verify_greedy / rejection_sample on the device
    host:                             ONE device->host copy of (tokens, counts); commit accepted, roll back
                                      the rest (truncate the block table, no copy); stop checks; metrics

State per request: the target's KV holds positions [0, target_cached); the last context token
is "pending" (fed in the next step together with the drafts). A drafter with a KV of its own
holds [0, draft_cached). Preemption frees the blocks and resets both to 0: the request
recomputes its context later (see specrt.step.scheduler for what that reproduces).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from specrt import ops
from specrt.config import SamplingParams, SpecConfig, clamp_k
from specrt.drafters import (DraftAsk, Drafter, DraftProposal, DraftSettings, History, ReadsTarget, check_draft_size,
                             make_drafter, no_drafts)
from specrt.drafters.spec import parse_draft
from specrt.drafters.tree import TreeShape
from specrt.models import load_generation_config, load_tokenizer
from specrt.models.attention import KVWindow
from specrt.models.kv_cache import PagedKVCache, kv_cache_blocks
from specrt.models.sources import ModelLoader, load_target, use_int8_activations
from specrt.observability.health import HealthRanges
from specrt.observability.metrics import EngineMetrics
from specrt.policy import CostModel, make_policy
from specrt.policy.tree import TreePlanner, TreeStep
from specrt.sampling.logprobs import PromptRows
from specrt.step.accounting import record_costs, record_samples
from specrt.step.calibration import calibrate
from specrt.step.commit import CommitContext, commit_step
from specrt.step.intake import RequestIntake
from specrt.step.overlap import Overlap, overlap_status
from specrt.step.prefill import split_prefill
from specrt.step.scheduler import Request, RequestOutput, RequestStatus, Scheduler
from specrt.step.threads import CpuLoad, ThreadGovernor, default_threads
from specrt.step.verify import accept, build_verify_batch, feeds_context, path_rows, to_host

logger = logging.getLogger("specrt.engine")    # the step's one logger (commit, overlap and the drafters log here too)
HEALTH_CHECK_EVERY_S = 10.0  # how often the step checks the health ranges (the log itself is rate-limited)
SYNTHETIC_TAGS = ("warmup", "calibration")   # warm-up and calibration requests: drafters learn nothing from them


class LLMEngine:
    """Continuous-batching speculative engine (thread-compatible: one thread steps).

    ``target_quantize`` / ``draft_quantize`` (None, "int8", "q8_0", "q4_0", "q4_1"): load that model with
    weight-only quantized layers that stay quantized; ``draft_quantize="auto"`` (the default): Q8_0 with
    int8 activations for a draft model on a CPU with AVX-512-VNNI, else None
    (specrt.models.sources.resolve_draft_quantize); ``draft_dtype``: the draft model's activation
    dtype (default: the engine's ``dtype``). Greedy output stays token-identical to autoregressive
    decoding of the same target (a quantized target is a different model: compare against itself).
    ``int8_activations`` (CPU, opt-in): the quantized target's layers (and a quantized draft model's)
    quantize their inputs to int8 per block of 32 and multiply in integers, as llama.cpp does for its
    quantized weights (Q8 activations): the like-for-like mode against it, ~0.5% off the float-activation
    logits; speculative greedy output still equals autoregressive output with the same setting. The
    target must be quantized (ValueError otherwise).

    Hooks (public, for tensor parallelism, benchmarks and tests): ``model_loader(path, role,
    dtype, device)`` loads each model; ``wrap_drafter(drafter) -> drafter`` wraps or adjusts
    the drafter built from ``draft``; ``agree_ks(ks) -> ks`` replaces every step's K (tensor
    parallel: rank 0's, broadcast)."""

    def __init__(self, target: str | Path, draft: str | Path | None = None, spec: SpecConfig | None = None,
                 device: str | torch.device | None = None, dtype=None, seed: int | None = None, *,
                 target_quantize: str | None = None, draft_quantize: str | None = "auto", draft_dtype=None,
                 int8_activations: bool = False, model_loader: ModelLoader | None = None, wrap_drafter: Callable[[Drafter], Drafter] | None = None,
                 agree_ks: Callable[[list[int]], list[int]] | None = None, health: HealthRanges | None = None):
        self.spec = spec or SpecConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        draft_spec = parse_draft(draft, self.spec.lookup)
        loaded = load_target(target, draft, draft_spec.loads_model, self.device, dtype, model_loader,
                             target_quantize, draft_quantize, draft_dtype, int8_activations)
        self.target, target_path, dtype = loaded.model, loaded.path, loaded.dtype
        self.tokenizer = load_tokenizer(target_path)
        self.generation_config = load_generation_config(target_path)
        self.vocab_size = self.target.config.vocab_size
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.target.config.eos_token_ids))
        window = KVWindow(self.spec.draft_kv_sinks, self.spec.draft_kv_window) if self.spec.draft_kv_window else None
        settings = DraftSettings(self.vocab_size, self.eos_token_ids, self.spec.acceptance == "coupled", self.device,
                                 kv_window=window)
        self.drafter = make_drafter(draft_spec, target_path, self.target, settings, loaded.draft_loader, dtype,
                                    accept_head=self.spec.policy == "head")
        if loaded.draft_int8_activations and self.drafter is not None:
            use_int8_activations(getattr(self.drafter, "model", None))  # a quantized draft model's layers
        if self.drafter is not None and wrap_drafter is not None:
            self.drafter = wrap_drafter(self.drafter)
        default = self.drafter.default_max_draft_length if self.drafter is not None else None
        if default is not None and not self.spec.max_draft_length_named:
            self.spec = replace(self.spec, max_draft_length=default)   # the drafter's own default
        # the optional capabilities, checked once (specrt.drafters.base; pre-drafting: overlap below)
        self._wants_hidden = isinstance(self.drafter, ReadsTarget)
        self._hidden_layers = self.drafter.target_hidden_layers if self._wants_hidden else None
        self._history = self.drafter if isinstance(self.drafter, History) else None
        configs = {"target": self.target.config, **(self.drafter.cache_configs() if self.drafter else {})}
        self.max_model_len = min(c.max_model_len for c in configs.values())
        if self.spec.max_model_len:
            self.max_model_len = min(self.max_model_len, self.spec.max_model_len)
        self._kv_configs, self._kv_dtype = configs, dtype
        self.policy = make_policy(self.spec)
        self.tree = self._tree_shape()
        self._tile_keys = ops.attention_tile_keys()
        self.tree_planner = TreePlanner(adaptive=self.spec.tree != "fixed") if self.tree is not None else None
        self.resize_kv_cache(kv_cache_blocks(list(configs.values()), self.spec, dtype, self.device, self.max_model_len))
        self.costs = CostModel()
        overlap = overlap_status(self.spec.overlap, self.drafter, self.device)
        self._overlap = Overlap(self.drafter, self.policy, self.device, self._max_k) if overlap.active else None
        info = {"overlap": overlap.as_dict(), "draft_size": check_draft_size(self.drafter, self.target),
                "kv_cache_tokens": self.kv_cache_tokens}
        self.metrics = EngineMetrics(health=health, labels={"model": target_path.name, "draft": self.draft_kind},
                                     info=info, sources=self._history.source_stats if self._history is not None else None)
        self._agree_ks = agree_ks
        self.intake = RequestIntake(self.tokenizer, self.target.config, self.max_model_len, seed)
        self.lock = threading.RLock()
        self.threads = ThreadGovernor(self.spec.threads or default_threads(), self.spec.adaptive_threads,
                                      CpuLoad() if self.spec.adaptive_threads else None) \
            if self.device.type == "cpu" else None
        self.metrics.info["threads"] = self.threads.current if self.threads is not None else None
        self._finished_pending: list[Request] = []
        self._health_checked = time.monotonic()
        # the speedup estimate's measured time is the whole step's: the bookkeeping after a step's
        # time was taken (cost fits, outputs, health checks) counts in the next recorded step
        self._recorded_until: float | None = None
        self._untimed_s = 0.0

    @property
    def speculative(self) -> bool:
        """True when the engine has a drafter (``draft`` was not None)."""
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
        self._commit_ctx = CommitContext(self.kv, self.drafter, self.eos_token_ids, self.max_model_len,
                                         self.tokenizer.decode)
        if getattr(self, "metrics", None) is not None:
            self.metrics.info["kv_cache_tokens"] = self.kv_cache_tokens

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, tag: str = "default", tenant: str | None = None) -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input. ``tenant``:
        whose history suffix drafting may read when it is scoped (None: the shared one)."""
        return self.add_requests([prompt], [params], [tag], [request_id], [tenant])[0]

    def add_requests(self, prompts: Sequence, params: Sequence[SamplingParams | None], tags: Sequence[str] | None = None,
                     request_ids: Sequence[str | None] | None = None,
                     tenants: Sequence[str | None] | None = None) -> list[str]:
        """Validate every request, then queue them all; ValueError (naming the request) and
        nothing queued if any is bad."""
        reqs = self.intake.check(prompts, params, tags, request_ids, in_use=self.scheduler.requests, tenants=tenants)
        with self.lock:
            self.intake.assign(reqs)
            for r in reqs:
                self.scheduler.add(r)
        return [r.request_id for r in reqs]

    def abort_request(self, request_id: str) -> None:
        """Finish a queued or running request with ``finish_reason="abort"`` and free its KV blocks;
        an unknown or already finished id is ignored."""
        with self.lock:
            req = self.scheduler.requests.get(request_id)
            if req is not None and not req.finished:
                self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (``step()`` has work)."""
        return self.scheduler.has_unfinished()

    def num_free_blocks(self) -> int:
        """KV-cache blocks on the free list now (what new requests can be given)."""
        return self.kv.num_free_blocks

    def forget_outputs(self) -> None:
        """Forget earlier requests' outputs that drafting reads (suffix drafting's global index),
        e.g. between benchmark repeats of the same prompts; requests in flight keep their own."""
        with self.lock:
            if self._history is not None:
                self._history.forget_outputs()

    def reset_metrics(self) -> None:
        """Start the acceptance statistics (``metrics``) afresh; the cost model is kept."""
        self.metrics = self.metrics.fresh()

    def calibrate(self, batch_sizes: Sequence[int] = (1, 4), rounds: int = 4, run: int = 4,
                  prompts: Sequence | None = None) -> None:
        """Seed the cost model with measured plain and drafting steps (specrt.step.calibration)."""
        calibrate(self, batch_sizes, rounds, run, prompts)

    # ------------------------------------------------------------------ one step
    def step(self, k: int | None = None) -> list[RequestOutput]:
        """Run one speculative step over the running batch; returns the requests that changed.
        ``k`` (calibration): every request drafts k tokens (what it can), and the step is no
        acceptance evidence."""
        with self.lock:
            gov = self.threads
            if gov is None or k is not None or not self.scheduler.has_unfinished():
                return self._step(k)
            gov.begin()
            t0, total = time.perf_counter(), self.metrics.total
            emitted = total.emitted
            outs = self._step(k)
            gov.end(time.perf_counter() - t0, total.emitted - emitted)
            self.metrics.info["threads"] = gov.current
            return outs

    def _step(self, k: int | None) -> list[RequestOutput]:
        """``k`` (calibration): every request drafts k tokens; no acceptance evidence."""
        t0 = time.perf_counter()
        self._recorded_until = None
        if self._overlap is not None:
            self._overlap.fence()                        # a pre-draft still running (CUDA) before KV writes
        for r in self.scheduler.admit():                 # refused for good: the cache can never hold them
            self._finish(r, r.finish_reason, r.error)
        split = split_prefill(list(self.scheduler.running), self.spec.prefill_chunk)   # long prompts: a chunk
        batch, prefill = split.batch, split.prefill
        if not batch and not prefill:
            return self._drain_finished()
        try:
            outs = self._run(batch, k, t0, prefill) if batch else self._prefill_only(prefill)
        except Exception:   # noqa: BLE001 - whatever it was, only the requests it belongs to may fail
            logger.warning("a step over %d requests raised; retrying them one by one", len(batch), exc_info=True)
            outs = self._isolate(batch, k, prefill)
        if k is None and time.monotonic() - self._health_checked >= HEALTH_CHECK_EVERY_S:
            self._health_checked = time.monotonic()
            self.metrics.check_health(draft_misaligned=self.drafter is not None and self.drafter.draft_params is not None)
        outs = outs + self._drain_finished(exclude={o.request_id for o in outs})
        if self._recorded_until is not None:
            self._untimed_s += time.perf_counter() - self._recorded_until
            self._recorded_until = None
        return outs

    def _run(self, batch: list[Request], k: int | None, t0: float,
             prefill: Sequence[tuple[Request, int]] = ()) -> list[RequestOutput]:
        """One speculative step over ``batch`` (``t0``: when the step began, admission included),
        with ``prefill``'s prompt chunks riding along (specrt.step.prefill). If it raises before the
        commit, every request of the batch is as before it (so the step can be retried without
        the culprit)."""
        t_step = time.perf_counter()
        saved = self.scheduler.save(batch)
        try:
            ks, limits = self._plan(batch, k)     # K per request (a tree step: its depth)
            plan = self._tree_plan(batch, ks, k is not None, limits)  # a tree engine's decision for this step
            if plan is not None and not plan.draft:
                ks = [0] * len(batch)
            nodes = self._tree_nodes(batch, ks, k is not None, limits)   # a tree step's node budgets; None: chains
            depth = {r.request_id: d for r, d in zip(batch, ks)}
            batch, ks = self._reserve(batch, ks if nodes is None else nodes)   # slots: pending + drafts
            prefill = [(r, e) for r, e in prefill if r.status == RequestStatus.RUNNING]   # not preempted
            if not batch:
                return self._prefill_only(prefill)
            before = [(len(r.output_token_ids), len(r.text)) for r in batch]
            if nodes is None:
                proposal = self._propose(batch, ks, limits)
            else:
                shape = self.tree
                if self.tree_planner.adaptive:
                    shape = replace(shape, row_costs=tuple(plan.row_costs), level_cost=plan.level_cost,
                                    calibration=plan.calibration)
                proposal = self.drafter.propose(batch, DraftAsk([depth[r.request_id] for r in batch], limits,
                                                                tree=shape, nodes=ks))
            pre_plan = self._overlap.plan(batch, ks, proposal) if self._overlap and nodes is None else None
            t_verify = time.perf_counter()
            vb = build_verify_batch(batch, proposal, self.kv, self.device, prefill)
            if self._overlap is not None:
                self._overlap.mark_verify()
            head = PromptRows.head_of(vb, self.target, self._hidden_layers)   # prompt logprobs: chunked logits
            logits, hidden = self.target(vb.input_ids, vb.positions, vb.attn_metadata, self.kv["target"],
                                         logits_indices=vb.logits_indices[:len(vb.row_request)] if head is not None
                                         else vb.logits_indices, all_hidden=self._wants_hidden or head is not None,
                                         hidden_layers=self._hidden_layers)  # [R, V]
            prompt = PromptRows.take(vb, hidden, head, PromptRows.final_columns(self.target, self._hidden_layers)) \
                if head is not None else None
            hidden = hidden if self._wants_hidden else None
            verified = accept(vb, logits, self._acceptance(), self.eos_token_ids, prompt)      # [B, K+1], [B]
            if hidden is not None:                       # [T, H]: a feature drafter reads every fed row
                if verified.accepted_nodes is not None:  # ... a tree's in accepted-path order
                    hidden = hidden.index_select(0, path_rows(vb, verified.accepted_nodes, hidden.shape[0]))
                self.drafter.observe_target(batch + [r for r, _ in prefill], vb, hidden)
            pre, pre_s = self._overlap.run(batch, proposal, pre_plan) if pre_plan else ({}, 0.0)  # draft stream
            result = to_host(vb, verified, {b: p.guess for b, p in pre.items()})   # the step's one device->host sync
        except Exception:
            self.scheduler.restore(saved)
            raise
        settle = self._overlap.settler(pre, proposal, result, self.metrics) if self._overlap is not None else None
        samples, ended = commit_step(self._commit_ctx, batch, proposal, result,
                                     verify_s=time.perf_counter() - t_verify - pre_s, settle=settle)
        for r, end in prefill:
            r.target_cached = end
        for r in batch:
            r.just_admitted = False                      # its first step since admission has committed
        for e in ended:
            self._finish(e.request, e.reason, e.error)
        if k is None:                             # calibration requests are synthetic: no evidence
            for r, n, a in zip(batch, proposal.num_draft_tokens, result.num_accepted):
                self.policy.observe(r, n, a)
        step_s = time.perf_counter() - t_step
        total_s = time.perf_counter() - t0               # the whole step, admission included
        record_costs(self.costs, vb, proposal, step_s - pre_s, total_s, limits.seconds if limits else 0.0)
        emitted = sum(len(r.output_token_ids) - before[i][0] for i, r in enumerate(batch))
        if self.speculative and k is None:
            self.policy.step_done(emitted, step_s)
        if self.tree_planner is not None and k is None:
            n, drafted = len(batch), sum(proposal.num_draft_tokens)
            self.tree_planner.observe(sum(proposal.expected_accepted or [0.0]), sum(result.num_accepted), emitted,
                                      step_s, step_s - proposal.cost.seconds, vb.num_query_tokens,
                                      self.costs.ar_step_time(n, vb.num_context_tokens, n), n,
                                      drafted=nodes is not None, fed_context=vb.num_query_tokens > n + drafted)
        untimed, self._untimed_s = self._untimed_s, 0.0    # the last recorded step's bookkeeping after its time
        record_samples(self.costs, self.metrics, samples, vb, proposal, total_s, self.speculative,
                       limits.seconds if limits else 0.0, untimed)
        self._recorded_until = t0 + total_s
        return [r.output(*before[i]) for i, r in enumerate(batch)]

    def _prefill_only(self, prefill: Sequence[tuple[Request, int]]) -> list[RequestOutput]:
        """A step of prompt chunks alone (specrt.step.prefill): their K/V and hidden states; no output."""
        if not prefill:
            return []
        vb = build_verify_batch([], no_drafts(0, self.device), self.kv, self.device, prefill)
        _, hidden = self.target(vb.input_ids, vb.positions, vb.attn_metadata, self.kv["target"],
                                logits_indices=vb.logits_indices, all_hidden=self._wants_hidden,
                                hidden_layers=self._hidden_layers)
        if self._wants_hidden:
            self.drafter.observe_target([r for r, _ in prefill], vb, hidden)
        for r, end in prefill:
            r.target_cached = end
        return []

    def _isolate(self, batch: list[Request], k: int | None,
                 prefill: Sequence[tuple[Request, int]] = ()) -> list[RequestOutput]:
        """The step over ``batch`` (and ``prefill``'s chunks) raised: run it request by request; a
        request whose step still raises on its own is failed (its KV freed), the others go on."""
        outs = []
        for r, end in [(r, None) for r in batch] + list(prefill):
            if r.status != RequestStatus.RUNNING:
                continue
            try:
                outs += self._run([r], k, time.perf_counter()) if end is None else self._prefill_only([(r, end)])
            except Exception as e:   # noqa: BLE001 - attributable to this request alone
                logger.warning("request %s failed: %s", r.request_id, e, exc_info=True)
                self._finish(r, "error", f"{type(e).__name__}: {e}")
        return outs

    def _max_k(self, r: Request, ahead: int = 0) -> int:
        """The most tokens r may draft (after ``ahead`` more tokens): room in max_tokens and the context.
        0 while r's context is fed (a prefill): its rows then run in a forward of the same shape as
        without a drafter (prefill GEMMs and attention are not row-invariant: drafts appended to the
        prompt would change its KV by ulps, and greedy output would differ from autoregressive).
        0 too on the first step after admission even when the prefix cache held all but the last
        token (no prefill): the draft lengths, which a seeded request's tokens depend on under
        rejection sampling, must not depend on what the cache held (specrt.step.scheduler)."""
        if ahead == 0 and (feeds_context(r) or r.just_admitted):
            return 0
        remaining = r.params.max_tokens - r.num_generated - ahead - 1
        room = self.max_model_len - r.context_len - ahead - 1
        return clamp_k(self.spec.max_draft_length, remaining, room)

    def _plan(self, batch: list[Request], k: int | None):
        """(each request's k, what the drafter found: DraftLimits or None); ``k``: calibration's, for all."""
        if self.drafter is None:
            return [0] * len(batch), None
        if k is None and not self.drafter.limits_vary and self.policy.dormant(len(batch)):
            ks, limits = [0] * len(batch), None        # an off policy skipping its plan (BudgetPolicy.dormant)
        else:
            limits = self.drafter.limit(batch, [self._max_k(r) for r in batch])
            if k is not None:
                ks = [clamp_k(k, m) for m in limits.max_ks]
            else:
                t0 = time.perf_counter()
                ks = self.policy.plan(batch, limits.max_ks, self.costs, catchup=limits.catchup)
                self.metrics.record_plan(time.perf_counter() - t0)
                ks = [clamp_k(k, m) for k, m in zip(ks, limits.max_ks)]
        return (self._agree_ks(ks) if self._agree_ks is not None else ks), limits

    def _tree_shape(self) -> TreeShape | None:
        """How this engine grows trees (SpecConfig.tree), or None: it drafts chains."""
        spec = self.spec
        grows = self.drafter is not None and self.drafter.grows_trees and spec.max_draft_length > 0
        if spec.tree == "chain" or not grows or (spec.tree == "auto" and (spec.policy != "fixed" or spec.overlap)):
            return None
        return TreeShape(spec.max_draft_length, spec.tree_branching, spec.tree_branching)

    def _acceptance(self) -> str | None:
        """How the engine verifies sampled requests (None: no drafter). An engine whose tree planner
        decides the steps (tree sizes, plain steps) uses the coupled rule on every step: tree drafts
        are one-hot, so it accepts exactly as often as rejection, and a seeded request's tokens then
        equal plain sampling with its seed, whatever the planner chose (docs/trees.md)."""
        if not self.speculative:
            return None
        if self.tree_planner is not None and self.tree_planner.adaptive:
            return "coupled"
        return self.spec.acceptance

    @staticmethod
    def _trees_allowed(batch: list[Request]) -> bool:
        """No request reads each verified row as a chain position (logit controls, log-probabilities)."""
        return not any(r.params.has_logit_controls or r.params.logprobs is not None
                       or r.params.prompt_logprobs is not None for r in batch)

    def _tree_plan(self, batch: list[Request], ks: list[int], calibration: bool, limits) -> TreeStep | None:
        """The tree planner's decision (draft or not, the row costs) for a step that may grow trees
        (None otherwise: a chain step keeps the policy's K, whatever the planner has seen)."""
        if self.tree_planner is None or calibration or not any(ks) or not self._trees_allowed(batch):
            return None
        self.costs.refit()
        n, context = len(batch), sum(r.context_len for r in batch)
        ahead = max(r.params.max_tokens - r.num_generated for r in batch) * self.costs.verify_time(n, context, requests=n)
        return self.tree_planner.plan(self.costs, n, n, context, self.tree.max_depth, self.spec.max_tree_nodes,
                                      self.costs.catchup_time(limits.catchup if limits else None, batch), ahead)

    def _tree_nodes(self, batch: list[Request], ks: list[int], calibration: bool, limits) -> list[int] | None:
        """A tree step's node budget per request (0: no drafts), or None: this step drafts chains
        (no trees, calibration, or a request whose logit controls / log-probabilities read each
        verified row as the chain's position)."""
        if self.tree is None or calibration or not any(ks) or not self._trees_allowed(batch):
            return None
        # the nodes stay inside the attention tile of the first (slots context_len ..): every node's
        # visible keys then fall into the tiles decoding its path would use, so it verifies with the
        # same bits (greedy output stays token-identical in every dtype). A proposal known to be one
        # chain (limits.chains) verifies causally, as a chain step would: it keeps its length.
        tile, chains = self._tile_keys, (limits.chains if limits is not None else {})
        budgets = []
        for r, k in zip(batch, ks):
            room = self.max_model_len - r.context_len
            if k <= 0:
                budgets.append(0)
            elif r.request_id in chains:
                budgets.append(min(chains[r.request_id], room))
            else:
                budgets.append(min(self.spec.max_tree_nodes, room, tile - r.context_len % tile))
        return budgets

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
        return self.drafter.propose(batch, DraftAsk(ks, limits, self.policy.should_stop if self.policy.stops_early
                                                    else None))

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(r, reason, error)
        if self._history is not None and r.tag not in SYNTHETIC_TAGS:
            self._history.on_finish(r)
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

