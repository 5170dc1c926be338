"""The teacher's distribution, computed once and stored sparsely on disk.

    python -m specrt.training.teacher --target DIR --out /work/ckpt/data/teacher --num-prompts 512
    python -m specrt.training.teacher --target DIR --seqs /work/ckpt/data/seqs --out /work/ckpt/data/teacher

For every position of every distillation sequence the target's forward (specrt's own
model, the dtype the engine verifies in) gives
  * the k most likely next tokens and their log-probabilities (normalised over the FULL
    vocabulary, so the tail mass 1 - sum(exp) outside the top k is known), and
  * the feature a feature draft reads: the final-normed hidden state (what lm_head multiplies).
Shards ``teacher_*.safetensors`` (one per sequence shard) are written as they finish;
an interrupted run resumes at the first missing shard.
"""
from __future__ import annotations

import argparse
import glob
import os
import time
from dataclasses import dataclass

import torch


@dataclass
class TeacherShard:
    """Sparse teacher targets for S sequences with N positions in all."""
    token_ids: torch.Tensor      # [N] int32, the sequences concatenated
    offsets: torch.Tensor        # [S+1] int64, sequence s is token_ids[offsets[s]:offsets[s+1]]
    prompt_lens: torch.Tensor    # [S] int32, leading prompt positions of each sequence
    topk_ids: torch.Tensor       # [N, k] int32, the target's k most likely next tokens at each position
    topk_logprobs: torch.Tensor  # [N, k] float16, their log-probabilities (full-vocabulary softmax)
    features: torch.Tensor | None = None  # [N, H] bfloat16, final-normed hidden states

    def __post_init__(self):
        n = self.token_ids.shape[0]
        s = self.prompt_lens.shape[0]
        if self.offsets.shape != (s + 1,) or int(self.offsets[-1]) != n or int(self.offsets[0]) != 0:
            raise ValueError(f"offsets {tuple(self.offsets.shape)} must be [S+1] from 0 to N={n} (S={s})")
        if self.topk_ids.shape != self.topk_logprobs.shape or self.topk_ids.shape[0] != n:
            raise ValueError(f"topk_ids {tuple(self.topk_ids.shape)} and topk_logprobs "
                             f"{tuple(self.topk_logprobs.shape)} must both be [N={n}, k]")
        if self.features is not None and self.features.shape[0] != n:
            raise ValueError(f"features {tuple(self.features.shape)} must have N={n} rows")

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.shape[0]

    def sequence(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))

    @property
    def feature_width(self) -> int | None:
        return None if self.features is None else self.features.shape[1]

    @property
    def num_positions(self) -> int:
        return self.token_ids.shape[0]

    def sequence_rows(self, s: int):
        """Sequence s: (token ids [n], top-k ids [n, k], top-k log-probs [n, k], features [n, F] | None)
        (teacher_store.TeacherStore's interface)."""
        sl = self.sequence(s)
        return (self.token_ids[sl], self.topk_ids[sl], self.topk_logprobs[sl],
                None if self.features is None else self.features[sl])

    def teacher_mass(self, vocab_size: int) -> torch.Tensor:
        from specrt.training.vocab import teacher_mass

        return teacher_mass(self.topk_ids, self.topk_logprobs, vocab_size)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        t = {"token_ids": self.token_ids, "offsets": self.offsets, "prompt_lens": self.prompt_lens,
             "topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs}
        if self.features is not None:
            t["features"] = self.features
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in t.items()}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "TeacherShard":
        from safetensors.torch import load_file

        t = load_file(path)
        return cls(t["token_ids"], t["offsets"], t["prompt_lens"], t["topk_ids"], t["topk_logprobs"],
                   t.get("features"))

    @classmethod
    def concat(cls, shards: list["TeacherShard"]) -> "TeacherShard":
        if not shards:
            raise ValueError("no teacher shards")
        offs, base = [torch.zeros(1, dtype=torch.int64)], 0
        for s in shards:
            offs.append(s.offsets[1:] + base)
            base += s.token_ids.shape[0]
        feats = None if any(s.features is None for s in shards) else torch.cat([s.features for s in shards])
        return cls(torch.cat([s.token_ids for s in shards]), torch.cat(offs),
                   torch.cat([s.prompt_lens for s in shards]), torch.cat([s.topk_ids for s in shards]),
                   torch.cat([s.topk_logprobs for s in shards]), feats)


def load_teacher(folder: str) -> TeacherShard:
    paths = sorted(glob.glob(os.path.join(folder, "teacher_*.safetensors")))
    if not paths:
        raise ValueError(f"no teacher shards (teacher_*.safetensors) in {folder}")
    return TeacherShard.concat([TeacherShard.load(p) for p in paths])


