"""Train a DraftModel (feature or layer draft, reduced head) against the stored sparse teacher.

Objective: KL(teacher || draft) over the draft vocabulary, at temperature 1, on every
position a draft will propose (after the prompt). The teacher's top-k log-probabilities
(specrt.training.teacher) give the exact teacher probability of each top-k token; the
rest of its mass, and its mass on tokens the draft cannot propose, form one "other"
bucket matched against the draft's mass outside the top-k (``sparse_kl``): a proper
divergence on the coarse-grained distribution, zero only when they agree.

Chain drafting is trained as it runs (EAGLE-3's "training-time test"): step j of the
draft at position p reads the feature its own step j-1 predicted at p-1 and attends to
the true-feature keys up to the chain's start p-j plus its own keys of steps 1..j along
the chain (``chain_mask``). A layer draft feeds on tokens only: one step is exact.

Deterministic given the seed: the batch order is a function of (seed, step), so a run
resumed from its checkpoint continues exactly as the uninterrupted run would.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from specrt.models.draft_model import DraftConfig, DraftModel
from specrt.models.rope import rms_norm
from specrt.training.teacher import TeacherShard
from specrt.training.vocab import ReducedVocab


@dataclass
class TrainConfig:
    steps: int = 1000             # optimizer steps (the LR schedule's length unless a budget ends sooner)
    budget_s: float = 0.0         # wall-time budget in seconds (0 = none); the cosine LR follows it too
    lr: float = 5e-4
    warmup: int = 20
    batch_tokens: int = 4096      # padded tokens per batch
    chain_steps: int = 3          # feature drafts: draft positions trained along a chain
    step_decay: float = 0.8       # loss weight of chain step j is step_decay**j
    top1_weight: float = 0.0      # + this x cross-entropy on the teacher's argmax (greedy acceptance's token)
    seed: int = 0
    ckpt_every_s: float = 300.0
    bf16: bool = True             # autocast
    eval_every: int = 0           # steps between held-out evaluations (0 = none); the best is kept
    device: str = "cpu"           # "cpu" (threads) or "cuda[:i]"


@dataclass
class Batch:
    input_ids: torch.Tensor       # [B, T] int64 (0-padded)
    features: torch.Tensor | None  # [B, T, H] the feature of each row's previous position (0 at 0)
    loss_mask: torch.Tensor       # [B, T] bool, positions whose next token a draft proposes
    topk_ids: torch.Tensor        # [B, T, k] int64 target ids
    topk_logprobs: torch.Tensor   # [B, T, k] float32


# ----------------------------------------------------------------------------- init
def draft_config_for(target_config, kind: str, num_layers: int, vocab: ReducedVocab, extra: dict,
                     feature_layers: tuple[int, ...] | None = None) -> DraftConfig:
    from specrt.models.config import ModelConfig

    raw = dict(target_config.extra)
    raw.update(num_hidden_layers=num_layers, architectures=["LlamaForCausalLM"])
    return DraftConfig(kind=kind, layer_config=ModelConfig.from_json(raw), draft_vocab_size=vocab.size,
                       target_vocab_size=target_config.vocab_size, target_hidden_size=target_config.hidden_size,
                       extra=dict(extra), feature_layers=feature_layers)


def init_draft(target, kind: str, layers: list[int], vocab: ReducedVocab, fc_init: str = "embed",
               feature_layers: tuple[int, ...] | None = None) -> DraftModel:
    """A draft whose layer j is a copy of target layer ``layers[j]`` and whose norm is the target's
    final norm. A feature draft's fc starts as [I, 0] (``fc_init="embed"``: exactly the layer draft
    of the same layers, which then learns to read the features) or [I, I] ("sum"). With
    ``feature_layers`` (EAGLE-3) its fuse starts by passing the final-normed state through
    (``init_fuse``)."""
    if feature_layers is not None and kind != "feature":
        raise ValueError("feature_layers is for feature drafts")
    if fc_init not in ("embed", "sum"):
        raise ValueError(f"fc_init must be 'embed' or 'sum', got {fc_init!r}")
    L = target.config.num_layers
    if not layers or any(not 0 <= i < L for i in layers):
        raise ValueError(f"layers {layers} must be a non-empty list of target layer indices in [0, {L})")
    cfg = draft_config_for(target.config, kind, len(layers), vocab,
                           {"init": {"target_layers": list(layers), "fc": fc_init if kind == "feature" else None}},
                           None if feature_layers is None else tuple(int(i) for i in feature_layers))
    if feature_layers is not None:
        if len(feature_layers) < 2 or any(not 0 <= int(i) <= L for i in feature_layers):
            raise ValueError(f"feature_layers {tuple(feature_layers)} must be >= 2 target layer indices in "
                             f"[0, {L}] ({L} = the final-normed state)")
        cfg.target_num_layers = L
    draft = DraftModel(cfg, vocab.draft_to_target)
    for j, i in enumerate(layers):
        src = {k: v.detach().clone().float() for k, v in target.model.layers[i].state_dict().items()}
        draft.layers[j].load_state_dict(src)
    draft.norm.weight.data.copy_(target.model.norm.weight.detach().float())
    if draft.fc is not None:
        H = cfg.hidden_size
        with torch.no_grad():
            draft.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H) * (fc_init == "sum")], 1))
    if draft.fuse is not None:
        init_fuse(draft, L)
    draft.float().bind_target(target.model.embed_tokens.weight)
    return draft


def init_fuse(draft: DraftModel, num_target_layers: int) -> None:
    """fuse [H, k H]: identity on the final-normed block (index num_target_layers), zero on the
    other layers' blocks (their gradient g x^T does not need a non-zero start): the draft starts
    as exactly the single-feature draft and learns what the lower layers add."""
    H, Ht = draft.config.hidden_size, draft.config.target_hidden_size
    with torch.no_grad():
        w = torch.zeros(H, draft.fuse.in_features)
        for j, li in enumerate(draft.config.feature_layers):
            if li == num_target_layers and H == Ht:
                w[:, j * Ht:(j + 1) * Ht] = torch.eye(H)
        draft.fuse.weight.copy_(w)


# ----------------------------------------------------------------------------- data
def make_batches(store: TeacherShard, batch_tokens: int, seed: int) -> list[list[int]]:
    """Sequences packed into batches of at most ``batch_tokens`` padded tokens (similar lengths together)."""
    lens = (store.offsets[1:] - store.offsets[:-1]).tolist()
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(lens), generator=g).tolist()
    batches: list[list[int]] = []
    for c in range(0, len(perm), 64):  # sort within chunks: little padding, still shuffled
        chunk = sorted(perm[c:c + 64], key=lambda s: lens[s])
        cur: list[int] = []
        for s in chunk:
            if cur and (len(cur) + 1) * max(lens[t] for t in cur + [s]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(s)
        if cur:
            batches.append(cur)
    return batches


def batch_at(batches: list[list[int]], step: int, seed: int) -> list[int]:
    """The batch of optimizer step ``step``: epoch e visits the batches in permutation (seed, e)."""
    e, i = divmod(step, len(batches))
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed * 7919 + e + 1))
    return batches[int(order[i])]


def collate(store: TeacherShard, seqs: list[int], feature: bool) -> Batch:
    """Sequences ``seqs`` of a TeacherShard or teacher_store.TeacherStore, 0-padded to one length."""
    rows = [store.sequence_rows(s) for s in seqs]
    T = max(r[0].shape[0] for r in rows)
    B, k = len(seqs), rows[0][1].shape[1]
    ids = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    top_ids = torch.zeros(B, T, k, dtype=torch.int64)
    top_lp = torch.full((B, T, k), -30.0)
    feats = torch.zeros(B, T, store.feature_width) if feature else None
    for b, (s, (tok, tid, tlp, f)) in enumerate(zip(seqs, rows)):
        n = tok.shape[0]
        ids[b, :n] = tok.long()
        mask[b, max(int(store.prompt_lens[s]) - 1, 0):n] = True
        top_ids[b, :n] = tid.long()
        top_lp[b, :n] = tlp.float()
        if feature:
            feats[b, 1:n] = f[:-1].float()
    return Batch(ids, feats, mask, top_ids, top_lp)


# ----------------------------------------------------------------------------- loss
def sparse_kl(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
              target_to_draft: torch.Tensor, top1_weight: float = 0.0) -> torch.Tensor:
    """Per-row KL(teacher || draft) [M] on buckets {top-k tokens the draft covers} + {other};
    with ``top1_weight`` w, plus w x -log q(teacher's argmax) where the draft covers it.

    logits [M, N] draft; topk_ids [M, k] target ids (descending); topk_logprobs [M, k]
    (full-vocabulary normalised); target_to_draft [V] (-1 = not in the draft vocabulary)."""
    lq = torch.log_softmax(logits.float(), -1)  # [M, N]
    d = target_to_draft[topk_ids]  # [M, k]
    cov = d >= 0
    p = topk_logprobs.exp() * cov  # teacher mass on covered top-k tokens
    lq_top = lq.gather(1, d.clamp(min=0))  # [M, k]
    p_other = (1.0 - p.sum(-1)).clamp(min=1e-6)
    q_other = (1.0 - (lq_top.exp() * cov).sum(-1)).clamp(min=1e-6)
    kl_top = (p * (topk_logprobs - lq_top)).sum(-1)
    kl = kl_top + p_other * (p_other.log() - q_other.log())
    if top1_weight:
        kl = kl - top1_weight * lq_top[:, 0] * cov[:, 0]
    return kl


def chain_mask(T: int, j: int, device=None) -> torch.Tensor:
    """[T, (j+1) T] bool: at chain step j (0-based) query p attends to step-0 keys 0..p-j and to
    the key of step m (1..j) at position p-j+m: the keys the draft wrote along its own chain."""
    p = torch.arange(T, device=device)
    parts = [torch.arange(T, device=device)[None, :] <= (p - j)[:, None]]
    for m in range(1, j + 1):
        parts.append(torch.arange(T, device=device)[None, :] == (p - j + m)[:, None])
    return torch.cat(parts, 1)


def chain_states(draft: DraftModel, input_ids: torch.Tensor, features: torch.Tensor | None,
                 steps: int) -> list[torch.Tensor]:
    """Final-normed states [B, T, H] of chain steps 0..steps-1 (teacher-forced tokens; see module doc)."""
    B, T = input_ids.shape
    emb = F.embedding(input_ids, draft.embed)
    cos, sin = draft.dense_rope(T, torch.float32, emb.device)
    if draft.fc is None:
        steps = 1
    past: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in draft.layers]
    out, f = [], features
    for j in range(steps):
        x = emb if draft.fc is None else draft.mix(emb, f)  # step 0: the target's (fused) features
        mask = None if j == 0 else chain_mask(T, j, emb.device)
        for i in range(len(draft.layers)):
            x, kv = draft.dense_layer(i, x, cos, sin, past[i], mask)
            past[i].append(kv)
        h = rms_norm(x, draft.norm.weight, draft.norm.eps)
        out.append(h)
        f = F.pad(h[:, :-1], (0, 0, 1, 0))  # the next step reads the state of the previous position
    return out


def batch_loss(draft: DraftModel, batch: Batch, t2d: torch.Tensor, steps: int, decay: float,
               top1_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """Weighted mean sparse KL (+ top-1 term) over chain steps; also each step's mean."""
    states = chain_states(draft, batch.input_ids, batch.features, steps)
    total, wsum, per_step = 0.0, 0.0, []
    T = batch.input_ids.shape[1]
    for j, h in enumerate(states):
        start_ok = torch.arange(T, device=batch.loss_mask.device) >= j  # a chain of j+1 drafts needs a start
        rows = batch.loss_mask & start_ok[None, :]
        if not rows.any():
            continue
        kl = sparse_kl(draft.logits(h[rows]), batch.topk_ids[rows], batch.topk_logprobs[rows], t2d,
                       top1_weight).mean()
        total = total + decay ** j * kl
        wsum += decay ** j
        per_step.append(float(kl.detach()))
    return total / max(wsum, 1e-9), per_step


# ----------------------------------------------------------------------------- loop
def _lr(cfg: TrainConfig, step: int, frac: float) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _save_ckpt(path: str, draft: DraftModel, opt, step: int, elapsed: float, cfg: TrainConfig, hist,
               positions: int, best: dict | None) -> None:
    tmp = path + ".tmp"
    torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                "config": asdict(cfg), "history": hist, "positions": positions, "best": best}, tmp)
    os.replace(tmp, path)


