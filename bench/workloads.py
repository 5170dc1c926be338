"""What the end-to-end benchmark decodes: its settings and its prompts.

Prompts come from the held-out stdlib modules (``specrt.training.corpus.HELD_OUT_MODULES``,
never trained on) plus a few fixed free-text snippets, in four categories: code completion,
docstring/comment writing, repetition-heavy continuation and free text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CATEGORIES = ("code", "docstring", "repetition", "free_text")

FREE_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father "
    "had taught him. On clear nights he could see the lights of three villages along the coast, and",
    "Bread dough needs time more than it needs effort. Mix the flour, water, salt and yeast, then leave "
    "the bowl covered in a warm place until the dough has doubled in size. After that,",
    "In the spring the river rose over its banks and the low fields turned into a shallow lake. Children "
    "from the farms built rafts out of old doors, and the teacher, who had grown up there,",
    "A good map leaves things out. The cartographer decides which roads, rivers and hills matter for the "
    "reader, and everything else is quietly dropped, so that what remains can be read at a glance while",
    "The committee met on Tuesday to discuss the budget for next year. Most members agreed that the "
    "library needed new windows, but the question of the heating system was postponed because",
    "Rain had fallen for nine days when the letter finally arrived. It was written in a careful, slanted "
    "hand, and it said only that the traveller would come back before the harvest, and that",
)


@dataclass
class Settings:
    """Sizes of one benchmark run (defaults: the full run)."""

    prompts_per_category: int = 4
    max_tokens: int = 96
    max_prompt_tokens: int = 256
    repeats: int = 5
    draft_length: int = 4
    ks: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    temperatures: tuple = (0.0, 0.7, 1.0)
    batch_sizes: tuple = (1, 2, 4, 8, 16, 32)
    batch_max_tokens: int = 64
    batch_repeats: int = 9        # whole batches are short units: more repeats to tame timing noise
    batch_requests_per_slot: int = 2   # batch section: requests served per unit of concurrency
    peer_prompts: int = 8
    cost_reps: int = 40
    sweep_prompts_per_category: int = 2
    misaligned_cases: int = 3
    penalty_temperatures: tuple = (0.0, 0.8)   # penalties: greedy and sampled
    penalty_vocab_sizes: tuple = (32000, 128256)   # penalties: per-verify op costs at these V (and the target's)
    batching_requests_per_kind: int = 12      # batching: repetitive and free-text requests, each
    batching_batch_size: int = 4              # batching: max_batch_size, fewer than the requests
    long_contexts: tuple = (512, 1024, 2048)  # long_context: prompt lengths (cut to the model's context)
    long_windows: tuple = (128, 256)          # long_context: draft KV windows W beside the full cache
    long_sinks: int = 4                       # long_context: attention sinks S
    long_prompts: int = 3                     # long_context: prompts per context length
    long_max_tokens: int = 40                 # long_context: new tokens per prompt

    @classmethod
    def quick(cls) -> "Settings":
        return cls(prompts_per_category=2, max_tokens=40, max_prompt_tokens=160, repeats=3, ks=(1, 2, 3, 4, 6, 8),
                   batch_sizes=(1, 4, 16, 32), batch_max_tokens=32, peer_prompts=4, cost_reps=25,
                   sweep_prompts_per_category=1, misaligned_cases=2, penalty_temperatures=(0.0,),
                   batching_requests_per_kind=8, long_contexts=(512, 2048), long_windows=(256,), long_prompts=2)

    @classmethod
    def minimal(cls) -> "Settings":
        """For the smoke test: every section, tiny sizes."""
        return cls(prompts_per_category=1, max_tokens=8, max_prompt_tokens=48, repeats=1, ks=(1, 2),
                   batch_sizes=(1, 2), batch_max_tokens=6, peer_prompts=1, cost_reps=2,
                   sweep_prompts_per_category=1, draft_length=2, batch_repeats=1, penalty_temperatures=(0.0, 0.8),
                   penalty_vocab_sizes=(), batching_requests_per_kind=2, batching_batch_size=2,
                   long_contexts=(64, 96), long_windows=(16,), long_prompts=1, long_max_tokens=6)


@dataclass(frozen=True)
class Prompt:
    name: str                 # where it was cut from ("module.py@offset", "free3", ...)
    token_ids: list[int]      # [<= max_prompt_tokens]


def heldout_files() -> list[tuple[str, str]]:
    """[(relative path, text)] of the held-out stdlib modules."""
    from specrt.training.corpus import read_text, split_files

    _, held = split_files()
    return [(f.relpath, read_text(f)) for f in held]


def pick(cands: list, n: int) -> list:
    """n items spread evenly over cands (all of them when there are at most n)."""
    if len(cands) <= n:
        return list(cands)
    return [cands[(i * len(cands)) // n + len(cands) // (2 * n)] for i in range(n)]


def _cut_points(rel: str, text: str) -> tuple[list, list, list]:
    """(code, docstring, repetition) candidate prompts of one module."""
    code, doc, rep = [], [], []
    for m in re.finditer(r"\n( {8,})(return |if |for |while |\w+ = |\w+\.append\()", text):
        if m.start() > 800:
            code.append((f"{rel}@{m.start()}", text[:m.start() + 1 + len(m.group(1))]))
    for m in re.finditer(r"\n *def \w+\([^\n]*\):\n( +)\"\"\"", text):
        doc.append((f"{rel}@{m.end()}", text[:m.end()]))
    for m in re.finditer(r"\n( +)# ", text):
        if m.start() > 800:
            doc.append((f"{rel}@{m.end()}#", text[:m.end()]))
    lines = text.split("\n")
    for i in range(40, len(lines) - 12, 97):
        block = [ln for ln in lines[i:i + 10] if ln.strip()]
        if len(block) >= 6:
            chunk = "\n".join(block)
            head = "\n".join(block[:2])
            rep.append((f"{rel}:{i}x2", f"{chunk}\n\n\n{chunk}\n\n\n{head}\n"))
    return code, doc, rep


def build_prompt_texts(n: int) -> dict[str, list[tuple[str, str]]]:
    """{category: [(name, prompt text)]} from the held-out stdlib modules and FREE_TEXT."""
    code, doc, rep = [], [], []
    for rel, text in heldout_files():
        c, d, r = _cut_points(rel, text)
        code += c
        doc += d
        rep += r
    return {"code": pick(code, n), "docstring": pick(doc, n), "repetition": pick(rep, n),
            "free_text": [(f"free{i}", FREE_TEXT[i % len(FREE_TEXT)]) for i in range(n)]}


def build_prompts(tokenizer, n: int, max_prompt_tokens: int) -> dict[str, list[Prompt]]:
    """Tokenized prompts; long ones keep their LAST max_prompt_tokens tokens (the cut point)."""
    return {cat: [Prompt(name, tokenizer.encode(text)[-max_prompt_tokens:]) for name, text in items]
            for cat, items in build_prompt_texts(n).items()}


def mixed_workload(tokenizer, n: int, max_prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """n repetition-heavy (n-gram friendly) and n free-text prompts, interleaved, with their tags
    ("repetitive" / "free_text"): the mixed workload of the batching section."""
    cats = build_prompts(tokenizer, n, max_prompt_tokens)
    prompts, tags = [], []
    for i in range(n):
        for tag, cat in (("repetitive", "repetition"), ("free_text", "free_text")):
            if i < len(cats[cat]):
                prompts.append(cats[cat][i].token_ids)
                tags.append(tag)
    return prompts, tags


def long_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of ``length`` tokens: windows spread over the held-out modules, concatenated."""
    ids: list[int] = []
    for _, text in heldout_files():
        ids += tokenizer.encode(text)
        if len(ids) >= (n + 1) * length:
            break
    if len(ids) < length:
        raise ValueError(f"long_contexts: the held-out modules give only {len(ids)} tokens, fewer than {length}")
    step = max((len(ids) - length) // max(n, 1), 1)
    return [ids[i * step:i * step + length] for i in range(n)]
