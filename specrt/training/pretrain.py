"""Pretrain the built-in Llama target on the stdlib corpus (CPU friendly).

    python -m specrt.training.pretrain --out ckpt/target --tokenizer ckpt/tokenizer \
        --hidden 256 --layers 6 --heads 4 --ffn 768 --steps 3000 [--resume]

Packed sequences (files joined by ``<|endoftext|>``, random windows of
``--seq-len`` tokens), AdamW, linear warmup + cosine decay, optional bf16
autocast, tqdm progress, a checkpoint every ``--ckpt-minutes`` into
``<out>/last.pt`` (model, optimizer, step, RNG) and ``--resume`` from it.
At the end writes a Hugging Face folder ``<out>/hf`` (config.json,
model.safetensors in bf16, generation_config.json, tokenizer files).

``--bench`` measures training tokens/s for the given size and exits.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time

import torch
import torch.nn.functional as F

from specrt.training import corpus
from specrt.training.tokenizer import EOS_ID, load_tokenizer


# ----------------------------------------------------------------------------- data

def encode_split(tokenizer_dir: str, split: str, cache_dir: str | None = None) -> torch.Tensor:
    """All files of a split as one 1-D int32 token stream, files separated by EOS."""
    cache = None
    if cache_dir:
        cache = os.path.join(cache_dir, f"tokens_{split}.pt")
        if os.path.exists(cache):
            return torch.load(cache)
    tok = load_tokenizer(tokenizer_dir)
    texts = corpus.load_texts(split)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(EOS_ID)
        ids.extend(enc.ids)
    data = torch.tensor(ids, dtype=torch.int32)
    if cache:
        os.makedirs(cache_dir, exist_ok=True)
        torch.save(data, cache)
    return data


def random_windows(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len+1] int64 windows at random offsets (sequence packing)."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return data[idx].long()


def eval_windows(data: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping [n, seq_len+1] windows covering the stream (deterministic)."""
    n = (data.numel() - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return data[idx].long()


# ---------------------------------------------------------------------------- model

def make_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
                ffn: int, max_pos: int = 2048):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, hidden_act="silu", attention_bias=False, mlp_bias=False,
        initializer_range=0.02, use_cache=True,
    )


def build_model(config):
    from transformers import LlamaForCausalLM
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.tie_weights()
    return model


def lm_loss(model, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Mean next-token cross-entropy of a [B, T+1] batch."""
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x, use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 8, autocast: bool = False) -> float:
    """Token-weighted mean cross-entropy (nats/token) over eval windows."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        b = windows[i:i + batch]
        tot += lm_loss(model, b, autocast).item() * b[:, 1:].numel()
        n += b[:, 1:].numel()
    return tot / max(n, 1)


def add_classic_config_keys(out_dir: str, dtype=torch.bfloat16) -> None:
    """Also write "torch_dtype" and "rope_theta" (transformers 5 writes "dtype" and
    "rope_parameters") so older readers and specrt's own loader see them."""
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.setdefault("torch_dtype", cfg.get("dtype") or str(dtype).replace("torch.", ""))
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def lr_at_frac(step: int, frac: float, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay over training progress ``frac``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_hf(model, out_dir: str, tokenizer_dir: str, dtype=torch.bfloat16) -> None:
    """Save a HF folder: config.json, model.safetensors (dtype), generation_config, tokenizer."""
    from transformers import GenerationConfig
    os.makedirs(out_dir, exist_ok=True)
    m = model.to(dtype)
    m.config.dtype = dtype
    m.save_pretrained(out_dir, safe_serialization=True)
    model.float()
    add_classic_config_keys(out_dir, dtype)
    GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                     do_sample=False, max_new_tokens=128).save_pretrained(out_dir)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, fn), os.path.join(out_dir, fn))


# ------------------------------------------------------------------------- training

def make_optimizer(model, lr: float, weight_decay: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def save_ckpt(path: str, model, opt, step: int, gen: torch.Generator, extra: dict) -> None:
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "gen": gen.get_state(), "extra": extra}, tmp)
    os.replace(tmp, path)


