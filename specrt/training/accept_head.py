"""Train the acceptance-prediction head (``specrt.models.accept_head``) for a draft.

    python -m specrt.training.accept_head --target ckpt/target/hf --draft ckpt/draft_layerinit/hf \
        --out ckpt/draft_layerinit/hf/accept_head

Outcome log: the draft proposes on training-corpus windows and on cached on-policy
target samples (teacher forced: the proposal at each position is the draft's
argmax given the true prefix, as in speculative decoding after an accepted
prefix). Each position gives (draft final normed hidden state, draft probability
of its token, accepted?) with accepted = draft argmax == target argmax (greedy
acceptance); ``--label sampled`` instead uses the exact T=1 acceptance
probability of the draft's argmax token, min(1, p(x)/q(x)), as a soft label.
The head is evaluated on the held-out modules: AUC, expected calibration error
(10 bins) and, for comparison, the AUC of the draft probability alone (what the
``confidence`` policy uses).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from specrt.models.accept_head import AcceptanceHead
from specrt.training.distill import load_hf
from specrt.training.pretrain import encode_split, eval_windows, random_windows


@torch.no_grad()
def log_outcomes(target, draft, x: torch.Tensor, label: str = "greedy", batch: int = 8):
    """x [N, T] -> hidden [N*T, H], draft_prob [N*T], label [N*T] (float 0..1)."""
    hs, qs, ys = [], [], []
    for i in range(0, x.shape[0], batch):
        xb = x[i:i + batch]
        h = draft.model(input_ids=xb, use_cache=False).last_hidden_state  # [b, T, H] (after final norm)
        d_logits = draft.lm_head(h).float()
        t_logits = target(input_ids=xb, use_cache=False).logits.float()
        q = d_logits.softmax(-1)
        q_tok, tok = q.max(-1)  # [b, T]
        if label == "greedy":
            y = (tok == t_logits.argmax(-1)).float()
        else:
            p_tok = t_logits.softmax(-1).gather(-1, tok[..., None]).squeeze(-1)
            y = (p_tok / q_tok).clamp(max=1.0)
        hs.append(h.reshape(-1, h.shape[-1]))
        qs.append(q_tok.reshape(-1))
        ys.append(y.reshape(-1))
    return torch.cat(hs), torch.cat(qs), torch.cat(ys)


def auc(score: torch.Tensor, y: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U), y in {0, 1}; ties get average ranks."""
    y = y > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = score.argsort()
    ranks = torch.empty_like(score, dtype=torch.float64)
    ranks[order] = torch.arange(1, score.numel() + 1, dtype=torch.float64)
    s_sorted = score[order]
    # average ranks over ties
    uniq, inv, counts = torch.unique_consecutive(s_sorted, return_inverse=True, return_counts=True)
    if counts.max() > 1:
        r_sorted = ranks[order]
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, r_sorted)
        ranks[order] = (sums / counts.double())[inv]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def ece(p: torch.Tensor, y: torch.Tensor, bins: int = 10) -> float:
    idx = (p * bins).long().clamp(max=bins - 1)
    err = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            err += m.float().mean().item() * abs(p[m].mean().item() - y[m].float().mean().item())
    return err


def train_head(h, q, y, epochs: int = 4, lr: float = 2e-3, width: int = 128, batch: int = 512, seed: int = 0,
               use_prob: bool = True):
    torch.manual_seed(seed)
    head = AcceptanceHead(h.shape[1], width=width, use_prob=use_prob)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    n = h.shape[0]
    steps = epochs * ((n + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    head.train()
    for _ in range(epochs):
        perm = torch.randperm(n)
        for i in range(0, n, batch):
            j = perm[i:i + batch]
            loss = F.binary_cross_entropy_with_logits(head.logits(h[j], q[j]), y[j])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return head.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.accept_head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="ckpt/target/hf")
    ap.add_argument("--draft", default="ckpt/draft_layerinit/hf")
    ap.add_argument("--out", default=None, help="default: <draft>/accept_head")
    ap.add_argument("--onpolicy", default="ckpt/onpolicy.pt")
    ap.add_argument("--train-windows", type=int, default=96, help="corpus windows of --seq-len tokens")
    ap.add_argument("--onpolicy-windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--label", choices=["greedy", "sampled"], default="greedy")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--no-prob", action="store_true",
                    help="hidden state only (ignore draft_prob): robust when the engine passes the "
                         "post-sampling probability, which is 1.0 under greedy decoding")
    ap.add_argument("--cache-dir", default="ckpt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or os.path.join(args.draft, "accept_head")
    t0 = time.time()
    target, draft = load_hf(args.target), load_hf(args.draft)
    train = encode_split(args.draft, "train", args.cache_dir)
    gen = torch.Generator().manual_seed(args.seed + 7)
    xs = [random_windows(train, args.train_windows, args.seq_len - 1, gen)]
    if args.onpolicy and os.path.exists(args.onpolicy) and args.onpolicy_windows:
        onp = torch.load(args.onpolicy)
        xs.append(onp[torch.randperm(onp.shape[0], generator=gen)[: args.onpolicy_windows], : args.seq_len].long())
    h, q, y = log_outcomes(target, draft, torch.cat(xs), args.label)
    held = eval_windows(encode_split(args.draft, "eval"), args.seq_len)[:, :-1]
    he, qe, ye = log_outcomes(target, draft, held, "greedy")
    print(f"logged {h.shape[0]} train outcomes (accept rate {y.mean():.3f}), "
          f"{he.shape[0]} held-out ({ye.mean():.3f}) in {time.time() - t0:.0f}s", flush=True)
    head = train_head(h, q, y, args.epochs, width=args.width, seed=args.seed, use_prob=not args.no_prob)
    with torch.no_grad():
        pe = head(he, qe)
        pt = head(h[:20000], q[:20000])
    metrics = {
        "label": args.label, "use_prob": not args.no_prob, "train_outcomes": int(h.shape[0]), "heldout_outcomes": int(he.shape[0]),
        "heldout_accept_rate": round(ye.mean().item(), 4),
        "heldout_auc": round(auc(pe, ye), 4),
        "heldout_auc_draft_prob_only": round(auc(qe, ye), 4),
        "heldout_ece": round(ece(pe, ye), 4),
        "heldout_ece_draft_prob_only": round(ece(qe, ye), 4),
        "heldout_brier": round(((pe - ye) ** 2).mean().item(), 4),
        "train_auc": round(auc(pt, (y[:20000] > 0.5).float()), 4),
        "draft": args.draft,
    }
    head.metrics = metrics
    head.save(out)
    print(json.dumps(metrics), f"-> {out} ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
