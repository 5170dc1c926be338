"""Evaluate a target (held-out loss) and drafts (acceptance, int8 trade-off).

    python -m specrt.training.evaluate --target specrt/builtin/target \
        --draft specrt/builtin/draft [--draft ckpt/draft_scratch/hf] [--int8] [--json out.json]

All numbers are on the held-out modules (``specrt.training.corpus.HELD_OUT_MODULES``):

- ``heldout_loss``: target cross-entropy, nats/token, non-overlapping 512-token windows.
- greedy (T=0):
  ``match_rate`` = fraction of held-out text positions where draft argmax == target argmax;
  on the target's own greedy continuations of held-out prompts (teacher forced, which is
  exactly what speculative greedy decoding sees): ``match_rate_cont``,
  ``accepted_len_k4`` = mean over start positions of the number of consecutive accepted
  draft tokens (capped at K=4), and ``tokens_per_step_k4`` = tokens emitted per target
  forward when decoding the continuation with K=4 drafts.
- sampled (T=1): ``alpha`` = mean over positions of sum_v min(p_v, q_v) (the
  acceptance probability of rejection sampling), and ``accepted_len_k4`` =
  mean of sum_{k=1..4} prod_{j<k} alpha_{t+j} (expected accepted draft tokens).
- ``--int8``: the same for the int8-quantised draft plus forward time of one
  decode step (batch 1 and 8, 128 cached tokens) vs the full-precision draft.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from specrt.training.distill import load_hf
from specrt.training.pretrain import EOS_ID, encode_split, eval_windows, heldout_loss


@torch.no_grad()
def logits_of(model, x: torch.Tensor, batch: int = 8) -> torch.Tensor:
    out = [model(input_ids=x[i:i + batch], use_cache=False).logits.float() for i in range(0, x.shape[0], batch)]
    return torch.cat(out)  # [N, T, V]


def accepted_runs(match: torch.Tensor, k: int) -> torch.Tensor:
    """match [N, T] bool -> [N, T] number of consecutive True starting at t, capped at k."""
    n, t = match.shape
    m = torch.cat([match, torch.zeros(n, k, dtype=torch.bool)], 1).long()
    run = torch.zeros(n, t, dtype=torch.long)
    alive = torch.ones(n, t, dtype=torch.long)
    for j in range(k):
        alive = alive * m[:, j:j + t]
        run += alive
    return run


def tokens_per_step(match_row: torch.Tensor, k: int) -> float:
    """Greedy speculative decoding along one sequence: tokens emitted per target forward."""
    i, steps, n = 0, 0, match_row.numel()
    while i < n:
        a = 0
        while a < k and i + a < n and bool(match_row[i + a]):
            a += 1
        steps += 1
        i += a + 1
    return n / max(steps, 1)


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=EOS_ID)
    return seqs  # [N, P + new_tokens]


@torch.no_grad()
def acceptance(t_logits: torch.Tensor, d_logits: torch.Tensor, k: int = 4) -> dict:
    """Teacher-forced acceptance statistics from aligned logits [N, T, V]."""
    match = t_logits.argmax(-1) == d_logits.argmax(-1)  # [N, T]
    p, q = t_logits.softmax(-1), d_logits.softmax(-1)
    alpha = torch.minimum(p, q).sum(-1)  # [N, T]
    n, t = alpha.shape
    a = torch.cat([alpha, torch.zeros(n, k)], 1)
    exp_len, prod = torch.zeros(n, t), torch.ones(n, t)
    for j in range(k):
        prod = prod * a[:, j:j + t]
        exp_len += prod
    valid = slice(0, t - k)  # positions with a full K-token window
    return {"match_rate": match.float().mean().item(),
            "greedy_accepted_len_k4": accepted_runs(match, k)[:, valid].float().mean().item(),
            "alpha": alpha.mean().item(),
            "sampled_accepted_len_k4": exp_len[:, valid].mean().item()}


def heldout_prompts(held: torch.Tensor, n: int, prompt_len: int) -> torch.Tensor:
    starts = torch.linspace(0, held.numel() - prompt_len - 300, n).long()
    return torch.stack([held[s:s + prompt_len] for s in starts]).long()


@torch.no_grad()
def draft_report(target, draft, text_windows, cont, prompt_len: int, t_text=None, t_cont=None, k: int = 4) -> dict:
    t_text = logits_of(target, text_windows) if t_text is None else t_text
    t_cont = logits_of(target, cont) if t_cont is None else t_cont
    d_text, d_cont = logits_of(draft, text_windows), logits_of(draft, cont)
    text = acceptance(t_text, d_text, k)
    # Continuation positions: logits at p-1 .. end-1 predict the generated tokens.
    tc, dc = t_cont[:, prompt_len - 1:-1], d_cont[:, prompt_len - 1:-1]
    match_c = tc.argmax(-1) == dc.argmax(-1)
    return {
        "heldout_text": text,
        "greedy_continuation": {
            "match_rate_cont": match_c.float().mean().item(),
            "accepted_len_k4": accepted_runs(match_c, k)[:, :-k].float().mean().item(),
            "tokens_per_step_k4": sum(tokens_per_step(r, k) for r in match_c) / match_c.shape[0],
        },
    }


@torch.no_grad()
def decode_step_ms(model, batch: int, ctx: int = 128, iters: int = 30) -> float:
    from transformers import DynamicCache
    x = torch.randint(1, model.config.vocab_size, (batch, ctx))
    out = model(input_ids=x, past_key_values=DynamicCache(), use_cache=True)
    pkv = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    ts = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=pkv, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        if i >= 3:
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return 1000 * ts[len(ts) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="specrt/builtin/target")
    ap.add_argument("--draft", action="append", default=[], help="draft HF folder (repeatable)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--text-windows", type=int, default=24, help="held-out 512-token windows for acceptance")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--no-loss", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_hf(args.target)
    held = encode_split(args.target, "eval")
    windows = eval_windows(held, args.seq_len)
    report: dict = {"target": args.target, "heldout_tokens": int(held.numel())}
    if not args.no_loss:
        report["heldout_loss"] = heldout_loss(target, windows)
        report["heldout_windows"] = int(windows.shape[0])
        print(f"target held-out loss {report['heldout_loss']:.4f} nats/token "
              f"({windows.shape[0]} x {args.seq_len} tokens)", flush=True)
    step = max(1, windows.shape[0] // args.text_windows)
    text_windows = windows[::step][: args.text_windows, :-1]
    prompts = heldout_prompts(held, args.prompts, args.prompt_len)
    cont = greedy_continuations(target, prompts, args.new_tokens)
    t_text, t_cont = logits_of(target, text_windows), logits_of(target, cont)
    report["drafts"] = {}
    for path in args.draft:
        draft = load_hf(path)
        r = draft_report(target, draft, text_windows, cont, args.prompt_len, t_text, t_cont)
        if args.int8:
            from specrt.models.quant import quantize_linear_layers_
            qd = quantize_linear_layers_(copy.deepcopy(draft))
            r["int8"] = draft_report(target, qd, text_windows, cont, args.prompt_len, t_text, t_cont)
            r["decode_ms"] = {f"{name}_b{b}": decode_step_ms(m, b)
                              for b in (1, 8) for name, m in (("fp32", draft), ("int8", qd))}
            r["decode_ms"].update({f"target_fp32_b{b}": decode_step_ms(target, b) for b in (1, 8)})
        report["drafts"][path] = r
        print(path, json.dumps(r, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