@torch.no_grad()
def target_outputs(target, seqs: list[list[int]], block_size: int = 16, hidden_layers=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of ``seqs`` through specrt's model: (logits [N, V] float32, final-normed hidden [N, H],
    or [N, k H] the outputs of ``hidden_layers`` concatenated)."""
    from specrt.models.kv_cache import AttentionMetadata, allocate_kv_cache

    lens = [len(s) for s in seqs]
    tables, nxt = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    cache = allocate_kv_cache(target.config, nxt, block_size, target.dtype, target.device)
    meta = AttentionMetadata.build(lens, lens, tables, block_size, target.device)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=target.device)
    pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.int64, device=target.device)
    return target(ids, pos, meta, cache, return_hidden=True, hidden_layers=hidden_layers)


def sparse_targets(target, seqs: list[list[int]], prompt_lens: list[int], k: int, features: bool,
                   max_tokens_per_forward: int = 2048, hidden_layers=None) -> TeacherShard:
    """Top-k log-probabilities (and features) of the target at every position of ``seqs``."""
    ids_l, lp_l, feat_l = [], [], []
    i = 0
    while i < len(seqs):
        j, n = i, 0
        while j < len(seqs) and (j == i or n + len(seqs[j]) <= max_tokens_per_forward):
            n += len(seqs[j])
            j += 1
        logits, hidden = target_outputs(target, seqs[i:j], hidden_layers=hidden_layers)
        lp = torch.log_softmax(logits, -1)  # [n, V]
        top = lp.topk(k, -1)
        ids_l.append(top.indices.to(torch.int32))
        lp_l.append(top.values.to(torch.float16))
        if features:
            feat_l.append(hidden.to(torch.bfloat16))
        i = j
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return TeacherShard(torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                        torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
                        torch.tensor(prompt_lens, dtype=torch.int32), torch.cat(ids_l), torch.cat(lp_l),
                        torch.cat(feat_l) if features else None)


@dataclass
class _Row:
    """One on-policy sequence being generated: its tokens and the teacher rows recorded so far."""
    tokens: list[int]
    prompt_len: int
    temperature: float
    table: list[int]
    ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    feats: list[torch.Tensor]


def _record(row: _Row, logits: torch.Tensor, hidden: torch.Tensor, k: int, features: bool) -> None:
    top = torch.log_softmax(logits, -1).topk(k, -1)  # [n, k]
    row.ids.append(top.indices.to(torch.int32))
    row.logprobs.append(top.values.to(torch.float16))
    if features:
        row.feats.append(hidden.to(torch.bfloat16))


@torch.no_grad()
def generate_and_record(target, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int,
                        k: int, eos_ids: list[int], features: bool = True, seed: int = 0,
                        block_size: int = 16, max_prefill_tokens: int = 2048, hidden_layers=None) -> TeacherShard:
    """On-policy data and its teacher targets in ONE pass: the target continues every prompt
    (batched decoding through specrt's model and paged KV cache; greedy at temperature 0, else
    sampled from the stored top-k, i.e. top-k sampling) and the logits / hidden states it
    computes anyway are stored sparsely. A
    sequence is stored up to its second-to-last token, so every stored position has the
    teacher row that predicts the next token (the last row predicts the final token).
    hidden_layers: store those layers' outputs concatenated as the features (an EAGLE-3 draft)."""
    from specrt.models.kv_cache import AttentionMetadata, allocate_kv_cache

    dev = target.device
    gen = torch.Generator().manual_seed(seed)
    nb = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    starts = [sum(nb[:i]) for i in range(len(prompts))]
    cache = allocate_kv_cache(target.config, sum(nb), block_size, target.dtype, dev)
    rows = [_Row(list(p), len(p), t, list(range(s, s + n)), [], [], [])
            for p, t, s, n in zip(prompts, temperatures, starts, nb)]
    i = 0
    while i < len(rows):  # prefill in chunks, teacher rows for every prompt position
        j, n = i, 0
        while j < len(rows) and (j == i or n + rows[j].prompt_len <= max_prefill_tokens):
            n += rows[j].prompt_len
            j += 1
        lens = [r.prompt_len for r in rows[i:j]]
        meta = AttentionMetadata.build(lens, lens, [r.table for r in rows[i:j]], block_size, dev)
        ids = torch.tensor([t for r in rows[i:j] for t in r.tokens], dtype=torch.int64, device=dev)
        pos = torch.tensor([p for m in lens for p in range(m)], dtype=torch.int64, device=dev)
        logits, hidden = target(ids, pos, meta, cache, return_hidden=True, hidden_layers=hidden_layers)
        for r, lg, hd in zip(rows[i:j], logits.split(lens), hidden.split(lens)):
            _record(r, lg, hd, k, features)
        i = j
    active = list(rows)
    for _ in range(max_new_tokens):
        nxt = _sample_next(active, gen)
        for r, t in zip(active, nxt):
            r.tokens.append(t)
        active = [r for r in active if r.tokens[-1] not in eos_ids and len(r.tokens) - r.prompt_len < max_new_tokens]
        if not active:
            break
        lens = [len(r.tokens) for r in active]
        meta = AttentionMetadata.build(lens, [1] * len(active), [r.table for r in active], block_size, dev)
        ids = torch.tensor([r.tokens[-1] for r in active], dtype=torch.int64, device=dev)
        pos = torch.tensor([m - 1 for m in lens], dtype=torch.int64, device=dev)
        logits, hidden = target(ids, pos, meta, cache, return_hidden=True, hidden_layers=hidden_layers)
        for b, r in enumerate(active):
            _record(r, logits[b:b + 1], hidden[b:b + 1], k, features)
    return _rows_to_shard(rows, features)


