"""Admission by predicted acceptance vs first come first served (issue 16, item 6).

A mixed workload queued all at once, more requests than the batch holds: n-gram-friendly
repetitive prompts (a block of code repeated, then its start again) interleaved with free
text, tagged by kind. SpecConfig(admission="acceptance") admits the waiting requests whose
predicted acceptance (their tag's recent average) is closest to the running batch's, so a
step verifies requests that draft alike; "fifo" admits in arrival order. Both engines first
serve the workload once untimed (so each tag's acceptance is known), then the two modes
alternate; throughput is emitted tokens over wall time, medians over repeats.

    python bench/batching.py                                 # built-in target, n-gram drafter
    python bench/batching.py --draft builtin --policy budget
    python bench/batching.py --target T --draft D

Standalone (the coordinator hooks it into `specrt bench`); results in bench/README.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def workload(tokenizer, n: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """Interleaved repetitive / free-text prompts (token ids) and their tags."""
    from specrt.benchmarks import build_prompts

    cats = build_prompts(tokenizer, n, prompt_tokens)
    rep = [p["token_ids"] for p in cats["repetition"]]
    free = [p["token_ids"] for p in cats["free_text"]]
    prompts, tags = [], []
    for i in range(max(len(rep), len(free))):
        for kind, items in (("repetitive", rep), ("free_text", free)):
            if i < len(items):
                prompts.append(items[i])
                tags.append(kind)
    return prompts, tags


def serve_all(llm, prompts, tags, params) -> tuple[float, int, int]:
    """(seconds, emitted tokens, steps whose batch mixed both tags)."""
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_requests(prompts, [params] * len(prompts), tags)
    emitted, mixed = 0, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                emitted += len(out.token_ids)
        mixed += len({r.tag for r in eng.scheduler.running}) > 1
    return time.perf_counter() - t0, emitted, mixed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="builtin")
    ap.add_argument("--draft", default="ngram", help="'ngram', 'builtin', a folder or 'self:N'")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "confidence", "budget"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12, help="prompts per kind")
    ap.add_argument("--batch", type=int, default=4, help="max_batch_size (fewer than the requests)")
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-wait", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import specrt
    from specrt import SamplingParams, SpecConfig

    llms = {}
    for admission in ("fifo", "acceptance"):
        spec = SpecConfig(policy=args.policy, max_draft_length=args.k, max_batch_size=args.batch,
                          admission=admission, admission_max_wait=args.max_wait)
        llms[admission] = specrt.LLM(args.target, args.draft, spec=spec, device=args.device)
    prompts, tags = workload(llms["fifo"].tokenizer, args.requests, args.prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = {}
    for name, llm in llms.items():            # untimed: warms up and teaches each tag's acceptance
        outs[name] = [o.token_ids for o in llm.generate(prompts, params, tags=tags)]
    assert outs["fifo"] == outs["acceptance"], "admission order changed greedy tokens"
    res = {name: {"s": [], "tok": 0, "mixed": []} for name in llms}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            s, tok, mixed = serve_all(llm, prompts, tags, params)
            res[name]["s"].append(s)
            res[name]["tok"] = tok
            res[name]["mixed"].append(mixed)
    print(f"{len(prompts)} requests ({tags.count('repetitive')} repetitive, {tags.count('free_text')} free text), "
          f"batch {args.batch}, draft {args.draft}, policy {args.policy}, K={args.k}, {args.max_tokens} tokens each, "
          f"{args.repeats} alternating repeats")
    base = None
    for name, r in res.items():
        tps = r["tok"] / statistics.median(r["s"])
        base = base or tps
        spread = (max(r["s"]) - min(r["s"])) / statistics.median(r["s"])
        ratios = "" if name == "fifo" else \
            f"  per-repeat ratio {' '.join(f'{f / a:.2f}' for f, a in zip(res['fifo']['s'], r['s']))}"
        print(f"{name:<11} {tps:8.1f} tok/s  x{tps / base:.3f}  mixed-tag steps {statistics.median(r['mixed']):.0f}  "
              f"spread {100 * spread:.0f}%{ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
