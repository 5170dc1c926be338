"""The speculative engine: one step = schedule, draft K tokens, verify K+1 positions, commit.

    scheduler.admit()                 -> batch; policy.plan -> K per request; KV slots reserved
    draft stream:  drafter            -> draft_token_ids [B, K], draft_probs [B, K, V] | None
    main stream:   wait(draft_done); target.forward(pending + drafts of every request)
                   probs_from_logits / verify_greedy / rejection_sample
    host:          ONE device->host copy of (tokens, counts); commit accepted, roll back the rest
                   (truncate the block table, no copy); stop checks; metrics

State per request: the target's KV holds positions [0, target_cached); the last context
token is "pending" (fed in the next step together with the drafts). A model drafter's KV
holds [0, draft_cached). Preemption frees the blocks and resets both to 0: the request
recomputes its context later and, by the randomness rule, emits the same tokens.
"""
from __future__ import annotations

import itertools
import random
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specrt import ops
from specrt.config import SamplingParams, SpecConfig
from specrt.drafters import NgramProposer
from specrt.attention import AttentionMetadata
from specrt.kv_cache import PagedKVCache, num_blocks_for_budget
from specrt.metrics import EngineMetrics
from specrt.models import (check_draft_compatible, check_prompt_length, load_generation_config, load_model,
                           load_tokenizer)
from specrt.policy import CostModel, make_policy
from specrt.scheduler import Request, RequestStatus, Scheduler

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def resolve_model_path(path: str | Path, role: str) -> Path:
    if str(path) == "builtin":
        p = BUILTIN_DIR / role
        if not (p / "config.json").is_file():
            raise ValueError(f"the built-in {role} model is missing from this install ({p})")
        return p
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"{role} model folder not found: {p}")
    return p


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    new_token_ids: list[int] = field(default_factory=list)   # streaming: tokens added by the last step
    new_text: str = ""
    error: str | None = None


@dataclass
class _Draft:
    draft_token_ids: torch.Tensor        # [B, K] int32 on device, -1 padded
    num_draft_tokens: list[int]          # [B] host
    draft_probs: torch.Tensor | None     # [B, K, V] float32 or None (one-hot drafts)
    fed_until: list[int]                 # [B] draft-model KV positions written (for draft_cached)
    seconds: float = 0.0
    forwards: int = 0                    # draft forwards run (the depth the cost model sees)
    tokens_fed: int = 0                  # tokens the draft consumed, catch-up included
    attended: int = 0                    # sum over forwards of the rows' sequence lengths
    events: tuple | None = None          # CUDA: (start, end) timing events around the drafting


