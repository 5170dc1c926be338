"""`specrt bench` — end-to-end benchmarks that measure what speculative decoding buys.

    specrt bench --quick [--out DIR]                 # every section, small; minutes on a laptop CPU
    specrt bench [--target builtin --draft builtin] [--device cuda] [--out DIR]
    specrt bench cost-curve [--shape 8b] [--device cuda]   # random-weight Llama-shaped cost curves

Every comparison runs autoregressive (AR) and speculative decoding of the SAME target in
the same process, alternating the order of the modes from one repeat to the next, and
reports medians over repeats. Sections (all in one JSON, one markdown report, PNG plots):

- ``costs``      single target forwards for 1..K+1 tokens and single draft steps, timed in
                 this run: c = draft step / target step, v(K) = t_target(K+1) / t_target(1) - 1.
- ``categories`` code completion, docstring/comment writing, repetition-heavy continuation,
                 free text; model, n-gram and self:N drafters; speedup, tau, acceptance per
                 position, and the fraction of the theoretical speedup tau / (1 + c*K + v).
- ``k_sweep``    fixed K = 1..8 vs the dynamic policies (confidence, head, budget); the
                 formula E[accepted] = sum_{i=1..K} r^i against what was measured per K.
- ``temperature``0, 0.7, 1.0 (rejection sampling; plus coupled acceptance).
- ``batch``      batch size 1..32: throughput of AR, fixed K and the budget policy.
- ``misaligned`` the draft sampled with a different top-p / temperature than the target
                 (a benchmark-only engine subclass; the engine itself always aligns them).
- ``peer``       Hugging Face transformers greedy and assisted generation on the same weights.

Prompts come from the held-out stdlib modules (``specrt.training.corpus.HELD_OUT_MODULES``,
never trained on) plus a few fixed free-text snippets below.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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

    @classmethod
    def quick(cls) -> "Settings":
        return cls(prompts_per_category=2, max_tokens=40, max_prompt_tokens=160, repeats=3, ks=(1, 2, 3, 4, 6, 8),
                   batch_sizes=(1, 4, 16, 32), batch_max_tokens=32, peer_prompts=4, cost_reps=25,
                   sweep_prompts_per_category=1, misaligned_cases=2)

    @classmethod
    def minimal(cls) -> "Settings":
        """For the smoke test: every section, tiny sizes."""
        return cls(prompts_per_category=1, max_tokens=8, max_prompt_tokens=48, repeats=1, ks=(1, 2),
                   batch_sizes=(1, 2), batch_max_tokens=6, peer_prompts=1, cost_reps=2,
                   sweep_prompts_per_category=1, draft_length=2, batch_repeats=1)


def _loadavg():
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _now() -> float:
    return time.perf_counter()


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median: order statistics x(k) .. x(n+1-k)
    with the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is still >= level. Returns
    (low, high, coverage); with too few values for that level, the whole range and its coverage
    (1 - 2^(1-n))."""
    xs = sorted(x for x in xs if x == x)
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), 0.0
    # [x(k), x(n+1-k)] covers the median with probability 1 - 2 P(B <= k-1)
    cdf = 0.5 ** n
    k, cov = 1, 1.0 - 2.0 * cdf
    for j in range(1, (n + 1) // 2):
        cdf += math.comb(n, j) * 0.5 ** n          # P(B <= j)
        if 1.0 - 2.0 * cdf < level:
            break
        k, cov = j + 1, 1.0 - 2.0 * cdf
    return xs[k - 1], xs[n - k], cov


# ---------------------------------------------------------------------------------------- prompts

def _heldout_files():
    from specrt.training.corpus import read_text, split_files

    _, held = split_files()
    return [(f.relpath, read_text(f)) for f in held]


def _pick(cands: list, n: int) -> list:
    if len(cands) <= n:
        return list(cands)
    return [cands[(i * len(cands)) // n + len(cands) // (2 * n)] for i in range(n)]


def build_prompt_texts(n: int) -> dict[str, list[tuple[str, str]]]:
    """{category: [(name, prompt text)]} from the held-out stdlib modules and FREE_TEXT."""
    files = _heldout_files()
    code, doc, rep = [], [], []
    for rel, text in files:
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
    return {"code": _pick(code, n), "docstring": _pick(doc, n), "repetition": _pick(rep, n),
            "free_text": [(f"free{i}", FREE_TEXT[i % len(FREE_TEXT)]) for i in range(n)]}


def build_prompts(tokenizer, n: int, max_prompt_tokens: int) -> dict[str, list[dict]]:
    """Tokenized prompts; long ones keep their LAST max_prompt_tokens tokens (the cut point)."""
    out = {}
    for cat, items in build_prompt_texts(n).items():
        out[cat] = [{"name": name, "token_ids": tokenizer.encode(text)[-max_prompt_tokens:]}
                    for name, text in items]
    return out


# ---------------------------------------------------------------------------------- model pair

def _char_tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n", "\t"]:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def random_pair(root: Path) -> tuple[Path, Path]:
    """A random-weight char-level Llama pair (fallback when the built-in pair is not installed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=112, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    target = LlamaForCausalLM(cfg).eval()
    dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(dcfg).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < 1}, strict=False)
    dirs = root / "target", root / "draft"
    for m, d in zip((target, draft), dirs):
        m.save_pretrained(str(d), safe_serialization=True)
        _char_tokenizer(d)
    return dirs


def resolve_pair(target: str, draft: str, log=print) -> tuple[str, str, str]:
    """(target, draft, note). 'builtin' falls back, with a clear message, to a random pair."""
    from specrt.loading import BUILTIN_DIR

    if target == "builtin" and not (BUILTIN_DIR / "target" / "config.json").is_file():
        root = Path(tempfile.mkdtemp(prefix="specrt-bench-"))
        t, d = random_pair(root)
        note = (f"THE BUILT-IN PAIR IS NOT INSTALLED ({BUILTIN_DIR}); benchmarking a RANDOM-WEIGHT char-level "
                f"pair instead (timings are real, acceptance numbers are meaningless). Pass --target/--draft.")
        log("specrt bench: " + note)
        return str(t), (str(d) if draft == "builtin" else draft), note
    if draft == "builtin" and not (BUILTIN_DIR / "draft" / "config.json").is_file():
        note = "the built-in draft is missing; using draft='self:2'"
        log("specrt bench: " + note)
        return target, "self:2", note
    return target, draft, ""


def _model_dir(path: str, role: str) -> Path:
    from specrt.loading import resolve_model_path

    return resolve_model_path(path, role)


# ------------------------------------------------------------------------------- engine helpers

def _misaligned(misalign: dict):
    """A drafter hook for the misaligned-sampling study: the draft's rows get other sampling
    parameters (temperature / top-p) than the target's. The engine itself never does this; the
    output stays exact (rejection sampling uses the q actually sampled from), only the
    acceptance rate suffers -- which is what the aligned transform protects."""
    change = {k: misalign[k] for k in ("temperature", "top_p") if misalign.get(k) is not None}

    def wrap(drafter):
        drafter.draft_params = lambda p: dataclasses.replace(p, **change)
        return drafter
    return wrap


def make_llm(target, draft, spec, device, dtype=None, misalign: dict | None = None, model_loader=None):
    import specrt

    hooks = {} if model_loader is None else {"model_loader": model_loader}
    if misalign is not None:
        hooks["wrap_drafter"] = _misaligned(misalign)
    return specrt.LLM(target=target, draft=draft, spec=spec, device=device, dtype=dtype, **hooks)


def _shared_loader(store: dict):
    """A model loader sharing loaded models (read-only weights) by (path, dtype, device): every
    mode of a comparison then runs literally the same target, and on a CPU no mode's weights
    are colder in the caches than another's because they are a different copy."""
    from specrt.loading import default_loader

    def load(path, role, dtype, device):
        key = (str(Path(path).resolve()), str(dtype), str(device))
        if key not in store:
            store[key] = default_loader(path, role, dtype, device)
        return store[key]
    return load


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def generate_concurrent(llm, prompts: list[list[int]], params, concurrency: int):
    """Serve ``prompts`` with at most ``concurrency`` requests in flight: the first
    ``concurrency`` start together, and each one that finishes is replaced by the next prompt at
    once (continuous batching, as a server under steady load sees it). Outputs in prompt order."""
    eng = llm.engine
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids: list[str] = []
    live: set[str] = set()
    done: dict = {}
    while len(done) < len(prompts):
        while len(live) < concurrency and len(ids) < len(prompts):
            i = len(ids)
            ids.append(eng.add_request(prompts[i], params[i]))
            live.add(ids[-1])
        for out in eng.step():
            if out.finished and out.request_id in live:
                live.discard(out.request_id)
                done[out.request_id] = out
    return [done[i] for i in ids]


def _generate_timed(llm, prompts: list[list[int]], params, batched: bool,
                    concurrency: int | None = None) -> tuple[float, list[list[int]]]:
    _sync(llm.engine.device)
    t0 = _now()
    if concurrency:
        outs = generate_concurrent(llm, prompts, params, concurrency)
    elif batched:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate([p], params)[0] for p in prompts]
    _sync(llm.engine.device)
    return _now() - t0, [o.token_ids for o in outs]


def compare(modes: dict, prompts: list[list[int]], repeats: int, batched: bool = False,
            baseline: str = "ar", concurrency: int | None = None) -> dict:
    """modes: {name: (llm, params)}, each with its own LLM. Batch 1 (batched=False): for every
    prompt all modes run back to back, in a (seeded) random order that changes from prompt to
    prompt and from repeat to repeat, so machine noise and position effects (a mode that runs
    right after itself finds its weights in the CPU caches) hit every mode alike; batched: the whole batch is
    one unit. Time of a mode = sum over units of the median over repeats; its speedup is the
    median over repeats of that repeat's time ratio to the baseline (paired). Stats (acceptance,
    tau, ...) are one repeat's, over all prompts (seeded: every repeat decodes the same tokens).
    concurrency: all prompts are one unit served with at most that many in flight
    (``generate_concurrent``)."""
    names = list(modes)
    batched = batched or bool(concurrency)
    units = [prompts] if batched else [[p] for p in prompts]
    secs = {m: [[0.0] * repeats for _ in units] for m in names}
    ids = {m: [None] * len(units) for m in names}
    stats, plan_s = {}, {m: 0.0 for m in names}
    for rep in range(repeats):
        for m in names:
            modes[m][0].engine.reset_metrics()
        for u, unit in enumerate(units):
            order = list(names)
            random.Random(1000 * rep + u).shuffle(order)
            for m in order:
                llm, params = modes[m]
                secs[m][u][rep], out = _generate_timed(llm, unit, params, batched, concurrency)
                ids[m][u] = out
        for m in names:
            llm = modes[m][0]
            snap = llm.stats()
            stats[m] = snap["total"]
            plan_s[m] = snap.get("plan_time_s", 0.0)
    res = {}
    for m in names:
        sec = sum(_median(per_unit) for per_unit in secs[m])
        tokens = sum(len(t) for out in ids[m] for t in out)
        st = stats[m]
        res[m] = {"seconds_median": sec, "seconds_all": [sum(secs[m][u][r] for u in range(len(units)))
                                                         for r in range(repeats)],
                  "tokens": tokens, "tokens_per_s": tokens / sec if sec > 0 else float("nan"),
                  "mean_accepted_length": st.get("mean_accepted_length", 0.0),
                  "tau": st.get("tokens_per_target_forward", 1.0),
                  "acceptance_rate_per_position": st.get("acceptance_rate_per_position", []),
                  "draft_hit_rate": st.get("draft_hit_rate", 0.0),
                  "drafted_tokens_per_step": st.get("drafted_tokens_per_step", 0.0),
                  "policy_plan_fraction": plan_s[m] / (sum(secs[m][u][-1] for u in range(len(units))) or 1.0),
                  "steps": st.get("steps", 0), "draft_time_s": st.get("draft_time_s", 0.0),
                  "verify_time_s": st.get("verify_time_s", 0.0),
                  "token_ids": [t for out in ids[m] for t in out]}
    base = res.get(baseline)
    for m, v in res.items():
        if base:
            # paired: each repeat's ratio (the modes of one repeat ran back to back, so slow
            # drifts of a shared machine cancel), then the median over repeats
            scale = v["tokens"] / base["tokens"] if base["tokens"] else 1.0
            ratios = [b / x * scale for b, x in zip(base["seconds_all"], v["seconds_all"]) if x > 0]
            v["speedup"] = _median(ratios or [float("nan")])
            v["speedup_ratios"] = ratios
            # how far the paired median can be trusted on this machine (see median_interval)
            lo, hi, cov = median_interval(ratios)
            v["speedup_interval"] = [lo, hi]
            v["speedup_interval_coverage"] = cov
            v["speedup_of_medians"] = v["tokens_per_s"] / base["tokens_per_s"]
            v["identical_to_ar"] = v["token_ids"] == base["token_ids"]
    return res


def _strip_ids(d: dict) -> dict:
    return {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in d.items()}


# ------------------------------------------------------------------------------- cost measurement

def _timed(fn, reps: int, device) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = _now()
        fn()
        _sync(device)
        times.append(_now() - t0)
    return _median(times)


def _timed_interleaved(fns: dict, reps: int, device) -> dict:
    """Median seconds of each callable, timed round-robin (one call of each per round)."""
    for fn in fns.values():
        fn()
    _sync(device)
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = _now()
            fn()
            _sync(device)
            times[k].append(_now() - t0)
    return {k: _median(v) for k, v in times.items()}


def scratch_cache(model, ctx: int, tokens: int, batch: int = 1, block_size: int = 16) -> torch.Tensor:
    """A KV cache big enough for `batch` requests of ctx + tokens positions (shared by timers)."""
    cfg = model.config
    nb = -(-(ctx + tokens) // block_size)
    return torch.zeros(cfg.num_layers, 2, nb * batch + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                       dtype=model.dtype, device=model.device)


def forward_timer(model, ctx: int, tokens: int, batch: int = 1, num_layers: int | None = None,
                  block_size: int = 16, all_logits: bool = True, cache: torch.Tensor | None = None):
    """A closure running one forward of `tokens` new tokens per request after `ctx` cached
    positions, for `batch` requests, over a private scratch KV cache (values do not matter)."""
    from specrt import ops
    from specrt.attention import AttentionMetadata

    cfg = model.config
    dev = model.device
    seq = ctx + tokens
    nb = -(-seq // block_size)
    if cache is None:
        cache = scratch_cache(model, ctx, tokens, batch, block_size)
    if cache.shape[2] < nb * batch:
        raise ValueError(f"scratch cache has {cache.shape[2]} blocks, need {nb * batch}")
    tables = [list(range(b * nb, (b + 1) * nb)) for b in range(batch)]
    meta = AttentionMetadata.build([seq] * batch, [tokens] * batch, tables, block_size, dev)
    ids = torch.randint(3, cfg.vocab_size, (tokens * batch,), device=dev)
    pos = torch.arange(ctx, seq, device=dev).repeat(batch)
    rows = torch.arange(tokens * batch, device=dev) if all_logits else \
        torch.arange(tokens - 1, tokens * batch, tokens, device=dev)
    n = rows.numel()
    temps = torch.zeros(n, device=dev)
    topk = torch.zeros(n, dtype=torch.int32, device=dev)
    topp = torch.ones(n, device=dev)

    def fn():
        logits, _ = model(ids, pos, meta, cache, num_layers=num_layers, logits_indices=rows)
        return ops.probs_from_logits(logits, temps, topk, topp, check_values=False)
    return fn


def measure_costs(llm_by_drafter: dict, kmax: int, ctx: int, reps: int) -> dict:
    """Single-forward costs on this machine, this run: target step vs number of verified tokens,
    one draft step per drafter, c and v."""
    from specrt.drafters import NgramProposer

    any_llm = next(iter(llm_by_drafter.values()))
    eng = any_llm.engine
    dev = eng.device
    target = eng.target
    ctx = min(ctx, eng.max_model_len - kmax - 2)
    # interleaved (round-robin over T, drafters) so machine noise hits every size alike
    t_cache = scratch_cache(target, ctx, kmax + 1)
    fns = {("target", T): forward_timer(target, ctx, T, cache=t_cache) for T in range(1, kmax + 2)}
    for name, llm in llm_by_drafter.items():
        e = llm.engine
        if e.draft_kind == "model":
            fns[("draft", name)] = forward_timer(e.drafter.model, ctx, 1)
        elif e.draft_kind == "self":
            fns[("draft", name)] = forward_timer(e.target, ctx, 1, num_layers=e.drafter.num_layers, cache=t_cache)
        elif e.draft_kind == "ngram":
            ctx_ids = [int(x) for x in torch.randint(3, 50, (ctx,))]
            prop = NgramProposer()
            fns[("draft", name)] = (lambda p=prop, c=ctx_ids: [p.propose(c, kmax) for _ in range(kmax)])
    times = _timed_interleaved(fns, reps, dev)
    t_target = {T: times[("target", T)] for T in range(1, kmax + 2)}
    t1 = t_target[1]
    out = {"context_tokens": ctx, "target_step_s": t_target,
           "v": {K: t_target[K + 1] / t1 - 1.0 for K in range(1, kmax + 1)}, "draft_step_s": {}, "c": {}}
    for name, llm in llm_by_drafter.items():
        if ("draft", name) not in times:
            continue
        t = times[("draft", name)]
        if llm.engine.draft_kind == "ngram":
            t /= kmax * kmax         # per proposed token (kmax proposals of kmax tokens were timed)
        out["draft_step_s"][name] = t
        out["c"][name] = t / t1
    return out


def theoretical_speedup(tau: float, c: float, k: float, v: float) -> float:
    return tau / (1.0 + c * k + v)


def _v_at(costs: dict, k: float) -> float:
    """v for a (possibly fractional) mean draft length, linear between measured integers."""
    if k <= 0:
        return 0.0
    vs = costs["v"]
    lo = max(1, min(int(math.floor(k)), max(vs)))
    hi = min(lo + 1, max(vs))
    f = min(max(k - lo, 0.0), 1.0)
    v_lo = vs[lo] if k >= 1 else vs[1] * k
    return v_lo + f * (vs[hi] - vs[lo])


def expected_accepted(fixed: dict) -> tuple[float, dict, list[float]]:
    """E[accepted drafts per step] = sum_{i=1..K} r^i against the measurement, per fixed K.

    The engine's acceptance_rate_per_position[i] is accepted-at-i / drafted-at-i; with a fixed K
    every position is drafted every step, so it is P(the first i+1 drafts are all accepted) (a
    survival curve), and the mean accepted length is its sum. Hence:
    r = the rate at position 0 of the smallest K (P(first draft accepted));
    formula_iid = sum_{i=1..K} r^i (every position accepted independently with probability r);
    formula_per_position = sum of the first K survival rates measured at the largest K (exact if
    the first K drafts do not depend on K, e.g. greedy drafting); conditional_i = s_i / s_{i-1}."""
    ks = sorted(int(k) for k in fixed)
    r = (fixed[ks[0]]["acceptance_rate_per_position"] or [0.0])[0]
    surv = fixed[ks[-1]]["acceptance_rate_per_position"]
    conditional = [surv[i] / surv[i - 1] if i and surv[i - 1] > 0 else surv[i] for i in range(len(surv))]
    expected = {k: {"measured": fixed[k]["mean_accepted_length"],
                    "formula_iid": sum(r ** i for i in range(1, k + 1)),
                    "formula_per_position": sum(surv[:k])} for k in ks}
    return r, expected, conditional


# ------------------------------------------------------------------------------------ the bench

class Bench:
    def __init__(self, target: str, draft: str, device, settings: Settings, log=print, note: str = ""):
        self.target, self.draft, self.device, self.s, self.log = target, draft, device, settings, log
        self.note = note
        self._llms: dict = {}
        self._weights: dict = {}    # loaded models shared by every engine of this run
        from specrt.models import load_tokenizer

        self.tokenizer = load_tokenizer(_model_dir(target, "target"))
        self.prompts = build_prompts(self.tokenizer, settings.prompts_per_category, settings.max_prompt_tokens)
        from specrt.models import ModelConfig

        self.target_config = ModelConfig.from_json(_model_dir(target, "target"))
        self.self_layers = max(1, self.target_config.num_layers // 3)
        self.has_draft_model = draft not in (None, "none") and not str(draft).startswith(("ngram", "self:"))
        self.drafters = {}
        if self.has_draft_model:
            self.drafters["model"] = draft
        self.drafters["ngram"] = "ngram"
        self.drafters[f"self:{self.self_layers}"] = f"self:{self.self_layers}"
        self.main_drafter = "model" if self.has_draft_model else f"self:{self.self_layers}"

    def llm(self, draft, misalign: dict | None = None, **spec_kw):
        import specrt

        spec_kw.setdefault("max_batch_size", 32)
        # a KV cache sized for the benchmark, not for the model's full context (allocation time on CPU)
        spec_kw.setdefault("max_model_len", min(self.target_config.max_model_len,
                                                self.s.max_prompt_tokens + max(self.s.max_tokens, self.s.batch_max_tokens * 3 // 2 + 1) + 64))
        dev = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and "kv_cache_budget" not in spec_kw:
            # a byte budget sized for the benchmark: the default (a fraction of FREE memory) would
            # shrink with every engine this harness keeps alive
            spec_kw["kv_cache_budget"] = self._kv_bytes(draft, spec_kw["max_batch_size"], spec_kw["max_model_len"])
        key = (draft, json.dumps(misalign, sort_keys=True), json.dumps(spec_kw, sort_keys=True))
        if key not in self._llms:
            spec = specrt.SpecConfig(**spec_kw)
            llm = make_llm(self.target, draft, spec, self.device, misalign=misalign,
                           model_loader=_shared_loader(self._weights))
            llm.warmup(2, 8)
            self._llms[key] = llm
        return self._llms[key]

    def _kv_bytes(self, draft, max_batch_size: int, max_model_len: int) -> int:
        from specrt.kv_cache import kv_bytes_per_block
        from specrt.models import ModelConfig

        configs = [self.target_config]
        if draft not in (None, "none") and not str(draft).startswith(("ngram", "self:")):
            configs.append(ModelConfig.from_json(_model_dir(draft, "draft")))
        blocks = max_batch_size * (max_model_len // 16 + 2) + 64
        return int(blocks * kv_bytes_per_block(configs, 16, torch.bfloat16) * 2)

    def params(self, temperature=0.0, max_tokens=None, seed=1234):
        import specrt

        return specrt.SamplingParams(temperature=temperature, max_tokens=max_tokens or self.s.max_tokens,
                                     ignore_eos=True, seed=seed)

    def sweep_prompts(self) -> list[list[int]]:
        n = self.s.sweep_prompts_per_category
        return [p["token_ids"] for cat in CATEGORIES for p in self.prompts[cat][:n]]

    # -- sections
    def section_costs(self) -> dict:
        llms = {name: self.llm(d, max_draft_length=self.s.draft_length) for name, d in self.drafters.items()}
        ctx = int(_median([len(p["token_ids"]) for c in CATEGORIES for p in self.prompts[c]])) \
            + self.s.max_tokens // 2
        return measure_costs(llms, max(self.s.ks), ctx, self.s.cost_reps)

    def section_categories(self, costs) -> dict:
        K = self.s.draft_length
        modes = {"ar": (self.llm(None), self.params())}
        for name, d in self.drafters.items():
            modes[name] = (self.llm(d, max_draft_length=K), self.params())
        out = {}
        for cat in CATEGORIES:
            res = compare(modes, [p["token_ids"] for p in self.prompts[cat]], self.s.repeats)
            for m, v in res.items():
                if m != "ar":
                    k = v["drafted_tokens_per_step"]
                    th = theoretical_speedup(v["tau"], costs["c"][m], k, _v_at(costs, k))
                    v["theoretical_speedup"] = th
                    v["fraction_of_theoretical"] = v["speedup"] / th if th > 0 else float("nan")
                    # the same formula with costs measured inside the engine (incl. host overhead)
                    ar = res["ar"]
                    t1 = ar["verify_time_s"] / max(ar["steps"], 1)
                    if t1 > 0 and v["steps"]:
                        v["engine_c"] = (v["draft_time_s"] / v["steps"]) / max(k, 1e-9) / t1 if k else 0.0
                        v["engine_v"] = (v["verify_time_s"] / v["steps"]) / t1 - 1.0
            out[cat] = _strip_ids(res)
        return out

    def section_k_sweep(self) -> dict:
        prompts = self.sweep_prompts()
        d = self.drafters[self.main_drafter]
        kmax = max(self.s.ks)
        modes = {"ar": (self.llm(None), self.params())}
        for k in self.s.ks:
            modes[f"fixed_K{k}"] = (self.llm(d, max_draft_length=k), self.params())
        skipped = {}
        for pol in ("confidence", "head", "budget"):
            try:
                modes[pol] = (self.llm(d, policy=pol, max_draft_length=kmax), self.params())
            except ValueError as e:
                skipped[pol] = str(e)
                self.log(f"  k_sweep: policy {pol} skipped: {e}")
        res = compare(modes, prompts, self.s.repeats)
        fixed = {k: res[f"fixed_K{k}"] for k in self.s.ks}
        best_k = max(fixed, key=lambda k: fixed[k]["speedup"])
        best = fixed[best_k]["speedup"]
        policies = {p: {"speedup": res[p]["speedup"], "gain_over_best_fixed": res[p]["speedup"] / best - 1.0,
                        "mean_draft_length": res[p]["drafted_tokens_per_step"], "tau": res[p]["tau"],
                        "identical_to_ar": res[p]["identical_to_ar"]}
                    for p in ("confidence", "head", "budget") if p in res}
        r, expected, conditional = expected_accepted(fixed)
        return {"drafter": self.main_drafter, "r": r, "modes": _strip_ids(res), "best_fixed_k": best_k,
                "best_fixed_speedup": best, "policies": policies, "skipped": skipped,
                "expected_accepted": expected, "conditional_acceptance_at_kmax": conditional}

    def section_temperature(self) -> dict:
        prompts = self.sweep_prompts()
        d = self.drafters[self.main_drafter]
        K = self.s.draft_length
        out = {}
        for t in self.s.temperatures:
            modes = {"ar": (self.llm(None), self.params(t)),
                     "rejection": (self.llm(d, max_draft_length=K), self.params(t)),
                     "coupled": (self.llm(d, max_draft_length=K, acceptance="coupled"), self.params(t))}
            out[str(t)] = _strip_ids(compare(modes, prompts, self.s.repeats))
        return {"drafter": self.main_drafter, "draft_length": K, "by_temperature": out}

    def section_batch(self) -> dict:
        pool = [p["token_ids"] for cat in CATEGORIES for p in self.prompts[cat]]
        d = self.drafters[self.main_drafter]
        K = self.s.draft_length
        out = {}
        for B in self.s.batch_sizes:
            # concurrency B under continuous batching: batch_requests_per_slot * B requests of
            # varied length (batch_max_tokens/2 .. 3/2 of it), at most B in flight, a finished
            # one replaced at once; so every mode runs at batch B for most of the time, instead
            # of a closed batch whose tail is a few stragglers at batch 1-2
            n = B * self.s.batch_requests_per_slot
            prompts = [pool[i % len(pool)] for i in range(n)]
            mt = self.s.batch_max_tokens
            params = [self.params(max_tokens=max(1, mt // 2 + (i * 7) % (mt + 1))) for i in range(n)]
            ar = self.llm(None)
            # "ar_again" runs the same AR engine a second time: its ratio to "ar" is this
            # machine's noise at this batch size, measured in the same alternating run
            modes = {"ar": (ar, params), "ar_again": (ar, params),
                     "fixed": (self.llm(d, max_draft_length=K), params),
                     "budget": (self.llm(d, policy="budget", max_draft_length=K), params)}
            if self.main_drafter != "ngram":
                # the free n-gram drafter too: where drafting pays, the budget policy must draft
                modes["ngram_fixed"] = (self.llm("ngram", max_draft_length=K), params)
                modes["ngram_budget"] = (self.llm("ngram", policy="budget", max_draft_length=K), params)
            out[str(B)] = _strip_ids(compare(modes, prompts, max(self.s.repeats, self.s.batch_repeats),
                                             concurrency=B))
        noise = {B: abs(1.0 - r["ar_again"]["speedup"]) for B, r in out.items()}
        tol = {B: max(0.02, n) for B, n in noise.items()}
        res = {"drafter": self.main_drafter, "draft_length": K, "max_tokens": self.s.batch_max_tokens,
               "requests_per_slot": self.s.batch_requests_per_slot, "mode": "continuous batching",
               "by_batch_size": out, "ar_vs_ar_noise": noise}
        for m in ("budget", "ngram_budget"):
            if not all(m in r for r in out.values()):
                continue
            # every check on the paired speedup (see compare)
            viol = [B for B, r in out.items() if r[m]["speedup"] < 1.0]
            res[f"{m}_below_ar_at"] = viol
            res[f"{m}_below_ar_by_3pct_at"] = [B for B, r in out.items() if r[m]["speedup"] < 0.97]
            res[f"{m}_below_ar_beyond_noise_at"] = [B for B, r in out.items() if r[m]["speedup"] < 1.0 - tol[B]]
            res[f"{m}_never_below_ar"] = not viol
            res[f"{m}_never_below_ar_beyond_noise"] = not res[f"{m}_below_ar_beyond_noise_at"]
            # the statistical reading: below AR where the ~95% interval of the paired median lies
            # wholly under 1 (see median_interval); with few repeats the interval is wide
            res[f"{m}_below_ar_significant_at"] = [B for B, r in out.items() if r[m]["speedup_interval"][1] < 1.0]
        # one batch size's 9 ratios give an interval of +-10-20% on this kind of host; pooled over
        # the batch sizes the median's interval is about half as wide. "ar_again" pooled is the
        # same reading for two identical modes: what "equal to AR" looks like here
        for m in ("ar_again", "budget", "ngram_budget", "fixed", "ngram_fixed"):
            pooled = [x for r in out.values() if m in r for x in r[m].get("speedup_ratios", [])]
            if pooled:
                lo, hi, cov = median_interval(pooled)
                res[f"{m}_pooled"] = {"speedup": _median(pooled), "interval": [lo, hi], "coverage": cov,
                                      "n": len(pooled)}
        return res

    def section_misaligned(self) -> dict:
        prompts = self.sweep_prompts()
        d = self.drafters[self.main_drafter]
        K = self.s.draft_length
        cases = {
            "greedy_target__draft_top_p_0.9_T1": (0.0, {"temperature": 1.0, "top_p": 0.9}),
            "target_T0.7__draft_T1.0": (0.7, {"temperature": 1.0}),
            "target_T0.7__draft_T0.3": (0.7, {"temperature": 0.3}),
        }
        out = {}
        for name, (t, mis) in list(cases.items())[:self.s.misaligned_cases]:
            modes = {"ar": (self.llm(None), self.params(t)),
                     "aligned": (self.llm(d, max_draft_length=K), self.params(t)),
                     "misaligned": (self.llm(d, misalign=mis, max_draft_length=K), self.params(t))}
            out[name] = _strip_ids(compare(modes, prompts, self.s.repeats))
            out[name]["draft_params"] = mis
            out[name]["target_temperature"] = t
        return {"drafter": self.main_drafter, "draft_length": K, "cases": out}

    def section_peer(self) -> dict:
        try:
            import transformers
            from transformers import AutoModelForCausalLM

            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
        except ImportError as e:
            return {"skipped": f"transformers is not installed ({e}); pip install 'transformers>=4.45'"}
        if not self.has_draft_model:
            return {"skipped": "the peer comparison needs a draft model folder"}
        K = self.s.draft_length
        dev = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
        dkw = {"dtype": dtype} if major_minor >= (4, 56) else {"torch_dtype": dtype}
        hf_t = AutoModelForCausalLM.from_pretrained(str(_model_dir(self.target, "target")), **dkw).to(dev).eval()
        hf_d = AutoModelForCausalLM.from_pretrained(str(_model_dir(self.draft, "draft")), **dkw).to(dev).eval()
        for m in (hf_t, hf_d):
            m.generation_config.eos_token_id = None     # like ignore_eos: always max_tokens tokens
            m.generation_config.pad_token_id = 0
        hf_d.generation_config.num_assistant_tokens = K
        hf_d.generation_config.num_assistant_tokens_schedule = "constant"
        if hasattr(hf_d.generation_config, "assistant_confidence_threshold"):
            hf_d.generation_config.assistant_confidence_threshold = 0.0
        pool = [p["token_ids"] for cat in CATEGORIES for p in self.prompts[cat]]
        prompts = _pick(pool, self.s.peer_prompts)
        N = self.s.max_tokens

        class _HF:
            def __init__(self, assistant):
                self.assistant = assistant
                self.engine = type("E", (), {"device": dev, "metrics": None, "reset_metrics": lambda self: None})()

            def generate(self, ps, params):
                outs = []
                for p in ps:
                    ids = torch.tensor([p], device=dev)
                    kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False,
                              attention_mask=torch.ones_like(ids))
                    if self.assistant is not None:
                        kw["assistant_model"] = self.assistant
                    with torch.no_grad():
                        g = hf_t.generate(ids, **kw)
                    outs.append(type("O", (), {"token_ids": g[0, len(p):].tolist()})())
                return outs

            def stats(self):
                return {"total": {}}

        hf_greedy, hf_assisted = _HF(None), _HF(hf_d)
        hf_greedy.generate([prompts[0]], None)
        hf_assisted.generate([prompts[0]], None)
        modes = {"ar": (self.llm(None), self.params()),
                 "spec": (self.llm(self.draft, max_draft_length=K), self.params()),
                 "hf_greedy": (hf_greedy, None), "hf_assisted": (hf_assisted, None)}
        res = compare(modes, prompts, self.s.repeats)

        def agree(a, b):
            same = sum(x == y for x, y in zip(a, b))
            prefix = []
            for x, y in zip(a, b):
                n = 0
                while n < min(len(x), len(y)) and x[n] == y[n]:
                    n += 1
                prefix.append(n / max(len(x), 1))
            return {"identical_sequences": same, "of": len(a), "mean_common_prefix_fraction": _median(prefix)
                    if len(prefix) == 1 else sum(prefix) / len(prefix)}

        ids = {k: v["token_ids"] for k, v in res.items()}
        return {"transformers_version": transformers.__version__, "draft_length": K,
                "modes": _strip_ids(res),
                "ratio_spec_vs_hf_assisted": res["spec"]["tokens_per_s"] / res["hf_assisted"]["tokens_per_s"],
                "ratio_ar_vs_hf_greedy": res["ar"]["tokens_per_s"] / res["hf_greedy"]["tokens_per_s"],
                "hf_assisted_speedup_over_hf_greedy":
                    res["hf_assisted"]["tokens_per_s"] / res["hf_greedy"]["tokens_per_s"],
                "identity": {"spec_vs_hf_assisted": agree(ids["spec"], ids["hf_assisted"]),
                             "spec_vs_hf_greedy": agree(ids["spec"], ids["hf_greedy"]),
                             "ar_vs_hf_greedy": agree(ids["ar"], ids["hf_greedy"]),
                             "spec_vs_ar": agree(ids["spec"], ids["ar"])}}


def machine_info(device) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "device": str(dev), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            if m:
                info["cpu_model"] = m.group(1).strip()
    except OSError:
        pass
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def _machine_tag(info: dict) -> str:
    if "gpu" in info:
        tag = info["gpu"].replace("NVIDIA", "").strip()
    else:
        tag = f"cpu{info['cpu_count']}"
    return re.sub(r"[^A-Za-z0-9]+", "-", tag).strip("-").lower()


SECTIONS = ("costs", "categories", "k_sweep", "temperature", "batch", "misaligned", "peer")


def run_all(target="builtin", draft="builtin", device=None, settings: Settings | None = None,
            sections=SECTIONS, log=print, on_section=None) -> dict:
    """Run the sections in the order given (costs first whenever categories runs);
    on_section(res) after each one (e.g. to write partial results)."""
    settings = settings or Settings()
    target, draft, note = resolve_pair(target, draft, log)
    t_start = _now()
    bench = Bench(target, draft, device, settings, log, note)
    res = {"meta": {"date": _dt.date.today().isoformat(), "machine": machine_info(device), "target": target,
                    "load_average_start": _loadavg(),
                    "draft": draft, "note": note, "settings": asdict(settings),
                    "prompts": {c: [p["name"] for p in v] for c, v in bench.prompts.items()},
                    "prompt_tokens": {c: [len(p["token_ids"]) for p in v] for c, v in bench.prompts.items()},
                    "main_drafter": bench.main_drafter, "drafters": bench.drafters}}
    costs = None
    order = [x for x in sections if x in SECTIONS and x != "costs"]
    if "costs" in sections or "categories" in sections:
        order.insert(0, "costs")
    for sec in order:
        t0 = _now()
        log(f"specrt bench: {sec} ...")
        if sec == "costs":
            costs = res["costs"] = bench.section_costs()
        elif sec == "categories":
            res[sec] = bench.section_categories(costs)
        else:
            res[sec] = getattr(bench, f"section_{sec}")()
        res.setdefault("meta", {}).setdefault("section_seconds", {})[sec] = _now() - t0
        log(f"specrt bench: {sec} done in {_now() - t0:.1f}s")
        if on_section is not None:
            res["meta"]["total_seconds"] = _now() - t_start
            on_section(res)
    res["meta"]["total_seconds"] = _now() - t_start
    res["meta"]["load_average_end"] = _loadavg()
    return res


# -------------------------------------------------------------------------------- report + plots

def _f(x, nd=2):
    if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)):
        return f"{x:.{nd}f}"
    return "n/a"


def write_plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    ks = res.get("k_sweep")
    if ks:
        fig, ax = plt.subplots(figsize=(6, 4))
        kk = sorted(int(m[7:]) for m in ks["modes"] if m.startswith("fixed_K"))
        ax.plot(kk, [ks["modes"][f"fixed_K{k}"]["speedup"] for k in kk], "o-", label="fixed K")
        for i, (p, v) in enumerate(ks["policies"].items()):
            ax.axhline(v["speedup"], ls="--", color=f"C{i + 1}", label=f"{p} (mean K {v['mean_draft_length']:.1f})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("draft length K")
        ax.set_ylabel("speedup over autoregressive")
        ax.set_title(f"speedup vs K ({ks['drafter']} drafter, greedy, batch 1)")
        ax.legend(fontsize=8)
        save(fig, "speedup_vs_k.png")
    bt = res.get("batch")
    if bt:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        bs = sorted(int(b) for b in bt["by_batch_size"])
        for i, m in enumerate(("ar", "fixed", "budget", "ngram_fixed", "ngram_budget")):
            if not all(m in bt["by_batch_size"][str(b)] for b in bs):
                continue
            label = m.replace("_", " ") if m.startswith("ngram") else (m if m == "ar" else f"{bt['drafter']} {m}")
            style = "s--" if m.startswith("ngram") else "o-"
            a1.plot(bs, [bt["by_batch_size"][str(b)][m]["tokens_per_s"] for b in bs], style, color=f"C{i}",
                    label=label)
            if m != "ar":
                a2.plot(bs, [bt["by_batch_size"][str(b)][m]["speedup"] for b in bs], style, color=f"C{i}",
                        label=label)
        if all("ar_again" in bt["by_batch_size"][str(b)] for b in bs):
            a2.plot(bs, [bt["by_batch_size"][str(b)]["ar_again"]["speedup"] for b in bs], "x:", color="gray",
                    label="AR again (noise)")
        a1.set_xscale("log", base=2)
        a2.set_xscale("log", base=2)
        a1.set_xlabel("batch size")
        a2.set_xlabel("batch size")
        a1.set_ylabel("tokens/s")
        a2.set_ylabel("speedup over autoregressive")
        a2.axhline(1.0, color="gray", lw=0.8)
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
        a1.set_title("throughput vs batch size")
        a2.set_title(f"speedup vs batch size (K={bt['draft_length']})")
        save(fig, "speedup_vs_batch.png")
    cats = res.get("categories")
    if cats:
        fig, ax = plt.subplots(figsize=(6, 4))
        main = res["meta"]["main_drafter"]
        for cat in CATEGORIES:
            acc = cats[cat].get(main, {}).get("acceptance_rate_per_position", [])
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, "o-", label=cat)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(drafts 0..i all accepted)")
        ax.set_title(f"acceptance per position ({main} drafter, greedy)")
        ax.legend(fontsize=8)
        save(fig, "acceptance_per_position.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        drafters = [m for m in cats[CATEGORIES[0]] if m != "ar"]
        w = 0.8 / max(len(drafters), 1)
        for i, m in enumerate(drafters):
            ax.bar([j + i * w for j in range(len(CATEGORIES))], [cats[c][m]["speedup"] for c in CATEGORIES],
                   width=w, label=m)
        ax.set_xticks([j + w * (len(drafters) - 1) / 2 for j in range(len(CATEGORIES))])
        ax.set_xticklabels(CATEGORIES)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("speedup over autoregressive")
        ax.set_title("speedup per prompt category (greedy, batch 1)")
        ax.legend(fontsize=8)
        save(fig, "speedup_per_category.png")
    if ks:
        fig, ax = plt.subplots(figsize=(6, 4))
        e = ks["expected_accepted"]
        kk = sorted(int(k) for k in e)
        ax.plot(kk, [e[str(k)]["measured"] for k in kk], "o-", label="measured")
        ax.plot(kk, [e[str(k)]["formula_iid"] for k in kk], "s--", label=f"sum r^i (r={ks['r']:.2f})")
        ax.plot(kk, [e[str(k)]["formula_per_position"] for k in kk], "^:", label="sum of measured survival rates")
        ax.set_xlabel("K")
        ax.set_ylabel("mean accepted drafts per step")
        ax.legend(fontsize=8)
        ax.set_title("expected accepted tokens: formula vs measured")
        save(fig, "expected_accepted.png")
    return files


def headline_table(res: dict) -> str:
    """The few numbers that matter, as a markdown table (top of report.md, bench/README.md)."""
    L = ["| measurement | result |", "|---|---|"]
    cats = res.get("categories")
    if cats:
        for cat in CATEGORIES:
            L.append(f"| speedup, {cat} (greedy, batch 1, K={res['meta']['settings']['draft_length']}) | " + ", ".join(
                f"{d} {_f(v['speedup'])}x (tau {_f(v['tau'])})" for d, v in cats[cat].items() if d != "ar") + " |")
    ks = res.get("k_sweep")
    if ks:
        L.append(f"| best fixed K ({ks['drafter']}) | K={ks['best_fixed_k']}: {_f(ks['best_fixed_speedup'])}x |")
        for p, v in ks["policies"].items():
            L.append(f"| {p} policy vs best fixed K | {_f(v['speedup'])}x ({v['gain_over_best_fixed'] * 100:+.1f}%, "
                     f"mean K {_f(v['mean_draft_length'])}) |")
        for p in ks["skipped"]:
            L.append(f"| {p} policy | not run (see below) |")
    bt = res.get("batch")
    if bt:
        L.append("| batch size: speedup fixed / budget | " + ", ".join(
            f"B={b}: {_f(r['fixed']['speedup'])} / {_f(r['budget']['speedup'])}"
            for b, r in bt["by_batch_size"].items()) + " |")
        if all("speedup_interval" in r["budget"] for r in bt["by_batch_size"].values()):
            L.append("| budget policy (model): ~95% interval of the paired median | " + ", ".join(
                f"B={b}: {_f(r['budget']['speedup_interval'][0])}-{_f(r['budget']['speedup_interval'][1])}"
                for b, r in bt["by_batch_size"].items()) + " |")
        if "ngram_budget_never_below_ar" in bt:
            L.append("| batch size, n-gram drafter: speedup fixed / budget | " + ", ".join(
                f"B={b}: {_f(r['ngram_fixed']['speedup'])} / {_f(r['ngram_budget']['speedup'])}"
                for b, r in bt["by_batch_size"].items()) + " |")
        for m, label in (("budget", f"budget policy ({bt['drafter']})"), ("ngram_budget", "budget policy (n-gram)")):
            if f"{m}_never_below_ar" not in bt:
                continue
            ok, ok_noise = bt[f"{m}_never_below_ar"], bt[f"{m}_never_below_ar_beyond_noise"]
            L.append(f"| {label} >= AR at every batch size | {'yes' if ok else 'NO'}"
                     + ("" if ok else f" (within this run's AR-vs-AR noise: {'yes' if ok_noise else 'NO'})") + " |")
    pr = res.get("peer")
    if pr and "skipped" not in pr:
        i = pr["identity"]["spec_vs_hf_assisted"]
        L.append(f"| vs transformers assisted generation (tokens/s ratio) | {_f(pr['ratio_spec_vs_hf_assisted'])}x; "
                 f"identical outputs {i['identical_sequences']}/{i['of']} |")
        L.append(f"| specrt AR vs transformers greedy | {_f(pr['ratio_ar_vs_hf_greedy'])}x |")
    return "\n".join(L)


def write_report(res: dict, out: Path, plots: list[str]) -> str:
    m = res["meta"]
    mi = m["machine"]
    L = [f"# specrt end-to-end benchmark — {m['date']}", ""]
    where = mi.get("gpu") or mi.get("cpu_model", mi["processor"])
    L.append(f"Machine: `{mi['hostname']}`, {where}, device `{mi['device']}`, {mi['cpu_count']} CPUs, "
             f"torch {mi['torch']} ({mi['torch_threads']} threads). Target `{m['target']}`, draft `{m['draft']}`. "
             f"Total {m.get('total_seconds', 0):.0f} s. Load average at start / end: "
             f"{_f((m.get('load_average_start') or [float('nan')])[0])} / "
             f"{_f((m.get('load_average_end') or [float('nan')])[0])} (shared machines make timings noisy; "
             f"every ratio compares modes run alternately in this same process).")
    if m.get("note"):
        L += ["", f"**Note:** {m['note']}"]
    L += ["", "## Headline", "", headline_table(res), ""]
    s = m["settings"]
    L += ["", f"Settings: {s['prompts_per_category']} prompts per category, {s['max_tokens']} new tokens, "
              f"prompts cut to the last {s['max_prompt_tokens']} tokens, {s['repeats']} alternating repeats "
              f"(medians), K={s['draft_length']} unless swept. Greedy and batch 1 unless stated.", ""]
    c = res.get("costs")
    if c:
        L += ["## Measured costs (single forwards, this run)", "",
              f"Context {c['context_tokens']} tokens. Target step for T verified tokens:", "",
              "| T | " + " | ".join(str(t) for t in c["target_step_s"]) + " |",
              "|---|" + "---|" * len(c["target_step_s"]),
              "| ms | " + " | ".join(_f(v * 1e3) for v in c["target_step_s"].values()) + " |", "",
              "v(K) = t(K+1)/t(1) - 1: " + ", ".join(f"K={k}: {_f(v)}" for k, v in c["v"].items()), "",
              "Draft step cost c relative to one target step: " +
              ", ".join(f"{k}: {_f(v, 3)} ({_f(c['draft_step_s'][k] * 1e3, 3)} ms)" for k, v in c["c"].items()), ""]
    cats = res.get("categories")
    if cats:
        L += ["## Speedup per prompt category", "",
              "theory = tau / (1 + c*K + v) with c, v measured above and K the mean draft length; "
              "frac = measured speedup / theory. engine c/v: the same quantities as the engine timed "
              "them inside the runs (including host overhead).", "",
              "| category | drafter | tokens/s | speedup | tau | mean acc. len | acc. per position (cumulative) | theory | frac "
              "| engine c | engine v | = AR |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cat in CATEGORIES:
            for d, v in cats[cat].items():
                acc = " ".join(_f(a) for a in v["acceptance_rate_per_position"])
                L.append(f"| {cat} | {d} | {_f(v['tokens_per_s'], 1)} | {_f(v['speedup'])} | {_f(v['tau'])} | "
                         f"{_f(v['mean_accepted_length'])} | {acc} | {_f(v.get('theoretical_speedup'))} | "
                         f"{_f(v.get('fraction_of_theoretical'))} | {_f(v.get('engine_c'))} | "
                         f"{_f(v.get('engine_v'))} | {'yes' if v['identical_to_ar'] else 'NO'} |")
        L.append("")
    ks = res.get("k_sweep")
    if ks:
        L += [f"## Fixed K vs dynamic policies ({ks['drafter']} drafter)", "",
              "| mode | tokens/s | speedup | mean K | tau | = AR |", "|---|---|---|---|---|---|"]
        for name, v in ks["modes"].items():
            L.append(f"| {name} | {_f(v['tokens_per_s'], 1)} | {_f(v['speedup'])} | "
                     f"{_f(v['drafted_tokens_per_step'])} | {_f(v['tau'])} | "
                     f"{'yes' if v.get('identical_to_ar') else 'NO'} |")
        L += ["", f"Best fixed K = {ks['best_fixed_k']} ({_f(ks['best_fixed_speedup'])}x). Gain of each dynamic "
                  f"policy over it (published state of the art for learned adaptive length: +7 to +11%):", ""]
        for p, v in ks["policies"].items():
            L.append(f"- {p}: {_f(v['speedup'])}x, {v['gain_over_best_fixed'] * 100:+.1f}% (mean K "
                     f"{_f(v['mean_draft_length'])})")
        for p, why in ks["skipped"].items():
            L.append(f"- {p}: not run ({why})")
        cond = ks.get("conditional_acceptance_at_kmax") or []
        L += ["", f"Expected accepted drafts per step: E = sum_(i=1..K) r^i with r = {_f(ks['r'])} (first-position "
                  "acceptance at the smallest K), and the sum of the first K survival rates measured at the largest "
                  "K (the engine's per-position acceptance with a fixed K is P(drafts 0..i all accepted)). Conditional "
                  "acceptance per position at the largest K, P(i accepted | 0..i-1 accepted): "
                  + " ".join(_f(c) for c in cond) + ".", "",
              "| K | measured | sum r^i | sum of measured survival rates |", "|---|---|---|---|"]
        for k, v in ks["expected_accepted"].items():
            L.append(f"| {k} | {_f(v['measured'])} | {_f(v['formula_iid'])} | {_f(v['formula_per_position'])} |")
        L.append("")
    tp = res.get("temperature")
    if tp:
        L += [f"## Temperature ({tp['drafter']} drafter, K={tp['draft_length']})", "",
              "| T | acceptance | tokens/s AR | speedup | tau | acc. per position | = AR |", "|---|---|---|---|---|---|---|"]
        for t, r in tp["by_temperature"].items():
            for acc in ("rejection", "coupled"):
                v = r[acc]
                L.append(f"| {t} | {acc} | {_f(r['ar']['tokens_per_s'], 1)} | {_f(v['speedup'])} | {_f(v['tau'])} | "
                         f"{' '.join(_f(a) for a in v['acceptance_rate_per_position'])} | "
                         f"{'yes' if v['identical_to_ar'] else 'no'} |")
        L += ["", "Token identity with AR is guaranteed for greedy and for coupled acceptance; rejection "
                  "sampling at T>0 is exact in distribution only.", ""]
    bt = res.get("batch")
    if bt:
        ng = all("ngram_budget" in r for r in bt["by_batch_size"].values())
        per = bt.get("requests_per_slot")
        how = (f"concurrency B under continuous batching: {per}B requests of {bt['max_tokens'] // 2}-"
               f"{bt['max_tokens'] * 3 // 2} new tokens, at most B in flight, each finished request replaced at "
               f"once" if per else f"{bt['max_tokens']} new tokens, closed batches")
        L += [f"## Batch size ({bt['drafter']} drafter{' and n-gram' if ng else ''}, K={bt['draft_length']})", "",
              f"Batch size B = {how}.", "",
              "| batch | AR tokens/s | AR again (noise) | fixed tokens/s | fixed speedup | budget tokens/s | "
              "budget speedup | budget mean K | budget planning share of wall time |"
              + (" n-gram fixed speedup | n-gram budget speedup | n-gram budget mean K |" if ng else ""),
              "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if ng else "")]
        for b, r in bt["by_batch_size"].items():
            again = _f(r["ar_again"]["speedup"]) + "x" if "ar_again" in r else "-"
            row = (f"| {b} | {_f(r['ar']['tokens_per_s'], 1)} | {again} | {_f(r['fixed']['tokens_per_s'], 1)} | "
                   f"{_f(r['fixed']['speedup'])} | {_f(r['budget']['tokens_per_s'], 1)} | "
                   f"{_f(r['budget']['speedup'])} | {_f(r['budget']['drafted_tokens_per_step'])} | "
                   f"{_f(100 * r['budget'].get('policy_plan_fraction', 0.0), 1)}% |")
            if ng:
                row += (f" {_f(r['ngram_fixed']['speedup'])} | {_f(r['ngram_budget']['speedup'])} | "
                        f"{_f(r['ngram_budget']['drafted_tokens_per_step'])} |")
            L.append(row)
        L.append("")
        for m, label in (("budget", f"the budget policy ({bt['drafter']} drafter)"),
                         ("ngram_budget", "the budget policy (n-gram drafter)")):
            if f"{m}_never_below_ar" not in bt:
                continue
            if bt[f"{m}_never_below_ar"]:
                verdict = f"{label} kept speculative throughput >= autoregressive at every batch size"
            else:
                verdict = (f"{label} fell below autoregressive at batch sizes {bt[f'{m}_below_ar_at']} (by more "
                           f"than 3% at {bt[f'{m}_below_ar_by_3pct_at'] or 'none'}; by more than this run's noise, "
                           f"max(2%, |1 - AR again/AR|), at {bt[f'{m}_below_ar_beyond_noise_at'] or 'none'})")
            sig = bt.get(f"{m}_below_ar_significant_at")
            if sig is not None:
                ivs = ", ".join(f"B={b}: {_f(r[m]['speedup_interval'][0])}-{_f(r[m]['speedup_interval'][1])}"
                                for b, r in bt["by_batch_size"].items())
                cov = min(r[m].get("speedup_interval_coverage", 0.0) for r in bt["by_batch_size"].values())
                verdict += (f". Interval of the paired median ({cov * 100:.0f}% coverage, order statistics): {ivs}; "
                            f"wholly below 1 at {sig or 'none'}")
            pooled, again = bt.get(f"{m}_pooled"), bt.get("ar_again_pooled")
            if pooled and again:
                verdict += (f". Pooled over every batch size ({pooled['n']} paired repeats): median "
                            f"{_f(pooled['speedup'])}x, interval {_f(pooled['interval'][0])}-"
                            f"{_f(pooled['interval'][1])} ({pooled['coverage'] * 100:.0f}%); AR again pooled: "
                            f"{_f(again['speedup'])}x, {_f(again['interval'][0])}-{_f(again['interval'][1])}")
            L.append(f"Check: {verdict}.")
        L += ["",
              "AR again runs the same autoregressive engine a second time in the same run (modes in a seeded random "
              "order per repeat): its ratio to AR is the timing noise of this machine at that batch size. Mean K is "
              "the mean number of drafted tokens per request-step; when it is ~0 the policy switched speculation "
              "off (its drafts do not pay here), and the remaining gap to AR is noise plus the policy's own cost "
              "per step (planning, exploration, plain-run measurements).", ""]
    mis = res.get("misaligned")
    if mis:
        L += [f"## Misaligned draft sampling ({mis['drafter']} drafter, K={mis['draft_length']})", "",
              "A benchmark-only drafter hook samples the DRAFT with other parameters than the target. The "
              "output stays exact (verification uses the q the draft really sampled from); what is lost is "
              "acceptance, which the engine's single shared transform protects.", "",
              "| case | mode | speedup | tau | acc. per position |", "|---|---|---|---|---|"]
        for name, r in mis["cases"].items():
            for mode in ("aligned", "misaligned"):
                v = r[mode]
                L.append(f"| {name} | {mode} | {_f(v['speedup'])} | {_f(v['tau'])} | "
                         f"{' '.join(_f(a) for a in v['acceptance_rate_per_position'])} |")
        L.append("")
    pr = res.get("peer")
    if pr:
        L += ["## Peer: Hugging Face transformers (same weights, same prompts, greedy, batch 1)", ""]
        if "skipped" in pr:
            L += [f"Skipped: {pr['skipped']}", ""]
        else:
            L += [f"transformers {pr['transformers_version']}, assisted generation with "
                  f"num_assistant_tokens={pr['draft_length']} (constant schedule).", "",
                  "| mode | tokens/s | speedup over specrt AR |", "|---|---|---|"]
            for name, v in pr["modes"].items():
                L.append(f"| {name} | {_f(v['tokens_per_s'], 1)} | {_f(v['speedup'])} |")
            idn = pr["identity"]
            L += ["", f"specrt speculative / HF assisted tokens/s: **{_f(pr['ratio_spec_vs_hf_assisted'])}x**; "
                      f"specrt AR / HF greedy: {_f(pr['ratio_ar_vs_hf_greedy'])}x; HF assisted over HF greedy: "
                      f"{_f(pr['hf_assisted_speedup_over_hf_greedy'])}x.", "",
                  "Token identity (identical sequences / mean common-prefix fraction): " + "; ".join(
                      f"{k}: {v['identical_sequences']}/{v['of']}, {_f(v['mean_common_prefix_fraction'])}"
                      for k, v in idn.items()) + ".", ""]
    if plots:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    text = "\n".join(L)
    (out / "report.md").write_text(text)
    return text


def headline(res: dict) -> str:
    """A few lines for the terminal."""
    L = []
    main = res["meta"]["main_drafter"]
    if "categories" in res:
        L.append("speedup per category (" + ", ".join(
            f"{c}: " + "/".join(f"{d} {_f(v['speedup'])}" for d, v in res["categories"][c].items() if d != "ar")
            for c in CATEGORIES) + ")")
    if "k_sweep" in res:
        ks = res["k_sweep"]
        L.append(f"best fixed K={ks['best_fixed_k']} {_f(ks['best_fixed_speedup'])}x; " + ", ".join(
            f"{p} {_f(v['speedup'])}x ({v['gain_over_best_fixed'] * 100:+.1f}%)" for p, v in ks["policies"].items()))
    if "batch" in res:
        L.append("batch speedup fixed/budget: " + ", ".join(
            f"B={b}: {_f(r['fixed']['speedup'])}/{_f(r['budget']['speedup'])}"
            for b, r in res["batch"]["by_batch_size"].items()))
    if "peer" in res and "skipped" not in res["peer"]:
        p = res["peer"]
        L.append(f"vs transformers: spec/assisted {_f(p['ratio_spec_vs_hf_assisted'])}x, AR/greedy "
                 f"{_f(p['ratio_ar_vs_hf_greedy'])}x, identical spec vs assisted "
                 f"{p['identity']['spec_vs_hf_assisted']['identical_sequences']}/{p['identity']['spec_vs_hf_assisted']['of']}")
    return f"[{main} drafter]\n" + "\n".join(L)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def write_results(res: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    res = _jsonable(res)
    plots = write_plots(res, out)
    res["meta"]["plots"] = plots
    (out / "results.json").write_text(json.dumps(res, indent=1))
    write_report(res, out, plots)
    return out


def default_out_dir(device) -> Path:
    info = machine_info(device)
    return Path("bench") / "results" / f"{_dt.date.today().isoformat()}-{_machine_tag(info)}"


# ----------------------------------------------------------------------------------- cost curve

SHAPES = {   # Llama-family shapes (hidden, ffn, layers, heads, kv_heads, vocab)
    "tiny": (128, 256, 4, 4, 2, 1024),
    "160m": (768, 2048, 12, 12, 4, 32000),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "3b": (3072, 8192, 28, 24, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}


def random_model(shape, device, dtype, layers: int | None = None, hidden_div: int = 1):
    """A random-weight specrt LlamaForCausalLM of a named shape, created on the device (no files)."""
    from specrt.models import LlamaForCausalLM, ModelConfig

    h, f, n, heads, kvh, vocab = SHAPES[shape] if isinstance(shape, str) else shape
    cfg = ModelConfig.from_json({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": h, "intermediate_size": f,
        "num_hidden_layers": layers or n, "num_attention_heads": heads, "num_key_value_heads": kvh,
        "head_dim": h // heads, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def _param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def cost_curve(target_shape="8b", draft_shape="1b", draft_layers: int | None = None, device=None,
               dtype="bfloat16", ctx: int = 1024, max_tokens: int = 16, batch_sizes=(1, 8, 32), kmax: int = 8,
               reps: int = 10, alphas=(0.6, 0.7, 0.8, 0.9), log=print) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype)
    t0 = _now()
    target = random_model(target_shape, dev, dt)
    draft = random_model(draft_shape, dev, dt, layers=draft_layers)
    log(f"cost-curve: target {target_shape} {_param_count(target) / 1e9:.2f}B, draft {draft_shape} "
        f"{_param_count(draft) / 1e9:.2f}B params ({dtype}, {dev}); built in {_now() - t0:.1f}s")
    res = {"machine": machine_info(dev), "target_shape": target_shape, "draft_shape": draft_shape,
           "target_params": _param_count(target), "draft_params": _param_count(draft), "dtype": dtype,
           "context_tokens": ctx, "by_batch": {}}
    for B in batch_sizes:
        t_cache = scratch_cache(target, ctx, max_tokens, B)     # one cache per model for all T
        d_cache = scratch_cache(draft, ctx, max_tokens, B)
        fns = {T: forward_timer(target, ctx, T, batch=B, cache=t_cache) for T in range(1, max_tokens + 1)}
        fns["draft"] = forward_timer(draft, ctx, 1, batch=B, cache=d_cache)
        times = _timed_interleaved(fns, reps, dev)
        td = times.pop("draft")
        tt = times
        t1 = tt[1]
        entry = {"target_step_s": tt, "draft_step_s": td, "c": td / t1,
                 "v": {K: tt[K + 1] / t1 - 1 for K in range(1, min(kmax, max_tokens - 1) + 1)}}
        # overlap: K draft steps on a side stream while the target verifies K+1 tokens
        hidden = None
        if dev.type == "cuda":
            K = min(4, kmax)
            f_t = forward_timer(target, ctx, K + 1, batch=B, cache=t_cache)
            f_d = forward_timer(draft, ctx, 1, batch=B, cache=d_cache)
            side = torch.cuda.Stream(dev)

            def both():
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(K):
                        f_d()
                f_t()
                torch.cuda.current_stream(dev).wait_stream(side)
            t_both = _timed(both, reps, dev)
            t_seq = tt[K + 1] + K * td
            hidden = {"K": K, "sequential_s": t_seq, "concurrent_s": t_both,
                      "hidden_fraction_of_draft": max(0.0, min(1.0, (t_seq - t_both) / (K * td)))}
        entry["overlap"] = hidden
        h = hidden["hidden_fraction_of_draft"] if hidden else 0.0
        pred = {}
        for a in alphas:
            row = {}
            for K in entry["v"]:
                tau = (1 - a ** (K + 1)) / (1 - a)
                row[K] = {"tau": tau, "speedup": theoretical_speedup(tau, entry["c"], K, entry["v"][K]),
                          "speedup_with_overlap": tau / (1 + (1 - h) * entry["c"] * K + entry["v"][K])}
            best = max(row, key=lambda k: row[k]["speedup"])
            pred[str(a)] = {"by_k": row, "best_k": best, "best_speedup": row[best]["speedup"]}
        entry["predicted"] = pred
        res["by_batch"][str(B)] = entry
        del fns, t_cache, d_cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        log(f"cost-curve: B={B}: target 1 tok {t1 * 1e3:.2f} ms, {max_tokens} tok {tt[max_tokens] * 1e3:.2f} ms, "
            f"draft {td * 1e3:.2f} ms (c={entry['c']:.3f})" + (f", overlap hides {h:.0%} of drafting" if hidden else "")
            + "; predicted best speedup " + ", ".join(f"a={a}: {p['best_speedup']:.2f}x@K={p['best_k']}"
                                                      for a, p in pred.items()))
    res["seconds"] = _now() - t0
    return res


def write_cost_curve(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res = _jsonable(res)
    (out / "cost_curve.json").write_text(json.dumps(res, indent=1))
    L = [f"# Cost curve: random-weight {res['target_shape']} target ({res['target_params'] / 1e9:.2f}B) / "
         f"{res['draft_shape']} draft ({res['draft_params'] / 1e9:.2f}B), {res['dtype']}",
         "", f"Machine: {res['machine'].get('gpu') or res['machine'].get('cpu_model')}; context "
             f"{res['context_tokens']} tokens.", ""]
    for B, e in res["by_batch"].items():
        tt = e["target_step_s"]
        L += [f"## batch {B}", "", "| verified tokens | " + " | ".join(tt) + " |", "|---|" + "---|" * len(tt),
              "| target ms | " + " | ".join(_f(v * 1e3, 2) for v in tt.values()) + " |", "",
              f"Draft step {_f(e['draft_step_s'] * 1e3, 3)} ms, c = {_f(e['c'], 3)}."]
        if e.get("overlap"):
            o = e["overlap"]
            L.append(f"Overlap (K={o['K']}): sequential {_f(o['sequential_s'] * 1e3)} ms, concurrent "
                     f"{_f(o['concurrent_s'] * 1e3)} ms: {o['hidden_fraction_of_draft']:.0%} of drafting hidden.")
        L += ["", "| acceptance rate | best K | predicted speedup |", "|---|---|---|"]
        for a, p in e["predicted"].items():
            L.append(f"| {a} | {p['best_k']} | {_f(p['best_speedup'])} |")
        L.append("")
    (out / "cost_curve.md").write_text("\n".join(L))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for B, e in res["by_batch"].items():
            tt = e["target_step_s"]
            ax.plot([int(t) for t in tt], [v / tt["1"] for v in tt.values()], "o-", label=f"batch {B}")
        ax.set_xlabel("tokens verified per request")
        ax.set_ylabel("target step time / 1-token step")
        ax.set_title("verification cost curve")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "cost_curve.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass


def cost_curve_main(argv) -> int:
    p = argparse.ArgumentParser(prog="specrt bench cost-curve",
                                description="Target step time vs verified tokens, draft step time, overlap and the "
                                            "predicted speedup, on random-weight Llama-shaped models built in memory.")
    p.add_argument("--target-shape", default="8b", choices=list(SHAPES))
    p.add_argument("--draft-shape", default="1b", choices=list(SHAPES))
    p.add_argument("--draft-layers", type=int, default=None, help="override the draft's layer count")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16, help="largest number of verified tokens timed")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu":
        torch.set_num_threads(1)
    res = cost_curve(a.target_shape, a.draft_shape, a.draft_layers, a.device, a.dtype, a.context, a.max_tokens,
                     tuple(int(b) for b in a.batch_sizes.split(",")), reps=a.reps)
    out = Path(a.out) if a.out else default_out_dir(a.device) / "cost_curve"
    write_cost_curve(res, out)
    print(f"cost-curve: wrote {out}/cost_curve.{{json,md,png}} in {res['seconds']:.0f}s")
    return 0


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cost-curve":
        return cost_curve_main(argv[1:])
    p = argparse.ArgumentParser(prog="specrt bench", description=__doc__.split("\n\n")[0],
                                epilog="subcommand: `specrt bench cost-curve --help`")
    p.add_argument("--quick", action="store_true", help="small prompt counts, fewer repeats (minutes on a CPU)")
    p.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<machine>/)")
    p.add_argument("--target", default="builtin")
    p.add_argument("--draft", default="builtin", help="draft folder or 'builtin'; n-gram and self:N always run too")
    p.add_argument("--device", default=None)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats per comparison (default 5, --quick 3; the batch section 9 unless given)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = p.parse_args(argv)
    s = Settings.quick() if a.quick else Settings()
    if a.repeats:
        s.repeats = a.repeats
        s.batch_repeats = a.repeats     # an explicit count holds for the batch section too
    if a.prompts:
        s.prompts_per_category = a.prompts
    if a.max_tokens:
        s.max_tokens = a.max_tokens
    dev_type = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    if a.threads or dev_type == "cpu":
        # one thread by default on CPU: tiny models gain nothing from more, and on a shared
        # machine extra threads only add contention noise (recorded in the JSON)
        torch.set_num_threads(a.threads or 1)
    sections = tuple(x.strip() for x in a.sections.split(",") if x.strip())
    bad = [x for x in sections if x not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {SECTIONS}")
    out = Path(a.out) if a.out else default_out_dir(a.device)
    # results are rewritten after every section, so a run cut short still leaves a report
    res = run_all(a.target, a.draft, a.device, s, sections, on_section=lambda r: write_results(r, out))
    write_results(res, out)
    print(headline(res))
    print(f"specrt bench: wrote {out}/results.json, report.md and plots in {res['meta']['total_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
