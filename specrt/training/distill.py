"""`specrt distill` entry point, and the built-in pair's full-vocabulary HF draft recipe.

``main`` runs the reduced-vocabulary draft pipeline (specrt.training.draft_distill);
``--arch hf`` runs ``main_hf`` below: layer-subset init (or scratch) + KL distillation.

    # layer-init draft: target layers 0 and 5 + embeddings + final norm + head, distilled
    python -m specrt.training.distill --arch hf --target ckpt/target/hf --out ckpt/draft_layerinit \
        --layers 0,5 --steps 600
    # same size from scratch, same data and steps
    python -m specrt.training.distill --arch hf --target ckpt/target/hf --out ckpt/draft_scratch \
        --init scratch --num-layers 2 --steps 600

Objective: forward KL(p_target || q_draft) at temperature 1, averaged over all
positions of each batch. Half of each batch is packed windows of the training
corpus, half is on-policy text the target generated itself (sampled at T=1 from
corpus prompts, cached in ``--onpolicy`` so every draft sees the same data).
``--layers auto`` scores every subset of ``--num-layers`` target layers by KL on a
few corpus windows before training and picks the best.
Writes ``<out>/hf`` (HF folder, bf16, with tokenizer) and ``<out>/summary.json``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import time

import torch
import torch.nn.functional as F

from specrt.training.pretrain import (EOS_ID, build_model, encode_split, make_optimizer,
                                      random_windows, save_hf)


def load_hf(path: str, dtype=torch.float32):
    from transformers import LlamaForCausalLM
    m = LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return m.float().eval() if dtype == torch.float32 else m.eval()


def draft_config(target_config, num_layers: int):
    cfg = target_config.__class__.from_dict(target_config.to_dict())
    cfg.num_hidden_layers = num_layers
    cfg.layer_types = None if not hasattr(cfg, "layer_types") else None
    return cfg


def layer_init_draft(target, layers: list[int]):
    """A draft with target layers ``layers`` (in order) + embeddings, final norm, head."""
    L = target.config.num_hidden_layers
    if not layers or any(i < 0 or i >= L for i in layers):
        raise ValueError(f"layers {layers} must be non-empty indices in [0, {L})")
    draft = build_model(draft_config(target.config, len(layers)))
    tsd = target.state_dict()
    sd = {}
    for k, v in tsd.items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i in layers:
                j = layers.index(i)
                sd[k.replace(f"model.layers.{i}.", f"model.layers.{j}.", 1)] = v.clone()
        else:
            sd[k] = v.clone()
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    draft.tie_weights()
    draft.config.specrt_draft_init = {"method": "layer_init", "target_layers": list(layers)}
    return draft.float()


def scratch_draft(target_config, num_layers: int, seed: int = 0):
    torch.manual_seed(seed)
    draft = build_model(draft_config(target_config, num_layers))
    draft.config.specrt_draft_init = {"method": "scratch"}
    return draft.float()


def save_draft(draft, out_dir: str, target_dir: str, tokenizer_dir: str) -> None:
    """Save the draft as an HF folder that specrt accepts beside its target: the target's
    bos / eos / pad ids in generation_config.json (save_hf writes the built-in pair's id 0,
    so specrt rejected e.g. a SmolLM2 draft: eos [2] vs [2, 0]) and its chat template file."""
    from specrt.models import load_generation_config

    save_hf(draft, out_dir, tokenizer_dir)
    path = os.path.join(out_dir, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    target_gen = load_generation_config(target_dir)
    target_cfg = draft.config.to_dict()          # layer_init / scratch drafts copy the target's config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = target_gen.get(key, target_cfg.get(key))
        if value is None:
            gen.pop(key, None)
        else:
            gen[key] = value
    with open(path, "w") as f:
        json.dump(gen, f, indent=2, sort_keys=True)
    template = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(template):
        shutil.copy(template, os.path.join(out_dir, "chat_template.jinja"))


def kl_loss(t_logits: torch.Tensor, d_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax(t) || softmax(d)); logits [..., V]."""
    lp = F.log_softmax(t_logits.float(), -1)
    lq = F.log_softmax(d_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


@torch.no_grad()
def choose_layers(target, num_layers: int, windows: torch.Tensor, log=print) -> list[int]:
    L = target.config.num_hidden_layers
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t_logits = target(input_ids=windows, use_cache=False).logits
    best, best_kl = None, float("inf")
    for combo in itertools.combinations(range(L), num_layers):
        d = layer_init_draft(target, list(combo)).eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kl = kl_loss(t_logits, d(input_ids=windows, use_cache=False).logits).item()
        log(f"  layers {list(combo)}: KL {kl:.4f}")
        if kl < best_kl:
            best, best_kl = list(combo), kl
    log(f"chose layers {best} (KL {best_kl:.4f} before distillation)")
    return best


@torch.no_grad()
def generate_onpolicy(target, train: torch.Tensor, num_seqs: int, prompt_len: int, new_tokens: int,
                      temperature: float = 1.0, batch: int = 32, seed: int = 0) -> torch.Tensor:
    """[num_seqs, prompt_len + new_tokens] int32: corpus prompts continued by target samples."""
    from tqdm import tqdm
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out = []
    for _ in tqdm(range(0, num_seqs, batch), desc="on-policy gen", mininterval=10):
        prompts = random_windows(train, batch, prompt_len - 1, gen)  # [b, prompt_len]
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                               temperature=temperature, top_k=0, top_p=1.0,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=EOS_ID)
        out.append(seqs.to(torch.int32))
    return torch.cat(out)[:num_seqs]