def _score(result: dict) -> float:
    return float(result["tau"])


def train_draft(draft: DraftModel, store: TeacherShard, vocab: ReducedVocab, cfg: TrainConfig,
                ckpt_path: str | None = None, log=print, stop_at: int | None = None,
                evaluate: Callable[[DraftModel], dict] | None = None) -> dict:
    """Train in place; resumes from ``ckpt_path`` when it exists (model, optimizer, step, the data
    cursor is a function of the step); ``stop_at`` ends this run at that step (checkpointed, the
    schedule still spans ``cfg.steps``). ``evaluate`` (held-out acceptance, a dict with "tau") runs
    every ``cfg.eval_every`` steps and at the end; the best weights it saw are what the draft
    keeps. Returns a summary dict."""
    from tqdm import tqdm

    feature = draft.config.kind == "feature"
    if feature and store.feature_width is None:
        raise ValueError("a feature draft needs teacher features (build the store without --no-features)")
    if feature and store.feature_width != draft.config.feature_size:
        raise ValueError(f"teacher features are {store.feature_width} wide, the draft reads "
                         f"{draft.config.feature_size} (feature_layers {draft.config.feature_layers})")
    dev = torch.device(cfg.device)
    draft.to(dev)
    t2d = vocab.target_to_draft.to(dev)
    batches = make_batches(store, cfg.batch_tokens, cfg.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, elapsed, hist, positions, best = 0, 0.0, [], 0, None
    if ckpt_path and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        held = ck["model"].get("draft_to_target")
        if held is not None and not torch.equal(held.cpu(), vocab.draft_to_target.cpu()):
            raise ValueError(f"{ckpt_path} was trained with another draft vocabulary than this run's (the data "
                             f"changed): resume with the same data, or start a new --work with --init-from")
        draft.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed, hist = ck["step"], ck["elapsed"], ck["history"]
        positions, best = ck.get("positions", 0), ck.get("best")
        log(f"resumed from {ckpt_path} at step {step} ({elapsed:.0f}s trained, {positions} positions)")
    budget = cfg.budget_s or float("inf")
    t0, last_ckpt = time.time() - elapsed, time.time()

    def run_eval() -> None:
        nonlocal best
        draft.eval()
        result = evaluate(draft)
        draft.train()
        hist.append({"step": step, "positions": positions, "seconds": round(time.time() - t0, 1),
                     "heldout": result})
        better = best is None or _score(result) > best["score"]
        if better:
            best = {"score": _score(result), "step": step, "result": result,
                    "model": {k: v.detach().cpu().clone() for k, v in draft.state_dict().items()}}
        log(f"step {step} ({positions} positions): held-out tau {_score(result):.4f} "
            f"{result.get('acceptance_per_position')}{' (best)' if better else ''}")

    draft.train()
    ema = None
    pbar = tqdm(total=cfg.steps, initial=step, desc=f"distill[{draft.config.kind}]", mininterval=10)
    tokens, run_t0 = 0, time.time()
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    if evaluate is not None and best is None:
        run_eval()  # the starting point (a warm start's acceptance) is the bar to beat
    auto = dev.type if dev.type in ("cpu", "cuda") else "cpu"
    while step < end and time.time() - t0 < budget:
        frac = max(step / cfg.steps, (time.time() - t0) / budget)
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step, frac)
        batch = to_device(collate(store, batch_at(batches, step, cfg.seed), feature), dev)
        with torch.autocast(auto, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, per_step = batch_loss(draft, batch, t2d, cfg.chain_steps, cfg.step_decay, cfg.top1_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        n_pos = int(batch.loss_mask.sum())
        tokens += n_pos
        positions += n_pos
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        pbar.update(1)
        left = {} if budget == float("inf") else {"left": f"{max(budget - (time.time() - t0), 0) / 60:.0f}min"}
        pbar.set_postfix(kl=f"{ema:.3f}", steps="/".join(f"{x:.2f}" for x in per_step),
                         pos_s=f"{tokens / max(time.time() - run_t0, 1e-9):.0f}", **left, refresh=False)
        if step % 25 == 0:
            hist.append({"step": step, "positions": positions, "kl_ema": round(ema, 4),
                         "kl_steps": [round(x, 4) for x in per_step], "seconds": round(time.time() - t0, 1)})
        if evaluate is not None and cfg.eval_every and step % cfg.eval_every == 0:
            run_eval()
        if ckpt_path and time.time() - last_ckpt > cfg.ckpt_every_s:
            _save_ckpt(ckpt_path, draft, opt, step, time.time() - t0, cfg, hist, positions, best)
            last_ckpt = time.time()
    pbar.close()
    if evaluate is not None and (not hist or hist[-1].get("step") != step or "heldout" not in hist[-1]):
        run_eval()
    if ckpt_path:
        _save_ckpt(ckpt_path, draft, opt, step, time.time() - t0, cfg, hist, positions, best)
    if best is not None and best["step"] != step:
        draft.load_state_dict(best["model"])
        log(f"keeping the weights of step {best['step']} (held-out tau {best['score']:.4f})")
    draft.eval()
    return {"steps": step, "train_seconds": round(time.time() - t0, 1), "loss_positions_this_run": tokens,
            "positions_trained": positions,
            "positions_per_s": round(tokens / max(time.time() - run_t0, 1e-9), 1),
            "kl_ema": None if ema is None else round(ema, 4), "history": hist, "config": asdict(cfg),
            "best": None if best is None else {"step": best["step"], "heldout": best["result"]}}


def to_device(batch: Batch, dev: torch.device) -> Batch:
    """The batch on ``dev`` (the same object on the CPU)."""
    if dev.type == "cpu":
        return batch
    return Batch(*(None if t is None else t.to(dev, non_blocking=True) for t in
                   (batch.input_ids, batch.features, batch.loss_mask, batch.topk_ids, batch.topk_logprobs)))
