"""Offline evaluation of a DraftModel: chain acceptance on held-out text, step cost, implied speedup.

    python -m specrt.training.draft_eval --target DIR --heldout /work/ckpt/data/heldout_teacher \
        --draft DRAFT_DIR [--draft OTHER] --json out.json

Acceptance is measured teacher-forced on held-out sequences the target generated (greedy)
from the held-out prompts: a chain started at position s (the first position whose
feature the target verified) drafts K tokens exactly as the engine would along an
accepted path (feature drafts read their own predicted features after the first step,
``chain_states``); draft j is accepted greedily when drafts 0..j all equal the target's
argmax. ``acceptance_per_position[j]`` is the share of chains whose first j+1 drafts were
all accepted, so tau = 1 + sum_j acceptance_per_position[j] is the expected number of tokens
per target forward at K when chains start at every position. Greedy decoding starts them only
after each step's bonus token, which lands more often in the stretches the draft gets wrong:
``decoding_tau`` walks the sequence that way (start at the prompt's end, advance by the accepted
drafts + 1) and is what the engine's tokens per target forward come to. At temperature T, alpha = sum_v min(p_T, q_T) per step (teacher
top-k renormalised at T) and the expected accepted length is sum_j prod_{i<=j} alpha_i.

Step cost c = (draft forward, 1 token) / (target forward, 1 token) and verify overhead
v = (target forward, K+1 tokens) / (target forward, 1 token) - 1, timed alternately in one
process through the paged KV cache at a ``--context``-token context; the implied speedup
is tau / (1 + c K + v).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specrt.training.draft_train import chain_states, collate, to_device


@torch.no_grad()
def chain_acceptance(draft, store, k: int = 4, temperature: float = 0.7, batch: int = 8) -> dict:
    """Greedy per-position acceptance and sampled (temperature) expected accepted length at K=k."""
    from specrt.training.vocab import ReducedVocab

    vocab = ReducedVocab.from_map(draft.draft_to_target.cpu(), draft.config.target_vocab_size)
    feature = draft.config.kind == "feature"
    runs, exp_len, top1_cov, n_starts = torch.zeros(k), 0.0, 0.0, 0
    walk, n_walk = torch.zeros(k), 0       # the decoding walk's chains (see below)
    for i in range(0, store.num_sequences, batch):
        seqs = list(range(i, min(i + batch, store.num_sequences)))
        b = collate(store, seqs, feature)
        on = to_device(b, draft.norm.weight.device)  # a CUDA draft evaluates there
        states = chain_states(draft, on.input_ids, on.features, k if feature else 1)
        states = states + [states[0]] * (k - len(states))  # a layer draft's steps are all step 0
        match, alpha = [], []
        t2d = vocab.target_to_draft.to(on.input_ids.device)
        for h in states:
            logits = draft.logits(h).float()  # [B, T, N]
            match.append((draft.draft_to_target[logits.argmax(-1)] == on.topk_ids[..., 0]).cpu())
            alpha.append(_alpha(logits, on.topk_ids, on.topk_logprobs, t2d, temperature).cpu())
        B, T = b.input_ids.shape
        for r, s in enumerate(seqs):
            n = int(store.offsets[s + 1] - store.offsets[s])
            starts = torch.arange(int(store.prompt_lens[s]), n - k + 1)
            if starts.numel() == 0:
                continue
            alive, a_prod = torch.ones(starts.numel(), dtype=torch.bool), torch.ones(starts.numel())
            for j in range(k):
                alive = alive & match[j][r, starts + j]
                runs[j] += alive.float().sum()
                a_prod = a_prod * alpha[j][r, starts + j]
                exp_len += float(a_prod.sum())
            top1_cov += float((vocab.target_to_draft[b.topk_ids[r, starts, 0]] >= 0).float().sum())
            n_starts += starts.numel()
            counts, chains = decoding_walk(torch.stack([m[r] for m in match]).tolist(), int(store.prompt_lens[s]), n)
            walk += torch.tensor(counts, dtype=walk.dtype)
            n_walk += chains
    per_pos = (runs / max(n_starts, 1)).tolist()
    walked = (walk / max(n_walk, 1)).tolist()
    return {"k": k, "chains": n_starts, "acceptance_per_position": [round(x, 4) for x in per_pos],
            "tau": round(1 + sum(per_pos), 4),
            "decoding_acceptance_per_position": [round(x, 4) for x in walked],
            "decoding_tau": round(1 + sum(walked), 4), "temperature": temperature,
            "sampled_accepted_len": round(exp_len / max(n_starts, 1), 4),
            "sampled_tau": round(1 + exp_len / max(n_starts, 1), 4),
            "target_top1_in_draft_vocab": round(top1_cov / max(n_starts, 1), 4)}


def decoding_walk(ok: list[list[bool]], start: int, n: int) -> tuple[list[int], int]:
    """Greedy decoding's chains over one sequence of n positions: ``ok[j][q]`` whether a chain's
    draft j is right at index q (the chain started at q - j, drafts 0..j-1 right). The first chain starts at
    ``start``, each next one after the last one's accepted drafts and the bonus token. Returns
    (chains whose drafts 0..j were all accepted, per j; chains)."""
    k = len(ok)
    counts, chains, pos = [0] * k, 0, start
    while pos <= n - k:
        a = 0
        while a < k and ok[a][pos + a]:
            counts[a] += 1
            a += 1
        chains += 1
        pos += a + 1
    return counts, chains


def _alpha(logits, topk_ids, topk_logprobs, t2d, temperature: float) -> torch.Tensor:
    """sum_v min(p_T(v), q_T(v)) [B, T]: p_T from the teacher's top-k renormalised at T."""
    p = torch.softmax(topk_logprobs.float() / temperature, -1)  # [B, T, k]
    q = torch.softmax(logits / temperature, -1)  # [B, T, N]
    d = t2d[topk_ids]
    qk = q.gather(-1, d.clamp(min=0)) * (d >= 0)
    return torch.minimum(p, qk).sum(-1)