def distill(target, draft, train: torch.Tensor, onpolicy: torch.Tensor | None, steps: int,
            batch: int, seq_len: int, lr: float, warmup: int, seed: int, onpolicy_frac: float = 0.5,
            log_every: int = 50, desc: str = "distill", time_budget_s: float = 0.0) -> tuple[list[float], int]:
    """Returns (kl_ema history every log_every steps, steps run). With a time budget the
    cosine LR schedule follows max(step/steps, elapsed/budget) and stops at 1."""
    from tqdm import tqdm
    from specrt.training.pretrain import lr_at_frac
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(draft, lr, 0.0)
    draft.train()
    n_on = int(round(batch * onpolicy_frac)) if onpolicy is not None else 0
    hist, ema = [], None
    pbar = tqdm(total=steps, desc=desc, mininterval=10)
    t0, budget = time.time(), time_budget_s or float("inf")
    step = 0
    while max(step / steps, (time.time() - t0) / budget) < 1.0:
        frac = max(step / steps, (time.time() - t0) / budget)
        for g in opt.param_groups:
            g["lr"] = lr_at_frac(step, frac, lr, warmup)
        parts = [random_windows(train, batch - n_on, seq_len - 1, gen)]  # [b, seq_len]
        if n_on:
            idx = torch.randint(0, onpolicy.shape[0], (n_on,), generator=gen)
            parts.append(onpolicy[idx, :seq_len].long())
        x = torch.cat(parts)  # [batch, seq_len]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            t_logits = target(input_ids=x, use_cache=False).logits  # [B, T, V]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d_logits = draft(input_ids=x, use_cache=False).logits
        loss = kl_loss(t_logits, d_logits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        step += 1
        pbar.update(1)
        pbar.set_postfix(kl=f"{ema:.4f}", refresh=False)
        if step % log_every == 0:
            hist.append(round(ema, 4))
            tqdm.write(f"{desc} step {step} kl_ema {ema:.4f} ({time.time() - t0:.0f}s)")
    pbar.close()
    draft.eval()
    return hist, step


def main(argv: list[str] | None = None) -> int:
    """`specrt distill`: the reduced-vocabulary draft pipeline (specrt.training.draft_distill);
    ``--arch hf`` runs main_hf, the full-vocabulary HF draft recipe of the built-in pair."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv):
        if (a == "--arch" and argv[i + 1:i + 2] == ["hf"]) or a == "--arch=hf":
            return main_hf(argv[:i] + argv[i + (1 if a == "--arch=hf" else 2):])
    from specrt.training.draft_distill import main as pipeline_main

    return pipeline_main(argv)


def main_hf(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt distill --arch hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="ckpt/target/hf", help="HF folder of the target")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")
    ap.add_argument("--out", default="ckpt/draft_layerinit")
    ap.add_argument("--init", choices=["layers", "scratch"], default="layers")
    ap.add_argument("--layers", default="auto", help="comma-separated target layer indices, or auto")
    ap.add_argument("--num-layers", type=int, default=2, help="draft depth for auto / scratch")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--time-budget-min", type=float, default=0.0,
                    help="stop after this much training wall time (LR schedule follows it); 0 = --steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--onpolicy", default="ckpt/onpolicy.pt", help="cache of target samples ('' = off)")
    ap.add_argument("--onpolicy-seqs", type=int, default=512)
    ap.add_argument("--onpolicy-frac", type=float, default=0.5)
    ap.add_argument("--cache-dir", default="ckpt", help="where the tokenized corpus is cached")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok_dir = args.tokenizer or args.target
    t0 = time.time()

    target = load_hf(args.target)
    for p in target.parameters():
        p.requires_grad_(False)
    train = encode_split(tok_dir, "train", args.cache_dir)

    onpolicy = None
    if args.onpolicy:
        if os.path.exists(args.onpolicy):
            onpolicy = torch.load(args.onpolicy)
        else:
            onpolicy = generate_onpolicy(target, train, args.onpolicy_seqs, 32, args.seq_len - 32,
                                         seed=args.seed + 1)
            os.makedirs(os.path.dirname(args.onpolicy) or ".", exist_ok=True)
            torch.save(onpolicy, args.onpolicy)
        print(f"on-policy data: {tuple(onpolicy.shape)} ({time.time() - t0:.0f}s)", flush=True)

    if args.init == "scratch":
        draft = scratch_draft(target.config, args.num_layers, args.seed)
    else:
        if args.layers == "auto":
            gen = torch.Generator().manual_seed(123)
            layers = choose_layers(target, args.num_layers, random_windows(train, 4, args.seq_len - 1, gen))
        else:
            layers = [int(i) for i in args.layers.split(",")]
        draft = layer_init_draft(target, layers)
    n_params = sum(p.numel() for p in draft.parameters())
    print(f"draft ({args.init}): {draft.config.num_hidden_layers} layers, {n_params / 1e6:.2f}M params", flush=True)

    t1 = time.time()
    hist, steps = distill(target, draft, train, onpolicy, args.steps, args.batch, args.seq_len, args.lr,
                          args.warmup, args.seed, args.onpolicy_frac, desc=f"distill[{args.init}]",
                          time_budget_s=args.time_budget_min * 60)
    train_s = time.time() - t1
    save_draft(draft, os.path.join(args.out, "hf"), args.target, tok_dir)
    summary = {"init": draft.config.specrt_draft_init, "n_params": n_params, "steps": steps,
               "tokens_seen": steps * args.batch * args.seq_len, "batch": args.batch, "seq_len": args.seq_len,
               "onpolicy_frac": args.onpolicy_frac if onpolicy is not None else 0.0,
               "lr": args.lr, "train_seconds": round(train_s, 1), "kl_ema_history": hist}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    shutil.copy(os.path.join(args.out, "summary.json"), os.path.join(args.out, "hf", "distill_summary.json"))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
