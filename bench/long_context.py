"""The draft's KV window at long contexts: draft cost and acceptance vs the full-cache draft
(issue 16, item 9).

SpecConfig(draft_kv_window=W, draft_kv_sinks=S): the draft attends to the first S positions
plus the last W before each new token (whole blocks), the target to everything, so the output
is exact and only acceptance may change. For each context length this script decodes the same
long prompts (held-out code, the last N tokens) with the full-cache draft and with windows,
alternating, and reports the draft time per drafted step (its attention stops growing with the
context under a window), the step time, the tokens per target forward and the acceptance.

    python bench/long_context.py                                  # built-in pair (context 2048)
    python bench/long_context.py --target T --draft D --contexts 512,1024,2048,4096 --windows 256

Standalone (the coordinator hooks it into `specrt bench`); results in bench/README.md.
"""
from __future__ import annotations

import argparse
import statistics

import torch


def long_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: windows over the concatenated held-out code files."""
    from specrt.training.corpus import read_text, split_files

    _, held = split_files()
    ids: list[int] = []
    for f in held:
        ids += tokenizer.encode(read_text(f))
        if len(ids) >= (n + 1) * length:
            break
    if len(ids) < length:
        raise SystemExit(f"the held-out corpus has only {len(ids)} tokens, fewer than --contexts {length}")
    step = max((len(ids) - length) // max(n, 1), 1)
    return [ids[i * step:i * step + length] for i in range(n)]


class DraftTimes:
    """A wrap_drafter hook: each drafting phase's (forwards, tokens fed, host seconds)."""

    def __init__(self):
        self.calls: list[tuple[int, int, float]] = []

    def __call__(self, drafter):
        inner = drafter.propose

        def propose(*a, **kw):
            out = inner(*a, **kw)
            if out.cost.forwards:
                self.calls.append((out.cost.forwards, out.cost.tokens_fed, out.cost.seconds))
            return out
        drafter.propose = propose
        return drafter


def run(llm, times: DraftTimes, prompts, params) -> dict:
    llm.engine.reset_metrics()
    times.calls.clear()
    outs = llm.generate(prompts, params)
    st = llm.stats()["total"]
    # steady drafting phases feed one token per forward (no catch-up of the prompt): per forward
    steady = [sec / depth for depth, fed, sec in times.calls if fed == depth]
    return {"tokens": [o.token_ids for o in outs], "draft_ms_per_step": 1e3 * st["draft_time_s"] / max(st["drafted_steps"], 1),
            "steady_ms": 1e3 * statistics.median(steady) if steady else float("nan"),
            "step_ms": 1e3 * st["step_time_s"] / max(st["steps"], 1), "tau": st["tokens_per_target_forward"],
            "hit": st["draft_hit_rate"], "first": st["first_token_acceptance_rate"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="builtin")
    ap.add_argument("--draft", default="builtin")
    ap.add_argument("--contexts", default="512,1024,2000", help="prompt lengths in tokens (comma list)")
    ap.add_argument("--windows", default="128,256", help="draft KV windows W to compare with the full cache")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import specrt
    from specrt import SamplingParams, SpecConfig

    windows = [0] + [int(w) for w in args.windows.split(",") if w]
    times = {w: DraftTimes() for w in windows}
    llms = {w: specrt.LLM(args.target, args.draft, device=args.device, wrap_drafter=times[w],
                          spec=SpecConfig(max_draft_length=args.k, max_batch_size=1, draft_kv_window=w,
                                          draft_kv_sinks=args.sinks))
            for w in windows}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():
        llm.warmup(2, 8)
    print(f"target {args.target}, draft {args.draft}, K={args.k}, batch 1, greedy, {args.prompts} prompts x "
          f"{args.max_tokens} tokens, sinks {args.sinks}, medians of {args.repeats} alternating repeats")
    print("draft ms/step: drafting time per drafted step (the prompt's catch-up included); per token: one "
          "steady draft forward (no catch-up)")
    print(f"{'context':>8} {'draft KV':>10} {'draft ms/step':>14} {'per token':>10} {'step ms':>8} {'tau':>6} "
          f"{'acceptance':>11} {'first-token':>12} {'= full':>7}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        limit = min(llm.engine.max_model_len for llm in llms.values())
        length = min(ctx, limit - args.max_tokens - args.k - 2)
        prompts = long_prompts(llms[0].tokenizer, args.prompts, length)
        res = {w: [] for w in windows}
        for _ in range(args.repeats):
            for w, llm in llms.items():
                res[w].append(run(llm, times[w], prompts, params))
        full_tokens = res[0][0]["tokens"]
        for w in windows:
            rs = res[w]
            med = {k: statistics.median(r[k] for r in rs) for k in ("draft_ms_per_step", "steady_ms", "step_ms",
                                                                   "tau", "hit", "first")}
            same = all(r["tokens"] == full_tokens for r in rs)
            print(f"{length:>8} {'full' if w == 0 else f'{args.sinks}+{w}':>10} {med['draft_ms_per_step']:>14.2f} "
                  f"{med['steady_ms']:>10.2f} {med['step_ms']:>8.2f} {med['tau']:>6.2f} {med['hit']:>11.2f} {med['first']:>12.2f} "
                  f"{'yes' if same else 'NO':>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
