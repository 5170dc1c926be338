"""Teacher stores larger than memory: many ``teacher_*.safetensors`` shards read lazily.

A training run over millions of positions cannot hold the features in RAM (an EAGLE-3 draft's
fused features are 3 x hidden bf16 values per position: 3.5 KB at SmolLM2's 576, 17 GB per 5M
positions). ``TeacherStore`` keeps the small per-position arrays (token ids, offsets, prompt
lengths) in memory and reads a sequence's top-k rows and features from disk when a batch asks
for it (safetensors slices; the page cache keeps what fits).

    store = open_teacher_store(["WORK/train", "WORK/sources/stdlib-code"])
    ids, top_ids, top_lp, feats = store.sequence_rows(17)     # [n], [n, k], [n, k], [n, F] | None
"""
from __future__ import annotations

import bisect
import glob
import os

import torch


class _LazyShard:
    """One shard: token ids / offsets / prompt lengths in memory, the rest sliced on demand."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self._f = safe_open(path, framework="pt")
        names = set(self._f.keys())
        missing = {"token_ids", "offsets", "prompt_lens", "topk_ids", "topk_logprobs"} - names
        if missing:
            raise ValueError(f"{path}: not a teacher shard (missing {sorted(missing)})")
        self.token_ids = self._f.get_tensor("token_ids")      # [N] int32
        self.offsets = self._f.get_tensor("offsets")          # [S+1] int64
        self.prompt_lens = self._f.get_tensor("prompt_lens")  # [S] int32
        self.k = self._f.get_slice("topk_ids").get_shape()[1]
        self.feature_width = self._f.get_slice("features").get_shape()[1] if "features" in names else None

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self._f.get_slice(name)[lo:hi]

    def topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._f.get_tensor("topk_ids"), self._f.get_tensor("topk_logprobs")


class TeacherStore:
    """The shards of one or more folders as one sequence-indexed store (``TeacherShard``'s
    sequence interface: num_sequences, offsets, prompt_lens, token_ids, sequence_rows)."""

    def __init__(self, paths: list[str]):
        if not paths:
            raise ValueError("no teacher shards")
        self.shards = [_LazyShard(p) for p in paths]
        widths = {s.feature_width for s in self.shards}
        if len(widths) != 1:
            raise ValueError(f"teacher shards disagree on their features' width: {sorted(map(str, widths))} "
                             f"(stores of different --feature-layers cannot train one draft)")
        self.feature_width = widths.pop()
        offs, base = [torch.zeros(1, dtype=torch.int64)], 0
        self._first_seq = [0]  # global index of each shard's first sequence
        for s in self.shards:
            offs.append(s.offsets[1:] + base)
            base += s.token_ids.shape[0]
            self._first_seq.append(self._first_seq[-1] + s.prompt_lens.shape[0])
        self.offsets = torch.cat(offs)                                   # [S+1] int64
        self.prompt_lens = torch.cat([s.prompt_lens for s in self.shards])  # [S] int32
        self.token_ids = torch.cat([s.token_ids for s in self.shards])      # [N] int32

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.shape[0]

    @property
    def num_positions(self) -> int:
        return self.token_ids.shape[0]

    def sequence_rows(self, s: int):
        """Sequence s: (token ids [n] int32, top-k ids [n, k] int32, top-k log-probs [n, k] fp16,
        features [n, F] bf16 or None)."""
        i = bisect.bisect_right(self._first_seq, s) - 1
        shard, local = self.shards[i], s - self._first_seq[i]
        lo, hi = int(shard.offsets[local]), int(shard.offsets[local + 1])
        feats = shard.rows("features", lo, hi) if shard.feature_width is not None else None
        return shard.token_ids[lo:hi], shard.rows("topk_ids", lo, hi), shard.rows("topk_logprobs", lo, hi), feats

    def teacher_mass(self, vocab_size: int) -> torch.Tensor:
        """[V] float64: the teacher's probability mass per token over every stored position."""
        from specrt.training.vocab import teacher_mass

        total = torch.zeros(vocab_size, dtype=torch.float64)
        for s in self.shards:
            total += teacher_mass(*s.topk(), vocab_size).double()
        return total


def shard_files(folders: list[str]) -> list[str]:
    paths = []
    for d in folders:
        paths.extend(sorted(glob.glob(os.path.join(d, "teacher_*.safetensors"))))
    return paths


def open_teacher_store(folders: list[str]) -> TeacherStore:
    """Every teacher_*.safetensors of ``folders`` (in order), read lazily."""
    paths = shard_files(folders)
    if not paths:
        raise ValueError(f"no teacher shards (teacher_*.safetensors) in {folders}")
    return TeacherStore(paths)