def _sample_next(rows: list[_Row], gen: torch.Generator) -> list[int]:
    """Each row's next token from its latest teacher row: argmax at temperature 0, else a sample
    from softmax(log-probs / T) over the stored top-k (the top-k of the full distribution)."""
    from specrt.ops import is_greedy

    out = []
    for r in rows:
        ids, lp = r.ids[-1][-1], r.logprobs[-1][-1].float()
        if is_greedy(r.temperature):
            out.append(int(ids[0]))
        else:
            p = torch.softmax(lp / r.temperature, -1)
            out.append(int(ids[torch.multinomial(p, 1, generator=gen)]))
    return out


def _rows_to_shard(rows: list[_Row], features: bool) -> TeacherShard:
    seqs = [r.tokens[:-1] for r in rows]  # the final token has no teacher row of its own
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return TeacherShard(torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                        torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
                        torch.tensor([r.prompt_len for r in rows], dtype=torch.int32),
                        torch.cat([x for r in rows for x in r.ids]),
                        torch.cat([x for r in rows for x in r.logprobs]),
                        torch.cat([x for r in rows for x in r.feats]) if features else None)


def build_teacher_store(target, seq_folder: str, out: str, k: int = 32, features: bool = True,
                        log=print, hidden_layers=None) -> None:
    """teacher_<i>.safetensors for every seqs_<i>.pt of ``seq_folder`` that has none yet."""
    from specrt.training.onpolicy import SequenceShard, shard_paths

    os.makedirs(out, exist_ok=True)
    t_start, total = time.time(), 0
    for path in shard_paths(seq_folder):
        name = os.path.basename(path).replace("seqs_", "teacher_").replace(".pt", ".safetensors")
        dst = os.path.join(out, name)
        if os.path.exists(dst):
            continue
        t0 = time.time()
        s = SequenceShard.load(path)
        sparse_targets(target, s.token_ids, s.prompt_lens, k, features, hidden_layers=hidden_layers).save(dst)
        total += s.num_tokens
        log(f"{name}: {s.num_tokens} positions in {time.time() - t0:.0f}s "
            f"({s.num_tokens / (time.time() - t0):.0f} tok/s; {total} total, {time.time() - t_start:.0f}s)")


def generate_store(target, tokenizer, out: str, split: str, num_prompts: int, batch: int, max_new_tokens: int,
                   temperatures: list[float], k: int = 32, features: bool = True, seed: int = 0, log=print,
                   hidden_layers=None, prompt_records=None) -> None:
    """On-policy shards teacher_<i>.safetensors of ``batch`` built-in prompts each (resumable;
    ``prompt_records``: these prompts instead, as specrt.training.prompts builds them)."""
    from specrt.training.prompts import build_prompts, render

    os.makedirs(out, exist_ok=True)
    records = prompt_records if prompt_records is not None else build_prompts(split, num_prompts, seed)
    prompts = [render(p, tokenizer) for p in records]
    t_start, total = time.time(), 0
    for shard, start in enumerate(range(0, len(prompts), batch)):
        dst = os.path.join(out, f"teacher_{shard:05d}.safetensors")
        if os.path.exists(dst):
            continue
        t0 = time.time()
        chunk = prompts[start:start + batch]
        temps = [temperatures[(start + i) % len(temperatures)] for i in range(len(chunk))]
        st = generate_and_record(target, chunk, temps, max_new_tokens, k, tokenizer.eos_token_ids, features,
                                 seed=seed * 1_000_003 + shard, hidden_layers=hidden_layers)
        st.save(dst)
        n = st.token_ids.numel()
        total += n
        log(f"{os.path.basename(dst)}: {len(chunk)} sequences, {n} positions "
            f"({n - sum(len(p) for p in chunk)} generated) in {time.time() - t0:.0f}s "
            f"({n / (time.time() - t0):.0f} positions/s; {total} total, {time.time() - t_start:.0f}s)")


