"""`specrt distill`: make a reduced-vocabulary draft for any supported target, end to end.

    specrt distill --target smollm2-135m --arch feature --budget-min 30 --out drafts/smollm2
    specrt distill --target DIR --arch layers --layers auto --corpus notes/*.txt --steps 2000 --out D

Stages (each resumes from what an interrupted run left in ``--work``, default ``OUT.work``):
  1. data     on-policy: the target answers built-in training prompts (batched through
              specrt's model and paged KV cache; greedy and sampled) and the teacher's top-k
              log-probabilities and features are recorded in the same pass; or ``--corpus``
              (text / JSONL) followed by one teacher pass. Shards: WORK/train/teacher_*.safetensors
  2. vocab    the ``--vocab`` most frequent target tokens: produced tokens plus the teacher's
              top-k mass (auto: the smallest of 2k/4k/8k/16k/32k covering 98% of that weight)
  3. train    a feature draft (EAGLE-style, one layer initialised from the target's last) or a
              layer draft (target layers, ``--layers auto`` picks the pair with the lowest KL)
              against the stored teacher: bf16 autocast, tqdm, a checkpoint WORK/ckpt_ARCH.pt
  4. save     OUT: config.json, model.safetensors (draft layers, fc, norm, id map; the target's
              embeddings are bound at load time), generation_config.json (the target's
              bos/eos/pad ids), distill_summary.json (+ held-out acceptance unless
              ``--heldout-prompts 0``)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path

import torch

VOCAB_CHOICES = (2048, 4096, 8192, 16384, 32768)


def resolve_target(target: str) -> Path:
    """A local folder or GGUF file for ``target`` (a folder, a .gguf file or a model name)."""
    try:
        from specrt.models.registry import resolve_model
    except ImportError:  # before GGUF support: folders and "builtin" only
        from specrt.step.engine import resolve_model_path as resolve_model
    return Path(resolve_model(target, "target"))


def write_generation_config(target_src, out_dir) -> dict:
    """OUT/generation_config.json with the target's bos / eos / pad ids (a draft must stop and
    start exactly as its target does: specrt refuses a draft whose special ids differ)."""
    from specrt.models import load_generation_config
    from specrt.models.config import ModelConfig

    gen = load_generation_config(target_src)
    cfg = ModelConfig.from_json(target_src) if Path(target_src).is_dir() else None
    raw = cfg.extra if cfg is not None else {}
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = gen.get(key, raw.get(key))
        if value is not None:
            out[key] = value
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(out, f, indent=2, sort_keys=True)
    return out


def choose_vocab_size(counts: torch.Tensor, requested: str, min_coverage: float = 0.98) -> int:
    if requested != "auto":
        n = int(requested)
        if not 1 <= n <= counts.shape[0]:
            raise ValueError(f"--vocab {n} must be in [1, {counts.shape[0]}] or 'auto'")
        return n
    total = float(counts.sum())
    top = torch.sort(counts.double(), descending=True).values.cumsum(0)
    for n in VOCAB_CHOICES:
        if n >= counts.shape[0] or float(top[n - 1]) / max(total, 1.0) >= min_coverage:
            return min(n, counts.shape[0])
    return counts.shape[0]


@torch.no_grad()
def choose_layers(target, store, vocab, num_layers: int = 2, candidates: int = 4, sequences: int = 8,
                  log=print) -> list[int]:
    """The layer pair (first ``candidates`` x last ``candidates`` target layers, plus the first
    consecutive pairs) whose untrained draft has the lowest sparse KL on a few sequences."""
    from itertools import combinations

    from specrt.training.draft_train import batch_loss, collate, init_draft

    L = target.config.num_layers
    if num_layers != 2:
        return list(range(num_layers - 1)) + [L - 1]
    pool = sorted(set(range(min(candidates, L))) | set(range(max(L - candidates, 0), L)))
    batch = collate(store, list(range(min(sequences, store.num_sequences))), False)
    best, best_kl = None, float("inf")
    for pair in combinations(pool, 2):
        d = init_draft(target, "layers", list(pair), vocab)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kl = float(batch_loss(d, batch, vocab.target_to_draft, 1, 1.0)[0])
        log(f"  layers {list(pair)}: KL {kl:.3f}")
        if kl < best_kl:
            best, best_kl = list(pair), kl
    log(f"chose layers {best} (KL {best_kl:.3f} before training)")
    return best


def build_data(args, target, tokenizer, work: str, log=print):
    """Stage 1: the teacher store of the training data (and of the held-out prompts)."""
    from specrt.training.onpolicy import corpus_sequences
    from specrt.training.teacher import TeacherShard, build_teacher_store, generate_store, text_store
    from specrt.training.teacher_store import open_teacher_store

    train_dir = os.path.join(work, "train")
    feats = args.arch == "feature"
    layers = feature_layers(args, target.config.num_layers)
    if args.corpus:
        seq_dir = os.path.join(work, "corpus_seqs")
        os.makedirs(seq_dir, exist_ok=True)
        if not os.path.exists(os.path.join(seq_dir, "seqs_00000.pt")):
            corpus_sequences(args.corpus, tokenizer, args.max_len).save(os.path.join(seq_dir, "seqs_00000.pt"))
        build_teacher_store(target, seq_dir, train_dir, args.topk, feats, log=log, hidden_layers=layers)
    elif args.num_prompts:
        temps = [float(t) for t in args.temperatures.split(",")]
        records = None
        if args.prompts == "sources":
            from specrt.training.sources import mixed_prompts
            records = mixed_prompts("train", args.num_prompts, args.seed)
        generate_store(target, tokenizer, train_dir, "train", args.num_prompts, args.gen_batch,
                       args.max_new_tokens, temps, args.topk, feats, args.seed, log=log, hidden_layers=layers,
                       prompt_records=records)
    text_dir = os.path.join(work, "text")
    if args.text_sources:
        text_store(target, tokenizer, text_dir, args.text_sources.split(","), "train", args.max_len, args.topk,
                   feats, layers, log=log)
    heldout = None
    if args.heldout_prompts:
        heldout = TeacherShard.concat([
            heldout_store(args, target, tokenizer, work, kind, layers, log) for kind in args.heldout.split(",")])
    folders = [d for d in [train_dir, text_dir, *args.extra_data] if glob.glob(os.path.join(d, "teacher_*.safetensors"))]
    if not folders:
        raise ValueError(f"no training data: {train_dir} has no teacher shards and no --extra-data was given")
    return open_teacher_store(folders), heldout


def heldout_store(args, target, tokenizer, work: str, kind: str, layers, log=print):
    """The target's greedy answers (128 tokens at most) to ``--heldout-prompts`` held-out prompts of
    one kind: "builtin" (the templates' held-out fillers) or "sources" (held-out stdlib files,
    HumanEval tasks and reference topics mixed with them). Never trained on."""
    from specrt.training.teacher import generate_store, load_teacher

    if kind not in ("builtin", "sources"):
        raise ValueError(f"--heldout {kind!r}: expected 'builtin', 'sources' or both, comma-separated")
    tag = "" if layers is None else "-" + "-".join(map(str, layers))
    held_dir = os.path.join(work, ("heldout" if kind == "builtin" else "heldout-sources") + tag)
    records = None
    if kind == "sources":
        from specrt.training.sources import mixed_prompts
        records = mixed_prompts("heldout", args.heldout_prompts, args.seed)
    generate_store(target, tokenizer, held_dir, "heldout", args.heldout_prompts, max(args.gen_batch, 128),
                   min(args.max_new_tokens, 128), [0.0], args.topk, True, args.seed, log=log,
                   hidden_layers=layers, prompt_records=records)
    return load_teacher(held_dir)


def draft_depth(args) -> int:
    """--num-layers, or unset: --init-from's depth; else 1 for a feature draft (a second layer did
    not pay for its cost, docs/benchmarks.md#draft-distillation) and 2 for a layer draft."""
    if args.num_layers is not None:
        return args.num_layers
    if args.init_from:
        from specrt.models.draft_model import DraftModel

        return len(DraftModel.from_pretrained(args.init_from, None).layers)
    return 1 if args.arch == "feature" else 2