# ----------------------------------------------------------------------------- step cost
@torch.no_grad()
def step_costs(target, drafts: dict, context: int = 192, k: int = 4, repeats: int = 25) -> dict:
    """Median seconds of target 1-token and (k+1)-token forwards and each draft's 1-token forward,
    measured alternately at ``context`` cached tokens; returns ratios c and v per draft."""
    from specrt.models.kv_cache import AttentionMetadata, allocate_kv_cache

    bs, n = 16, context + k + 1
    table = [list(range(-(-n // bs)))]
    dev, H = target.device, target.config.hidden_size
    tcache = allocate_kv_cache(target.config, len(table[0]), bs, target.dtype, dev)
    ids = torch.randint(3, target.config.vocab_size, (n,), device=dev)
    target(ids[:context], torch.arange(context), AttentionMetadata.build([context], [context], table, bs), tcache)
    dcaches = {name: allocate_kv_cache(d.lm_config, len(table[0]), bs, target.dtype, dev) for name, d in drafts.items()}

    def t_fwd(q):
        meta = AttentionMetadata.build([context + q], [q], table, bs)
        return lambda: target(ids[context:context + q], torch.arange(context, context + q), meta, tcache,
                              logits_indices=torch.arange(q))

    def d_fwd(name, d):
        meta = AttentionMetadata.build([context + 1], [1], table, bs)
        feats = torch.randn(1, H, dtype=target.dtype) if d.config.kind == "feature" else None
        return lambda: d(ids[context:context + 1], torch.tensor([context]), meta, dcaches[name], features=feats)

    fns = {"target_1": t_fwd(1), f"target_{k + 1}": t_fwd(k + 1)}
    fns.update({f"draft:{name}": d_fwd(name, d) for name, d in drafts.items()})
    times = {name: [] for name in fns}
    for r in range(repeats + 3):
        for name, fn in fns.items():  # alternate: every function sees the same machine state
            t0 = time.perf_counter()
            fn()
            if r >= 3:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    out = {"median_ms": {name: round(v * 1e3, 3) for name, v in med.items()},
           "v": round(med[f"target_{k + 1}"] / med["target_1"] - 1, 4), "c": {}}
    for name in drafts:
        out["c"][name] = round(med[f"draft:{name}"] / med["target_1"], 4)
    return out


def implied_speedup(tau: float, c: float, v: float, k: int) -> float:
    return tau / (1 + c * k + v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.draft_eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--heldout", required=True, help="teacher store of the held-out sequences")
    ap.add_argument("--draft", action="append", required=True, help="draft folder(s)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from specrt.models import load_model
    from specrt.models.draft_model import DraftModel
    from specrt.training.teacher import load_teacher

    store = load_teacher(args.heldout)
    report: dict = {"acceptance": {}, "cost": {}}
    torch.set_num_threads(2)
    target = load_model(args.target, dtype=torch.float32)
    for path in args.draft:
        d = DraftModel.from_pretrained(path, target)
        report["acceptance"][path] = chain_acceptance(d, store, args.k, args.temperature)
        print(path, json.dumps(report["acceptance"][path]), flush=True)
    torch.set_num_threads(1)
    for dt in args.dtypes.split(","):
        target = load_model(args.target, dtype=dt)
        drafts = {p: DraftModel.from_pretrained(p, target, dtype=target.dtype) for p in args.draft}
        report["cost"][dt] = cost = step_costs(target, drafts, args.context, args.k, args.repeats)
        print(dt, json.dumps(cost), flush=True)
        for p in args.draft:
            acc = report["acceptance"][p]
            cost.setdefault("implied_speedup", {})[p] = {
                "greedy": round(implied_speedup(acc["tau"], cost["c"][p], cost["v"], args.k), 3),
                f"T={args.temperature}": round(implied_speedup(acc["sampled_tau"], cost["c"][p], cost["v"], args.k), 3)}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