def text_store(target, tokenizer, out: str, names: list[str], split: str, max_len: int = 512, k: int = 32,
               features: bool = True, hidden_layers=None, shard_positions: int = 65536, log=print) -> None:
    """Teacher-forced shards teacher_<i>.safetensors of the raw text of ``names``
    (specrt.training.sources: code, documentation), as sequences of at most ``max_len`` tokens
    (every position trained on); one batched prefill per 2,048 tokens (resumable by shard)."""
    from specrt.training.sources import source_texts

    seqs: list[list[int]] = []
    for name in names:
        for text in source_texts(name, split):
            ids = tokenizer.encode(text)
            seqs += [ids[i:i + max_len] for i in range(0, len(ids), max_len) if len(ids[i:i + max_len]) > 1]
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0)).tolist()
    seqs = [seqs[i] for i in order]  # shards mix the sources
    os.makedirs(out, exist_ok=True)
    t_start, total, shard, i = time.time(), 0, 0, 0
    log(f"{len(seqs)} sequences, {sum(map(len, seqs))} positions of {names} ({split})")
    while i < len(seqs):
        j, n = i, 0
        while j < len(seqs) and (j == i or n + len(seqs[j]) <= shard_positions):
            n += len(seqs[j])
            j += 1
        dst = os.path.join(out, f"teacher_{shard:05d}.safetensors")
        if not os.path.exists(dst):
            t0 = time.time()
            sparse_targets(target, seqs[i:j], [1] * (j - i), k, features, hidden_layers=hidden_layers).save(dst)
            total += n
            log(f"{os.path.basename(dst)}: {j - i} sequences, {n} positions in {time.time() - t0:.0f}s "
                f"({n / (time.time() - t0):.0f} positions/s; {total} total, {time.time() - t_start:.0f}s)")
        shard, i = shard + 1, j


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.teacher", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model folder, .gguf file or name (smollm2-135m)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", default=None, help="teacher pass over a folder of seqs_*.pt (specrt.training.onpolicy)")
    ap.add_argument("--split", choices=["train", "heldout"], default="train",
                    help="without --seqs: generate on-policy from this built-in prompt split")
    ap.add_argument("--sources", action="store_true",
                    help="on-policy answers to prompts mixed from every installed source "
                         "(specrt.training.sources: stdlib code, HumanEval, Python docs, chat) "
                         "instead of the built-in templates alone")
    ap.add_argument("--text-sources", default=None,
                    help="teacher-forced raw text of these sources 'a,b' (e.g. stdlib-code,python-reference)")
    ap.add_argument("--max-len", type=int, default=512, help="--text-sources: tokens per sequence")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--temperatures", default="0,0.7,1.0,0", help="cycled over the prompts")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--no-features", action="store_true", help="layer drafts only: skip the hidden states")
    ap.add_argument("--feature-layers", default=None,
                    help="EAGLE-3 features: target layers 'i,j,..' whose outputs are stored concatenated "
                         "(num_layers = the final-normed state); default the final-normed state alone")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specrt.models import load_model, load_tokenizer

    from specrt.models.registry import resolve_model

    args.target = str(resolve_model(args.target, "target"))
    target = load_model(args.target, dtype=args.dtype)
    layers = None if args.feature_layers is None else tuple(int(i) for i in args.feature_layers.split(","))
    if args.seqs:
        build_teacher_store(target, args.seqs, args.out, args.topk, not args.no_features, hidden_layers=layers)
    elif args.text_sources:
        text_store(target, load_tokenizer(args.target), args.out, args.text_sources.split(","), args.split,
                   args.max_len, args.topk, not args.no_features, layers)
    else:
        records = None
        if args.sources:
            from specrt.training.sources import mixed_prompts
            records = mixed_prompts(args.split, args.num_prompts, args.seed)
        generate_store(target, load_tokenizer(args.target), args.out, args.split, args.num_prompts, args.batch,
                       args.max_new_tokens, [float(t) for t in args.temperatures.split(",")], args.topk,
                       not args.no_features, args.seed, hidden_layers=layers, prompt_records=records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