def feature_layers(args, num_layers: int) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 draft reads (``--feature-layers``): auto = a low, a middle and
    the final-normed state (index num_layers); "final" = the final-normed state alone."""
    if args.arch != "feature" or args.feature_layers == "final":
        return None
    if args.feature_layers == "auto":
        return (min(2, num_layers - 1), num_layers // 2, num_layers)
    layers = tuple(_ints(args.feature_layers, "--feature-layers"))
    if len(layers) < 2 or any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"--feature-layers {args.feature_layers!r}: >= 2 indices in [0, {num_layers}] "
                         f"({num_layers} = the final-normed state), 'auto' or 'final'")
    return layers


def run(args, log=print) -> dict:
    from specrt.models import load_model, load_tokenizer
    from specrt.models.draft_model import DraftModel
    from specrt.training.draft_eval import chain_acceptance
    from specrt.training.draft_train import TrainConfig, init_draft, train_draft
    from specrt.training.vocab import ReducedVocab, build_reduced_vocab, token_counts

    torch.set_num_threads(args.threads)
    src = resolve_target(args.target)
    work = args.work or args.out.rstrip("/") + ".work"
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    target = load_model(src, dtype=args.dtype, device=args.device)  # the data pass runs where training does
    tokenizer = load_tokenizer(src)
    store, heldout = build_data(args, target, tokenizer, work, log)
    data_s = time.time() - t0
    gen_mask = torch.cat([torch.arange(int(store.offsets[s]) + int(store.prompt_lens[s]), int(store.offsets[s + 1]))
                          for s in range(store.num_sequences)])
    produced = store.token_ids[gen_mask] if gen_mask.numel() else store.token_ids
    counts = token_counts(produced, target.config.vocab_size) + store.teacher_mass(target.config.vocab_size)
    if args.vocab == "init":    # continue a draft on new data with its head unchanged
        if not args.init_from:
            raise ValueError("--vocab init needs --init-from (the draft whose vocabulary is kept)")
        vocab = ReducedVocab.from_map(DraftModel.from_pretrained(args.init_from, None).draft_to_target,
                                      target.config.vocab_size)
        n = vocab.size
    else:
        n = choose_vocab_size(counts, args.vocab)
        vocab = build_reduced_vocab(counts, n, always=tokenizer.eos_token_ids)
    log(f"data: {store.num_sequences} sequences, {store.token_ids.numel()} positions ({produced.numel()} produced "
        f"by the target) in {data_s:.0f}s; draft vocabulary {n} covers {vocab.coverage(produced):.4f} of them")

    depth = draft_depth(args)
    if args.layers != "auto":
        layers = _ints(args.layers)
    elif args.arch == "feature" and depth == 1:
        layers = [target.config.num_layers - 1]
    else:
        layers = choose_layers(target, store, vocab, depth, log=log)
    target_f32 = target.float()  # trainable copies are made in fp32
    draft = init_draft(target_f32, args.arch, layers, vocab, args.fc_init,
                       feature_layers(args, target.config.num_layers))
    if args.init_from:
        warm_start(draft, args.init_from, log)
    cfg = TrainConfig(steps=args.steps, budget_s=args.budget_min * 60, lr=args.lr, warmup=args.warmup,
                      batch_tokens=args.batch_tokens, chain_steps=args.chain_steps, seed=args.seed,
                      top1_weight=args.top1_weight,
                      eval_every=args.eval_every if heldout is not None else 0, device=args.device)
    evaluate = None
    if heldout is not None:
        evaluate = lambda d: chain_acceptance(d, heldout, k=4)  # noqa: E731
    summary = train_draft(draft, store, vocab, cfg, os.path.join(work, f"ckpt_{args.arch}.pt"), log=log,
                          evaluate=evaluate)
    draft.cpu()
    target_f32 = target_f32.cpu()

    os.makedirs(args.out, exist_ok=True)
    draft.config.extra.update(distill={"target": str(args.target), "data_positions": int(store.token_ids.numel()),
                                       "vocab_coverage": round(vocab.coverage(produced), 4)})
    draft.save_pretrained(args.out, dtype=torch.bfloat16)
    write_generation_config(src, args.out)
    summary.update(arch=args.arch, layers=layers, draft_vocab_size=n, data_seconds=round(data_s, 1),
                   data_sequences=store.num_sequences, data_positions=int(store.token_ids.numel()),
                   vocab_coverage=round(vocab.coverage(produced), 4))
    if heldout is not None:
        saved = DraftModel.from_pretrained(args.out, target_f32)
        summary["heldout"] = chain_acceptance(saved, heldout, k=4)
        held_gen = torch.cat([torch.arange(int(heldout.offsets[s]) + int(heldout.prompt_lens[s]),
                                           int(heldout.offsets[s + 1])) for s in range(heldout.num_sequences)])
        summary["heldout_vocab_coverage"] = round(vocab.coverage(heldout.token_ids[held_gen]), 4)
        log(f"held-out acceptance: {json.dumps(summary['heldout'])}; the draft vocabulary holds "
            f"{summary['heldout_vocab_coverage']:.4f} of the target's greedy held-out tokens")
    with open(os.path.join(args.out, "distill_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def warm_start(draft, folder: str, log=print) -> None:
    """Copy an existing draft folder's layers, fc and norm into ``draft`` (same kind); its head
    stays the new vocabulary's rows of the target embedding. A deeper ``draft`` keeps the copied
    layers first and starts its extra layers as the identity (zero output projections: the
    residual passes through), so it begins as the shallower draft and training adds depth."""
    from specrt.models.draft_model import DraftModel

    src = DraftModel.from_pretrained(folder, None)
    if src.config.kind != draft.config.kind or len(src.layers) > len(draft.layers):
        raise ValueError(f"--init-from {folder}: a {src.config.kind} draft of {len(src.layers)} layers cannot "
                         f"start a {draft.config.kind} draft of {len(draft.layers)} layers")
    # a single-feature draft starts an EAGLE-3 one: its fuse keeps init_fuse's pass-through
    skip = {"draft_to_target"} | ({"fuse.weight"} if src.config.feature_layers != draft.config.feature_layers
                                  else set())
    state = {k: v for k, v in src.state_dict().items() if k not in skip}
    draft.load_state_dict(state, strict=False)
    with torch.no_grad():
        for layer in draft.layers[len(src.layers):]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    log(f"warm start from {folder} ({len(state)} tensors"
        f"{f', {len(draft.layers) - len(src.layers)} identity layers added' if len(draft.layers) > len(src.layers) else ''})")


def _ints(text: str, name: str = "--layers") -> list[int]:
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be 'auto' or comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specrt distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="model folder, .gguf file, or a name (smollm2-135m)")
    ap.add_argument("--out", required=True, help="draft folder to write")
    ap.add_argument("--arch", choices=["feature", "layers", "hf"], default="feature",
                    help="feature (EAGLE-style), layers (target layers), hf (the built-in pair's full-vocabulary "
                         "HF draft: specrt.training.distill's older recipe)")
    ap.add_argument("--init", choices=["layers"], default="layers", help="initialise from the target's layers")
    ap.add_argument("--init-from", default=None,
                    help="continue from an existing draft folder of the same kind (its layers, fc, norm)")
    ap.add_argument("--layers", default="auto", help="target layer indices 'i,j,..' or auto")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="draft depth for --layers auto (a 1-layer feature draft starts from the last layer); "
                         "default: --init-from's depth, else 1 for feature drafts and 2 for layer drafts")
    ap.add_argument("--feature-layers", default="auto",
                    help="feature drafts (EAGLE-3): target layers 'i,j,..' whose outputs are fused "
                         "(num_layers = the final-normed state); auto = low, middle, final; 'final' = that alone")
    ap.add_argument("--extra-data", nargs="*", default=[],
                    help="more teacher stores (folders of teacher_*.safetensors, e.g. specrt.training.teacher's)")
    ap.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations")
    ap.add_argument("--device", default="cpu", help="train on cpu (threads) or cuda[:i]")
    ap.add_argument("--fc-init", choices=["embed", "sum"], default="embed",
                    help="feature drafts: fc starts as [I, 0] (the layer draft) or [I, I]")
    ap.add_argument("--corpus", nargs="+", default=None, help="text / JSONL files instead of on-policy data")
    ap.add_argument("--max-len", type=int, default=512, help="--corpus: tokens per sequence")
    ap.add_argument("--num-prompts", type=int, default=512, help="on-policy: training prompts the target answers")
    ap.add_argument("--prompts", choices=["sources", "builtin"], default="sources",
                    help="sources: mixed from every installed source (specrt.training.sources: stdlib code, "
                         "HumanEval, Python docs, chat); builtin: specrt's prompt templates alone")
    ap.add_argument("--text-sources", default="",
                    help="also teacher-force the raw text of these sources 'a,b' (e.g. "
                         "stdlib-code,python-reference,stdlib-docstrings): fast positions without decoding")
    ap.add_argument("--heldout-prompts", type=int, default=64, help="held-out prompts to evaluate on (0 = skip)")
    ap.add_argument("--heldout", default="builtin,sources",
                    help="which held-out prompts, comma-separated: builtin (template fillers never trained "
                         "on), sources (held-out stdlib files, HumanEval tasks, reference topics)")
    ap.add_argument("--max-new-tokens", type=int, default=192,
                    help="on-policy: tokens the target answers each training prompt with (held-out: at most 128)")
    ap.add_argument("--temperatures", default="0,0.7,1.0,0", help="on-policy sampling temperatures (cycled)")
    ap.add_argument("--gen-batch", type=int, default=128, help="sequences generated together")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probabilities stored per position")
    ap.add_argument("--vocab", default="auto",
                    help="draft vocabulary size N; auto (the smallest size covering 98%% of the data's "
                         "tokens); or init (--init-from's vocabulary, unchanged)")
    ap.add_argument("--steps", type=int, default=2000,
                    help="optimizer steps; the learning-rate schedule spans them (with --budget-min, whichever "
                         "ends first)")
    ap.add_argument("--budget-min", type=float, default=0.0, help="training wall-time budget (0 = --steps)")
    ap.add_argument("--lr", type=float, default=5e-4,
                    help="peak AdamW learning rate (cosine decay to a tenth of it after --warmup)")
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    ap.add_argument("--batch-tokens", type=int, default=4096,
                    help="padded tokens per training batch (sequences of similar length packed together)")
    ap.add_argument("--chain-steps", type=int, default=3, help="feature drafts: chain positions trained")
    ap.add_argument("--top1-weight", type=float, default=0.0,
                    help="add this x cross-entropy on the teacher's argmax to the sparse KL")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype for the data pass")
    ap.add_argument("--work", default=None, help="data, teacher shards and checkpoints (default OUT.work)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for the data pass and training")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the prompt mix, the sampled answers and the batch order (same seed, same run)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.arch == "hf":
        raise ValueError("--arch hf is served by specrt.training.distill.main_hf")
    run(args)
    return 0