class LLMEngine:
    """Continuous-batching speculative engine (thread-compatible: one thread steps)."""

    def __init__(self, target: str | Path, draft: str | Path | None = None, spec: SpecConfig | None = None,
                 device: str | torch.device | None = None, dtype=None, seed: int | None = None):
        self.spec = spec or SpecConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        target_path = resolve_model_path(target, "target")
        self.target = self._load_model(target_path, dtype)
        self.tokenizer = load_tokenizer(target_path)
        self.generation_config = load_generation_config(target_path)
        self.vocab_size = self.target.config.vocab_size
        eos = set(self.tokenizer.eos_token_ids) | set(self.target.config.eos_token_ids)
        self.eos_token_ids = sorted(eos)
        self._rng = random.Random(seed)

        # drafter
        self.draft_kind = "none"
        self.draft_model = None
        self.self_layers = None
        self.ngram = None
        configs = {"target": self.target.config}
        if draft is None or draft == "none":
            pass
        elif isinstance(draft, str) and draft.startswith("ngram"):
            parts = draft.split(":")[1:]
            self.ngram = NgramProposer(*(int(p) for p in parts)) if parts else NgramProposer()
            self.draft_kind = "ngram"
        elif isinstance(draft, str) and draft.startswith("self:"):
            n = int(draft.split(":", 1)[1])
            if not 1 <= n < self.target.config.num_layers:
                raise ValueError(f"draft='self:N' needs 1 <= N < {self.target.config.num_layers}, got {n}")
            self.self_layers = n
            self.draft_kind = "self"
        else:
            draft_path = resolve_model_path(draft, "draft")
            info = check_draft_compatible(target_path, draft_path)
            self.draft_model = self._load_model(draft_path, dtype)
            self.draft_vocab = info["shared_vocab_size"]
            self.draft_kind = "model"
            configs["draft"] = self.draft_model.config
        self.speculative = self.draft_kind != "none"

        self.max_model_len = min(c.max_model_len for c in configs.values())
        if self.spec.max_model_len:
            self.max_model_len = min(self.max_model_len, self.spec.max_model_len)
        num_blocks = num_blocks_for_budget(list(configs.values()), self.spec.block_size, dtype,
                                           self.spec.kv_cache_budget, self.device)
        # a CPU budget fraction of free RAM is far more than tiny models need: cap it
        if self.device.type == "cpu" and isinstance(self.spec.kv_cache_budget, float):
            num_blocks = min(num_blocks, 64 + self.spec.max_batch_size * (self.max_model_len // self.spec.block_size + 2))
        self.kv = PagedKVCache(configs, num_blocks, self.spec.block_size, dtype, self.device,
                               enable_prefix_sharing=self.spec.prefix_sharing)
        self.scheduler = Scheduler(self.spec.max_batch_size)
        self.policy = make_policy(self.spec)
        self.costs = CostModel()
        self.metrics = EngineMetrics()
        self.accept_head = None
        if self.spec.policy == "head":
            self.accept_head = self._load_accept_head(draft)
        self._draft_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CUDA: one pair of timing events around each step's drafting, made once (read after the
        # step's one sync, re-recorded by the next step)
        self._draft_events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              if self._draft_stream is not None else None)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._finished_pending: list[Request] = []
        self._forced_k: int | None = None     # calibrate(): every request drafts this many
        self._ngram_props: dict = {}          # request id -> this step's n-gram proposal (see _plan)

    # ------------------------------------------------------------------ requests
    def _load_model(self, path: Path, dtype):
        """Load one model onto this engine's device (tensor parallelism overrides this to shard)."""
        return load_model(path, dtype=dtype, device=self.device)

    def _load_accept_head(self, draft):
        if self.draft_kind != "model":
            raise ValueError("policy='head' needs a draft model with an acceptance head (accept_head/ beside it)")
        from specrt.models.accept_head import AcceptanceHead

        head_dir = resolve_model_path(draft, "draft") / "accept_head"
        if not head_dir.is_dir():
            raise ValueError(f"policy='head': no acceptance head at {head_dir} (train one with `specrt distill head`)")
        return AcceptanceHead.load(head_dir).to(self.device).eval()

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, tag: str = "default") -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            token_ids = [int(t) for t in prompt]
            text = None
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:8]}")
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        check_prompt_length(self.target.config, len(token_ids), 0, self.max_model_len - 1)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        req = Request(request_id=rid, prompt_token_ids=token_ids, params=params, seed=seed, prompt=text, tag=tag)
        with self._lock:
            self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            req = self.scheduler.requests.get(request_id)
            if req is not None and not req.finished:
                self._finish(req, "abort")

    def calibrate(self, batch_sizes: Sequence[int] = (1, 4), rounds: int = 4, run: int = 4) -> None:
        """Seed the cost model (what the budget policy plans with) with measured steps of both
        kinds, so that serving starts with the costs known instead of learning them on the first
        requests: for each batch size, throwaway requests decode ``rounds`` x (``run`` plain steps,
        then ``run`` steps drafting max_draft_length tokens). Needs an idle engine; metrics and
        outputs are left as they were."""
        if not self.speculative or self.spec.max_draft_length == 0:
            return
        with self._lock:
            if self.has_unfinished():
                raise RuntimeError("calibrate() needs an idle engine (requests are queued or running)")
            saved, self.metrics = self.metrics, EngineMetrics()
            V, K = self.vocab_size, self.spec.max_draft_length
            steps = 2 * rounds * run
            plen = max(1, min(32, self.max_model_len // 4))
            try:
                for B in batch_sizes:
                    B = max(1, min(int(B), self.spec.max_batch_size))
                    # an explicit seed: calibration draws nothing from the engine's seed stream
                    params = SamplingParams(temperature=0.0, ignore_eos=True, seed=0,
                                            max_tokens=max(1, min(steps * (K + 1) + 1, self.max_model_len - plen - 1)))
                    ids = [self.add_request([3 + (b * 131 + j * 17) % max(V - 3, 1) for j in range(plen)], params,
                                            tag="calibration") for b in range(B)]
                    for i in range(steps + 1):           # + the prefill step
                        self._forced_k = 0 if i == 0 or ((i - 1) // run) % 2 == 0 else K
                        self.step()
                    for rid in ids:
                        self.abort_request(rid)
                    self._drain_finished()
            finally:
                self._forced_k = None
                self.metrics = saved

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_free_blocks(self) -> int:
        return self.kv.manager.num_free_blocks

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one speculative step over the running batch; returns the requests that changed."""
        with self._lock:
            self.scheduler.admit(self._try_allocate)
            batch = list(self.scheduler.running)
            if not batch:
                return self._drain_finished()
            t_step = time.perf_counter()
            ks = self._plan(batch)
            batch, ks = self._reserve(batch, ks)
            if not batch:
                return self._drain_finished()
            before = [(len(r.output_token_ids), len(r.text)) for r in batch]
            draft = self._draft(batch, ks)
            tokens, accepted, verify_s, pre = self._verify(batch, ks, draft)
            self._commit(batch, draft, tokens, accepted, verify_s, pre)
            step_s = time.perf_counter() - t_step
            self._record_costs(draft, step_s)
            if self.speculative and self._forced_k is None:
                self.policy.step_done(sum(len(r.output_token_ids) - before[i][0] for i, r in enumerate(batch)),
                                      step_s)
            outs = [self._output(r, *before[i]) for i, r in enumerate(batch)]
            return outs + self._drain_finished(exclude=batch)

    # -- scheduling
    def _try_allocate(self, req: Request) -> bool:
        mgr = self.kv.manager
        headroom = len(self.scheduler.running) * (self.spec.max_draft_length + 1)
        if not mgr.can_allocate(req.context_len + headroom):
            if not self.scheduler.running and not mgr.can_allocate(req.context_len + self.spec.max_draft_length + 1):
                self._finish(req, "error", f"the KV cache ({mgr.num_blocks} blocks of {mgr.block_size}) cannot hold "
                                           f"this request's {req.context_len} tokens")
                return True   # removed from waiting by _finish; keep admitting others
            return False
        cached = mgr.allocate(req.request_id, req.token_ids)
        if cached is None:
            return False
        cached = min(cached, req.context_len - 1)
        req.target_cached = cached
        req.draft_cached = min(self.kv.cached_in_all_caches(req.request_id), cached)
        return True

    def _k_cap(self, r: Request) -> int:
        if not self.speculative:
            return 0
        remaining = r.params.max_tokens - r.num_generated - 1
        room = self.max_model_len - r.context_len - 1
        return max(0, min(self.spec.max_draft_length, remaining, room))

    def _plan(self, batch: list[Request]) -> list[int]:
        if not self.speculative:
            return [0] * len(batch)
        if self._forced_k is None and self.draft_kind != "ngram" and self.policy.dormant(len(batch)):
            return [0] * len(batch)        # an off policy skipping its plan (BudgetPolicy.dormant)
        caps = [self._k_cap(r) for r in batch]
        if self.draft_kind == "ngram":
            # n-gram proposals cost microseconds: compute them now, so every policy knows which
            # requests have one and how long (the drafts below are their prefixes)
            self._ngram_props = {r.request_id: self.ngram.propose(r.token_ids, c, r.drafter_state)
                                for r, c in zip(batch, caps)}
            caps = [len(self._ngram_props[r.request_id]) for r in batch]
        if self._forced_k is not None:
            return [min(self._forced_k, c) for c in caps]
        # the draft model's KV lags by what it has not consumed yet (its prompt, the first time)
        catchup = [max(r.context_len - 1 - r.draft_cached, 0) if self.draft_kind == "model" else 0 for r in batch]
        return [min(k, c) for k, c in zip(self.policy.plan(batch, caps, self.costs, catchup=catchup), caps)]

    def _reserve(self, batch: list[Request], ks: list[int]):
        """Give every request slots for positions [target_cached, L + K); on shortage drop its
        drafts, then preempt the newest other request; never crash."""
        mgr = self.kv.manager
        kept, kept_k = [], []
        for r, k in zip(batch, ks):
            if r.status != RequestStatus.RUNNING:
                continue
            while True:
                need = r.context_len + k - mgr.num_tokens(r.request_id)
                if self.kv.append_slots(r.request_id, max(need, 0)):
                    break
                if k > 0:
                    k = 0
                    continue
                victim = self.scheduler.preempt_newest(exclude=r)
                if victim is None:
                    self._finish(r, "error", "the KV cache is too small for this request")
                    break
                self.kv.free(victim.request_id)
                self.metrics.record_preemption()
                if victim in kept:
                    i = kept.index(victim)
                    kept.pop(i)
                    kept_k.pop(i)
            if r.status == RequestStatus.RUNNING:
                kept.append(r)
                kept_k.append(k)
        return kept, kept_k

    # -- sampling parameter rows
    def _param_rows(self, reqs: list[Request], counts: list[int]):
        temps, topk, topp = [], [], []
        for r, c in zip(reqs, counts):
            temps += [r.params.temperature] * c
            topk += [r.params.top_k] * c
            topp += [r.params.top_p] * c
        dev = self.device
        return (torch.tensor(temps, dtype=torch.float32).to(dev, non_blocking=True),
                torch.tensor(topk, dtype=torch.int32).to(dev, non_blocking=True),
                torch.tensor(topp, dtype=torch.float32).to(dev, non_blocking=True))

    def _mask_eos(self, logits: torch.Tensor, output_index: list[int], reqs: list[Request]) -> None:
        """min_tokens: the EOS logits of rows that would emit output token #i < min_tokens are -inf
        (in draft and target rows alike, so both sample from the same constrained distribution)."""
        rows = [i for i, (oi, r) in enumerate(zip(output_index, reqs)) if oi < r.params.min_tokens]
        if rows and self.eos_token_ids:
            eos = [e for e in self.eos_token_ids if e < logits.shape[1]]
            idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits[idx[:, None], torch.tensor(eos, dtype=torch.int64, device=logits.device)[None, :]] = float("-inf")

    # -- drafting
    def _draft(self, batch: list[Request], ks: list[int]) -> _Draft:
        B = len(batch)
        kmax = max(ks) if ks else 0
        ids = torch.full((B, kmax), -1, dtype=torch.int32)
        if kmax == 0:
            return _Draft(ids.to(self.device), [0] * B, None, [r.draft_cached for r in batch])
        t0 = time.perf_counter()
        if self.draft_kind == "ngram":
            n = []
            planned = self._ngram_props
            for b, r in enumerate(batch):
                prop = planned.get(r.request_id)
                prop = self.ngram.propose(r.token_ids, ks[b], r.drafter_state) if prop is None else prop[:ks[b]]
                ids[b, :len(prop)] = torch.tensor(prop, dtype=torch.int32)
                n.append(len(prop))
            return _Draft(ids.to(self.device), n, None, [r.draft_cached for r in batch], time.perf_counter() - t0,
                          forwards=kmax, tokens_fed=sum(n))
        with self._on_draft_stream():
            events = self._draft_events
            if events is not None:
                events[0].record()
            draft = self._draft_with_model(batch, ks, kmax)
            if events is not None:
                events[1].record()
        if self._draft_stream is not None:   # verification waits for the drafts (an event, no host sync)
            torch.cuda.current_stream(self.device).wait_stream(self._draft_stream)
        draft.seconds = time.perf_counter() - t0   # host time; on CUDA the events give the device's
        draft.events = events
        return draft

    def _on_draft_stream(self):
        if self._draft_stream is None:
            return nullcontext()
        self._draft_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._draft_stream)

    def _draft_model_parts(self):
        if self.draft_kind == "self":
            return self.target, self.kv["target"], self.self_layers
        return self.draft_model, self.kv["draft"], None

    def _draft_forward(self, reqs: list[Request], input_ids: torch.Tensor, seq_lens: list[int],
                       query_lens: list[int], out_index: list[int], host_ids: list[int] | None = None):
        """One batched draft forward; returns (q [rows, V] float32, hidden or None) for each row's
        last position. Draft and target rows of a request get the same sampling transform.
        ``host_ids``: the rows' tokens when they may recompute blocks shared between requests
        (catch-up over a target-only prefix): each shared slot is then written once."""
        dev = self.device
        model, cache, num_layers = self._draft_model_parts()
        positions = torch.tensor([p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)],
                                 dtype=torch.int64).to(dev, non_blocking=True)
        meta = AttentionMetadata.build(seq_lens, query_lens, [self.kv.block_table(r.request_id) for r in reqs],
                                       self.spec.block_size, dev, token_ids=host_ids)
        last = torch.tensor(list(itertools.accumulate(query_lens)), dtype=torch.int64).to(dev, non_blocking=True) - 1
        logits, hidden = model(input_ids, positions, meta, cache, num_layers=num_layers, logits_indices=last,
                               return_hidden=self.policy.needs_hidden)
        if logits.shape[1] < self.vocab_size:   # a draft vocabulary padded to the target's
            pad = logits.new_full((logits.shape[0], self.vocab_size - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], 1)
        self._mask_eos(logits, out_index, reqs)
        temps, topk, topp = self._param_rows(reqs, [1] * len(reqs))
        q = ops.probs_from_logits(logits, temps, topk, topp, check_values=False)
        self._last_draft_logits = logits          # for the confidence / head policies
        return q, hidden

    def _sample_draft(self, q: torch.Tensor, reqs: list[Request], positions: list[int]) -> torch.Tensor:
        """Draft tokens [rows] int32: DRAFT noise (rejection) or the target's own TARGET noise (coupled)."""
        dev = self.device
        seeds = torch.tensor([r.seed for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        purpose = "target" if self.spec.acceptance == "coupled" else "draft"
        return ops.sample_tokens(q, seeds, pos, purpose=purpose, check_values=False)

    def _draft_with_model(self, batch: list[Request], ks: list[int], kmax: int) -> _Draft:
        B = len(batch)
        dev = self.device
        is_self = self.draft_kind == "self"
        need_probs = self.spec.acceptance == "rejection" and any(not r.params.greedy for r in batch)
        draft_ids = torch.full((B, kmax), -1, dtype=torch.int32, device=dev)          # [B, K]
        draft_probs = torch.zeros(B, kmax, self.vocab_size, device=dev) if need_probs else None  # [B, K, V]
        n_draft = [0] * B
        # at least the pending last token is fed (positions past the context may hold an unused pre-draft)
        cached = [min(r.target_cached if is_self else r.draft_cached, r.context_len - 1) for r in batch]
        fed_until = list(cached)
        stopped = [False] * B
        # requests whose overlap pre-draft (made while the last round verified) is still valid
        for b, r in enumerate(batch):
            pre = r.policy_state.pop("pre_draft", None)
            if pre is not None and pre["k"] == ks[b]:
                self.metrics.record_overlap(used=True)
                draft_ids[b, :ks[b]] = pre["ids"]
                if draft_probs is not None and pre["probs"] is not None:
                    draft_probs[b, :ks[b]] = pre["probs"]
                n_draft[b] = ks[b]
                fed_until[b] = r.draft_cached
                stopped[b] = True
        prev = None          # [rows] int32 on device: the tokens sampled by the last draft step
        prev_rows: list[int] = []
        forwards = tokens_fed = attended = 0
        for j in range(kmax):
            rows = [b for b in range(B) if j < ks[b] and not stopped[b]]
            if not rows:
                break
            reqs = [batch[b] for b in rows]
            host_ids = None
            if j == 0:
                chunks = [batch[b].token_ids[cached[b]:] for b in rows]
                host_ids = [t for c in chunks for t in c]
                input_ids = torch.tensor(host_ids, dtype=torch.int64).to(dev, non_blocking=True)
                seq_lens = [r.context_len for r in reqs]
                query_lens = [len(c) for c in chunks]
            else:
                sel = torch.tensor([prev_rows.index(b) for b in rows], dtype=torch.int64).to(dev, non_blocking=True)
                input_ids = prev.index_select(0, sel).long()
                seq_lens = [r.context_len + j for r in reqs]
                query_lens = [1] * len(rows)
            q, hidden = self._draft_forward(reqs, input_ids, seq_lens, query_lens,
                                            [r.num_generated + j for r in reqs], host_ids)  # [rows, V]
            forwards += 1
            tokens_fed += sum(query_lens)
            attended += sum(seq_lens)
            x = self._sample_draft(q, reqs, [r.context_len + j for r in reqs])               # [rows]
            row_idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
            draft_ids[row_idx, j] = x
            if draft_probs is not None:
                draft_probs[row_idx, j] = q
            for b, s in zip(rows, seq_lens):
                n_draft[b] = j + 1
                fed_until[b] = s
            if self.policy.needs_draft_probs_on_host:
                # one intentional sync per draft step: confidence / head policies decide on the host.
                # Confidence is the draft model's own softmax probability of its token (at T=1): the
                # sampling transform makes greedy rows one-hot, which would say "certain" every time.
                conf = torch.softmax(self._last_draft_logits, -1)
                qx = conf.gather(1, x.long()[:, None])[:, 0]
                p_acc = None
                if self.accept_head is not None:
                    p_acc = self.accept_head(hidden.float(), qx).float().cpu().tolist()
                qx = qx.cpu().tolist()
                for i, b in enumerate(rows):
                    if self.policy.should_stop(batch[b], j, qx[i], None if p_acc is None else p_acc[i]):
                        stopped[b] = True
                        n_draft[b] = j          # the unconfident token is not proposed
            prev, prev_rows = x, rows
        return _Draft(draft_ids, n_draft, draft_probs, fed_until, forwards=forwards, tokens_fed=tokens_fed,
                      attended=attended)

    def _pre_draft(self, batch: list[Request], ks: list[int], draft: _Draft) -> dict[int, dict]:
        """Overlap: while the target verifies this round, draft the next one assuming every draft
        is accepted and the bonus token equals the draft's own guess. Enqueued on the draft
        stream (no dependency on the verification), so on CUDA it runs concurrently. Kept only
        if that assumption holds, else dropped: the output never depends on it.

        Only for model drafters under the fixed policy (other policies decide K from the
        outcome of this round, so the next round's K is not known yet)."""
        if not (self.spec.overlap and self.draft_kind == "model" and self.spec.policy == "fixed"):
            return {}
        dev = self.device
        rows, k_next = [], []
        for b, r in enumerate(batch):
            n = draft.num_draft_tokens[b]
            if n == 0 or n != ks[b]:
                continue
            g = r.num_generated + n + 1                       # generated tokens if all accepted
            L_next = r.context_len + n + 1
            k = max(0, min(self.spec.max_draft_length, r.params.max_tokens - g - 1,
                           self.max_model_len - L_next - 1))
            if k == 0 or not self.kv.append_slots(r.request_id, L_next + k - 1 - self.kv.num_tokens(r.request_id)):
                continue
            rows.append(b)
            k_next.append(k)
        if not rows:
            return {}
        t0 = time.perf_counter()
        reqs = [batch[b] for b in rows]
        need_probs = self.spec.acceptance == "rejection" and any(not r.params.greedy for r in reqs)
        out_ids = torch.full((len(rows), max(k_next)), -1, dtype=torch.int32, device=dev)
        out_probs = torch.zeros(len(rows), max(k_next), self.vocab_size, device=dev) if need_probs else None
        with self._on_draft_stream():
            # step 0: feed the last draft x_n, guess the bonus token at position L + n
            last = torch.tensor([b * draft.draft_token_ids.shape[1] + draft.num_draft_tokens[b] - 1 for b in rows],
                                dtype=torch.int64).to(dev, non_blocking=True)
            feed = draft.draft_token_ids.view(-1).index_select(0, last).long()
            base = [r.context_len + draft.num_draft_tokens[b] for b, r in zip(rows, reqs)]   # position of the bonus
            q, _ = self._draft_forward(reqs, feed, base, [1] * len(rows),
                                       [r.num_generated + draft.num_draft_tokens[b] for b, r in zip(rows, reqs)])
            if self.spec.acceptance == "coupled":
                guess = self._sample_draft(q, reqs, base)        # the target's own race noise: likely the bonus
            else:
                guess = q.argmax(-1).to(torch.int32)             # the draft's most likely bonus
            feed = guess.long()
            active = list(range(len(rows)))
            for j in range(max(k_next)):
                active = [i for i in active if j < k_next[i]]
                sel = torch.tensor(active, dtype=torch.int64).to(dev, non_blocking=True)
                sub = [reqs[i] for i in active]
                seq = [base[i] + 1 + j for i in active]
                q, _ = self._draft_forward(sub, feed.index_select(0, sel),
                                           seq, [1] * len(active),
                                           [reqs[i].num_generated + draft.num_draft_tokens[rows[i]] + 1 + j
                                            for i in active])
                y = self._sample_draft(q, sub, seq)
                out_ids[sel, j] = y
                if out_probs is not None:
                    out_probs[sel, j] = q
                feed = torch.zeros(len(rows), dtype=torch.int64, device=dev)
                feed[sel] = y.long()
        seconds = time.perf_counter() - t0
        return {b: {"guess": guess[i], "ids": out_ids[i, :k_next[i]], "k": k_next[i],
                    "probs": None if out_probs is None else out_probs[i, :k_next[i]],
                    "fed_until": base[i] + k_next[i], "seconds": seconds / len(rows)}
                for i, b in enumerate(rows)}

    # -- verification
    def _verify(self, batch: list[Request], ks: list[int], draft: _Draft):
        dev = self.device
        B = len(batch)
        t0 = time.perf_counter()
        kmax = draft.draft_token_ids.shape[1]
        n = draft.num_draft_tokens
        host_ids, positions, draft_dest, draft_src, logit_rows, seq_lens, query_lens = [], [], [], [], [], [], []
        for b, r in enumerate(batch):
            start = r.target_cached
            L = r.context_len
            pending = r.token_ids[start:]
            base = len(host_ids)
            host_ids += pending + [0] * n[b]
            draft_dest += range(base + len(pending), base + len(pending) + n[b])
            draft_src += range(b * kmax, b * kmax + n[b])
            positions += range(start, L + n[b])
            logit_rows += range(base + len(pending) - 1, base + len(pending) + n[b])
            seq_lens.append(L + n[b])
            query_lens.append(L + n[b] - start)
        input_ids = torch.tensor(host_ids, dtype=torch.int64).to(dev, non_blocking=True)
        if draft_dest:
            src = torch.tensor(draft_src, dtype=torch.int64).to(dev, non_blocking=True)
            dst = torch.tensor(draft_dest, dtype=torch.int64).to(dev, non_blocking=True)
            input_ids[dst] = draft.draft_token_ids.view(-1).index_select(0, src).long()
        meta = AttentionMetadata.build(seq_lens, query_lens, [self.kv.block_table(r.request_id) for r in batch],
                                       self.spec.block_size, dev)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        rows_t = torch.tensor(logit_rows, dtype=torch.int64).to(dev, non_blocking=True)
        logits, _ = self.target(input_ids, pos_t, meta, self.kv["target"], logits_indices=rows_t)  # [R, V]
        counts = [k + 1 for k in n]
        reqs_rows = [r for r, c in zip(batch, counts) for _ in range(c)]
        out_index = [r.num_generated + i for r, c in zip(batch, counts) for i in range(c)]
        self._mask_eos(logits, out_index, reqs_rows)
        # scatter the ragged rows into [B, K+1, V]
        pad_index = torch.tensor([b * (kmax + 1) + i for b, c in enumerate(counts) for i in range(c)],
                                 dtype=torch.int64).to(dev, non_blocking=True)
        n_t = torch.tensor(n, dtype=torch.int32).to(dev, non_blocking=True)
        seeds = torch.tensor([r.seed for r in batch], dtype=torch.int64).to(dev, non_blocking=True)
        first_pos = torch.tensor([r.context_len for r in batch], dtype=torch.int64).to(dev, non_blocking=True)
        if all(r.params.greedy for r in batch):
            tokens, accepted = ops.verify_greedy(self._pad_rows(logits, counts, kmax, pad_index),
                                                 draft.draft_token_ids, n_t, check_values=False)
        else:
            temps, topk, topp = self._param_rows(batch, counts)
            probs = ops.probs_from_logits(logits, temps, topk, topp, check_values=False)    # [R, V]
            padded = self._pad_rows(probs, counts, kmax, pad_index)
            if not self.speculative:
                tokens = ops.sample_tokens(padded[:, 0].contiguous(), seeds, first_pos, purpose="target",
                                           check_values=False)[:, None]
                accepted = torch.zeros(B, dtype=torch.int32, device=dev)
            else:
                tokens, accepted = ops.rejection_sample(padded, draft.draft_probs, draft.draft_token_ids, n_t, seeds,
                                                        first_pos, method=self.spec.acceptance, check_values=False)
        launched = time.perf_counter()
        pre = self._pre_draft(batch, ks, draft)     # overlap: next round's drafts on the draft stream
        pre_s = time.perf_counter() - launched
        guesses = torch.full((B,), -1, dtype=torch.int32, device=dev)
        if pre:
            idx = torch.tensor(list(pre), dtype=torch.int64).to(dev, non_blocking=True)
            guesses[idx] = torch.stack([p["guess"] for p in pre.values()]).to(torch.int32)
        # the one intentional device->host sync of the step
        host = torch.cat([tokens.to(torch.int32), accepted.to(torch.int32)[:, None], guesses[:, None]], 1).cpu()
        verify_s = time.perf_counter() - t0 - (pre_s if dev.type == "cpu" else 0.0)
        self._verify_shape = (sum(query_lens), sum(seq_lens), B, pre_s if dev.type == "cpu" else 0.0)
        for b, p in pre.items():
            p["guess"] = int(host[b, -1])
        return host[:, :-2].tolist(), host[:, -2].tolist(), verify_s, pre

    @staticmethod
    def _pad_rows(rows: torch.Tensor, counts: list[int], kmax: int, pad_index: torch.Tensor) -> torch.Tensor:
        """The ragged [R, V] rows (request b's counts[b] rows in order) as [B, K+1, V]. A row past
        a request's drafts + 1 is never read by the verify kernels, so it is left unwritten
        (no memset of B*(K+1)*V values: at a 32k vocabulary that was ~3 ms a step at batch 16);
        with every request at K+1 rows the view alone."""
        B, V = len(counts), rows.shape[1]
        if all(c == kmax + 1 for c in counts):
            return rows.view(B, kmax + 1, V)
        padded = rows.new_empty(B * (kmax + 1), V)
        padded[pad_index] = rows
        return padded.view(B, kmax + 1, V)

    def _record_costs(self, draft: _Draft, step_s: float) -> None:
        """Feed the cost model: the drafting, and everything else the step cost (planning, the
        verify forward, sampling, bookkeeping) as the verify sample, marked by whether anything
        was drafted (a multi-token verify can cost a jump over a plain decode step)."""
        tokens, context, requests, pre_s = self._verify_shape
        draft_s = self._draft_cost_s(draft) if draft.forwards else draft.seconds
        if draft.forwards:
            self.costs.add_draft(draft.forwards, draft.tokens_fed, draft.attended, draft_s)
        self.costs.add_verify(tokens, context, max(step_s - draft_s - pre_s, 1e-9),
                              drafted=sum(draft.num_draft_tokens) > 0, requests=requests)

    @staticmethod
    def _draft_cost_s(draft: _Draft) -> float:
        """What drafting cost the step: its host time, or on CUDA its device time when longer
        (the host only enqueues; the step's sync has completed the events by now)."""
        if draft.events is None:
            return draft.seconds
        try:
            return max(draft.seconds, draft.events[0].elapsed_time(draft.events[1]) / 1e3)
        except RuntimeError:
            return draft.seconds

    # -- commit
    def _commit(self, batch, draft: _Draft, tokens, accepted, verify_s, pre: dict) -> None:
        mgr = self.kv.manager
        for b, r in enumerate(batch):
            n = draft.num_draft_tokens[b]
            a = int(accepted[b])
            emitted = [int(t) for t in tokens[b][:a + 1]]
            L = r.context_len
            r.target_cached = L + a
            hidden_s = extra_draft_s = 0.0
            if self.draft_kind == "model":
                fed = draft.fed_until[b]
                p = pre.get(b)
                if p is not None:
                    extra_draft_s = p["seconds"]
                    fed = p["fed_until"]
                    self.metrics.record_overlap(used=False)
                    if a == n and emitted[-1] == p["guess"]:   # the assumption held: keep the pre-draft
                        r.policy_state["pre_draft"] = p
                        hidden_s = p["seconds"] if self.device.type == "cuda" else 0.0
                r.draft_cached = fed if "pre_draft" in r.policy_state else min(fed, L + a)
            elif self.draft_kind == "self":
                r.draft_cached = r.target_cached
            surplus = mgr.num_tokens(r.request_id) - max(r.target_cached, r.draft_cached)
            if surplus > 0:
                self.kv.rollback(r.request_id, surplus)
            if self._forced_k is None:     # calibration requests are synthetic: no acceptance evidence
                self.policy.observe(r, n, a)
            share = draft.seconds * (n / max(sum(draft.num_draft_tokens), 1)) + extra_draft_s
            r.stats.record(n, a, len(emitted), share, verify_s / len(batch), hidden_s)
            self.metrics.record_step(r.tag, L, n, a, len(emitted), share, verify_s / len(batch), hidden_s)
            self._append_tokens(r, emitted)
            if r.finished:
                r.policy_state.pop("pre_draft", None)
            else:
                # a lagging draft KV does not hold back the target's prefix sharing: its blocks
                # are registered target-only, and a later request's draft recomputes them
                self.kv.commit(r.request_id, r.token_ids[:r.target_cached],
                               all_caches_upto=r.draft_cached if self.draft_kind == "model" else None)

    def _append_tokens(self, r: Request, emitted: list[int]) -> None:
        p = r.params
        for t in emitted:
            r.output_token_ids.append(t)
            if t in self.eos_token_ids and not p.ignore_eos and r.num_generated >= p.min_tokens:
                self._finish(r, "stop")
                break
            if r.num_generated >= p.max_tokens or r.context_len >= self.max_model_len:
                self._finish(r, "length")
                break
        r.text = self.tokenizer.decode(r.output_token_ids)
        if p.stop and not r.finished:
            for s in p.stop:
                i = r.text.find(s)
                if i >= 0:
                    r.text = r.text[:i]
                    self._finish(r, "stop")
                    break

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(r, reason, error)
        if self.kv.manager.has_request(r.request_id):
            self.kv.free(r.request_id)
        self.metrics.record_finish(reason, len(r.prompt_token_ids))
        self._finished_pending.append(r)

    def _drain_finished(self, exclude=()) -> list[RequestOutput]:
        """Outputs of requests that finished outside the batch (abort, error); forget all finished."""
        outs = []
        for r in self._finished_pending:
            if not any(r is e for e in exclude):
                outs.append(self._output(r, len(r.output_token_ids), len(r.text)))
            self.scheduler.release(r)
        self._finished_pending = []
        return outs

    def _output(self, r: Request, prev_tokens: int, prev_text: int) -> RequestOutput:
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
                             text=r.text, token_ids=list(r.output_token_ids), finished=r.finished,
                             finish_reason=r.finish_reason, metrics=r.stats.summary(),
                             new_token_ids=list(r.output_token_ids[prev_tokens:]), new_text=r.text[prev_text:],
                             error=r.error)


class LLM:
    """The Python API.

        llm = specrt.LLM(target="builtin", draft="builtin", spec=specrt.SpecConfig(max_draft_length=4))
        outs = llm.generate(["def fib(n):"], specrt.SamplingParams(temperature=0, max_tokens=64))
    """

    def __init__(self, target: str | Path = "builtin", draft: str | Path | None = None,
                 spec: SpecConfig | None = None, device=None, dtype=None, seed: int | None = None,
                 tensor_parallel_size: int = 1):
        if tensor_parallel_size != 1:
            # the one upward import: specrt.distributed builds on LLMEngine and spawns the workers
            from specrt.distributed import create_engine

            self.engine = create_engine(target, draft, spec, device, dtype, seed,
                                        tensor_parallel_size=tensor_parallel_size)
        else:
            self.engine = LLMEngine(target, draft, spec, device, dtype, seed)
        self.tokenizer = self.engine.tokenizer

    def _add_all(self, prompts, params, tags) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        tags = tags or ["default"] * len(prompts)
        return [self.engine.add_request(p, sp, tag=t) for p, sp, t in zip(prompts, params, tags)]

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 tags: Sequence[str] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order."""
        ids = self._add_all(prompts, params, tags)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def generate_stream(self, prompts, params=None, tags=None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (with new_token_ids / new_text) each time a request advances."""
        ids = set(self._add_all(prompts, params, tags))
        remaining = set(ids)
        while remaining:
            for out in self.engine.step():
                if out.request_id in ids:
                    yield out
                    if out.finished:
                        remaining.discard(out.request_id)

    def stats(self) -> dict:
        return self.engine.metrics.snapshot()

    def warmup(self, num_requests: int = 4, max_tokens: int = 16) -> None:
        """Run a few short requests so kernels, caches and the cost model settle before serving."""
        prompts = [[1 + (i * 7) % max(self.engine.vocab_size - 1, 1)] * 8 for i in range(num_requests)]
        self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        if self.engine.spec.policy == "budget":
            self.engine.calibrate()