def bench(args, vocab_size: int) -> None:
    data = torch.randint(1, vocab_size, (200_000,), dtype=torch.int32)
    cfg = make_config(vocab_size, args.hidden, args.layers, args.heads, args.kv_heads, args.ffn)
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, 1e-3, 0.1)
    gen = torch.Generator().manual_seed(0)
    for ac in ([False, True] if args.bench_both else [args.bf16]):
        ts = []
        for i in range(args.bench_steps + 2):
            b = random_windows(data, args.batch, args.seq_len, gen)
            t0 = time.perf_counter()
            loss = lm_loss(model, b, ac)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        tps = args.batch * args.seq_len / (sum(ts) / len(ts))
        print(f"params {n / 1e6:.2f}M  h{args.hidden} L{args.layers} ffn{args.ffn} bf16={ac}: "
              f"{tps:.0f} tok/s ({sum(ts) / len(ts):.2f} s/step)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.pretrain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ckpt/target")
    ap.add_argument("--tokenizer", default="ckpt/tokenizer")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=0, help="0 = same as --heads")
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--time-budget-min", type=float, default=0.0,
                    help="stop (with the LR fully decayed) after this much training wall time, "
                         "counted across resumes; 0 = run --steps")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-both", action="store_true")
    ap.add_argument("--bench-steps", type=int, default=5)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.kv_heads = args.kv_heads or args.heads
    torch.manual_seed(args.seed)
    tok = load_tokenizer(args.tokenizer)
    vocab_size = tok.get_vocab_size()
    if args.bench:
        bench(args, vocab_size)
        return 0

    from tqdm import tqdm
    os.makedirs(args.out, exist_ok=True)
    train = encode_split(args.tokenizer, "train", args.out)
    held = eval_windows(encode_split(args.tokenizer, "eval", args.out), args.seq_len)
    held_small = held[: min(16, held.shape[0])]

    cfg = make_config(vocab_size, args.hidden, args.layers, args.heads, args.kv_heads, args.ffn)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, args.lr, args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    step, elapsed0 = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step = ck["step"]
        elapsed0 = ck["extra"].get("elapsed_s", 0.0)
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    with open(os.path.join(args.out, "train_args.json"), "w") as f:
        json.dump(vars(args) | {"n_params": n_params, "train_tokens_available": train.numel()}, f, indent=2)
    print(f"target: {n_params / 1e6:.2f}M params, train stream {train.numel()} tokens, "
          f"{args.steps} steps x {args.batch * args.seq_len} tokens", flush=True)

    t_start = time.time()
    last_ckpt = time.time()
    model.train()
    pbar = tqdm(total=args.steps, initial=step, desc="pretrain", mininterval=10)  # steps = upper bound
    ema = None
    budget_s = args.time_budget_min * 60 if args.time_budget_min else float("inf")

    def progress() -> float:
        # Fraction of training done: by steps, or by wall time when a budget is set
        # (the cosine schedule then ends exactly when the budget runs out).
        return max(step / args.steps, (elapsed0 + time.time() - t_start) / budget_s)

    while progress() < 1.0:
        lr = lr_at_frac(step, progress(), args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        b = random_windows(train, args.batch, args.seq_len, gen)
        loss = lm_loss(model, b, args.bf16)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        pbar.update(1)
        pbar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", refresh=False)
        done = progress() >= 1.0
        if step % args.eval_every == 0 or done:
            hl = heldout_loss(model, held_small, autocast=args.bf16)
            model.train()
            tqdm.write(f"step {step} train_ema {ema:.4f} heldout(16 win) {hl:.4f} "
                       f"elapsed {elapsed0 + time.time() - t_start:.0f}s")
        if time.time() - last_ckpt > args.ckpt_minutes * 60 or done:
            save_ckpt(ckpt_path, model, opt, step, gen,
                      {"elapsed_s": elapsed0 + time.time() - t_start, "config": cfg.to_dict()})
            last_ckpt = time.time()
    pbar.close()
    total_s = elapsed0 + time.time() - t_start
    hl = heldout_loss(model, held, autocast=False)
    save_hf(model, os.path.join(args.out, "hf"), args.tokenizer)
    summary = {"n_params": n_params, "steps": step,
               "train_tokens_seen": step * args.batch * args.seq_len,
               "train_seconds": round(total_s, 1), "heldout_loss_fp32": round(hl, 4),
               "heldout_windows": int(held.shape[0]), "seq_len": args.seq_len}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
