"""Distillation sequences: on-policy samples from specrt's own batched engine, or a user corpus.

    python -m specrt.training.onpolicy --target DIR --out /work/ckpt/data/seqs --num-prompts 768

On-policy: the target answers built-in training prompts (specrt.training.prompts) with
``specrt.LLM.generate`` at batch ``--batch`` (one engine step advances every request),
greedy and sampled (temperatures cycle through ``--temperatures``). A shard of
``--batch`` sequences is written as soon as it is done, so an interrupted run resumes
where it stopped. ``--corpus`` instead reads text files / JSONL (a "text" field, or
chat "messages") and cuts them into ``--max-len`` token pieces.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time
from dataclasses import dataclass

import torch


@dataclass
class SequenceShard:
    """One shard of token sequences (prompt followed by the target's continuation)."""
    token_ids: list[list[int]]   # per sequence: prompt + generated ids
    prompt_lens: list[int]       # per sequence: how many leading ids are prompt
    temperatures: list[float]    # per sequence: sampling temperature (-1 = corpus text)

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        torch.save({"token_ids": self.token_ids, "prompt_lens": self.prompt_lens,
                    "temperatures": self.temperatures}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "SequenceShard":
        d = torch.load(path)
        return cls(d["token_ids"], d["prompt_lens"], d["temperatures"])

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def shard_paths(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "seqs_*.pt")))


def load_sequences(folder: str) -> SequenceShard:
    """Every shard of a folder concatenated (in shard order)."""
    paths = shard_paths(folder)
    if not paths:
        raise ValueError(f"no sequence shards (seqs_*.pt) in {folder}")
    out = SequenceShard([], [], [])
    for p in paths:
        s = SequenceShard.load(p)
        out.token_ids += s.token_ids
        out.prompt_lens += s.prompt_lens
        out.temperatures += s.temperatures
    return out


def generate_onpolicy(llm, prompt_ids: list[list[int]], out_dir: str, batch: int, max_tokens: int,
                      temperatures: list[float], seed: int = 0, log=print) -> None:
    """Continue every prompt with the target (``llm``: a specrt.LLM) and write shards of ``batch``."""
    import specrt

    os.makedirs(out_dir, exist_ok=True)
    t_start, done_tokens = time.time(), 0
    for shard, start in enumerate(range(0, len(prompt_ids), batch)):
        path = os.path.join(out_dir, f"seqs_{shard:05d}.pt")
        if os.path.exists(path):
            continue
        chunk = prompt_ids[start:start + batch]
        temps = [temperatures[(start + i) % len(temperatures)] for i in range(len(chunk))]
        params = [specrt.SamplingParams(temperature=t, max_tokens=max_tokens, seed=seed * 1_000_003 + start + i)
                  for i, t in enumerate(temps)]
        t0 = time.time()
        outs = llm.generate(chunk, params)
        new = sum(len(o.token_ids) for o in outs)
        done_tokens += new
        SequenceShard([list(p) + list(o.token_ids) for p, o in zip(chunk, outs)], [len(p) for p in chunk],
                      temps).save(path)
        log(f"shard {shard}: {len(chunk)} sequences, {new} new tokens in {time.time() - t0:.0f}s "
            f"({new / (time.time() - t0):.1f} tok/s; {done_tokens} total, {time.time() - t_start:.0f}s)")


def _corpus_texts(paths: list[str]) -> list[str]:
    texts: list[str] = []
    for pattern in paths:
        files = sorted(glob.glob(pattern)) or [pattern]
        for f in files:
            if not os.path.isfile(f):
                raise ValueError(f"--corpus: no such file {f!r}")
            with open(f, encoding="utf-8", errors="replace") as fh:
                if f.endswith((".jsonl", ".json")):
                    for n, line in enumerate(fh):
                        if line.strip():
                            texts.append(_jsonl_text(json.loads(line), f, n))
                else:
                    texts.append(fh.read())
    return [t for t in texts if t]


def _jsonl_text(obj, path: str, line: int):
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return obj["text"]
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        return obj["messages"]
    raise ValueError(f"{path}:{line + 1}: expected an object with a 'text' string or a 'messages' list")


def corpus_sequences(paths: list[str], tokenizer, max_len: int) -> SequenceShard:
    """User text files / JSONL as sequences of at most ``max_len`` tokens (chat messages through
    the tokenizer's chat template). Every position is trained on (prompt_len 1)."""
    seqs: list[list[int]] = []
    for t in _corpus_texts(paths):
        if isinstance(t, list):
            ids = tokenizer.encode(tokenizer.apply_chat_template(t, add_generation_prompt=False),
                                   add_special_tokens=False)
        else:
            ids = tokenizer.encode(t)
        seqs += [ids[i:i + max_len] for i in range(0, len(ids), max_len) if len(ids[i:i + max_len]) > 1]
    if not seqs:
        raise ValueError(f"--corpus {paths}: no text found")
    return SequenceShard(seqs, [1] * len(seqs), [-1.0] * len(seqs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.onpolicy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model folder")
    ap.add_argument("--out", required=True, help="folder for seqs_*.pt shards")
    ap.add_argument("--num-prompts", type=int, default=768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,0.7,1.0,0", help="cycled over the prompts")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import specrt
    from specrt.training.prompts import build_prompts, render

    llm = specrt.LLM(target=args.target, dtype=getattr(torch, args.dtype),
                     spec=specrt.SpecConfig(max_batch_size=args.batch, max_model_len=args.max_tokens + 512))
    prompts = [render(p, llm.tokenizer) for p in build_prompts("train", args.num_prompts, args.seed)]
    temps = [float(t) for t in args.temperatures.split(",")]
    generate_onpolicy(llm, prompts, args.out, args.batch, args.max_tokens, temps, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
