"""Command line of the end-to-end benchmark: ``specrt bench`` (bench ships in specrt's wheel as
the top-level ``bench`` package) or ``python -m bench`` (installed, or from a checkout's root).

    python -m bench --quick [--out DIR]                 # the quick sections, small; < 10 min on a 2-core CPU
    python -m bench [--target builtin --draft builtin] [--device cuda] [--out DIR]   # every section
    python -m bench --sections long_context,batching [--set long_contexts=512,1024,2048]
    python -m bench cost-curve [--target-shape 8b] [--device cuda]   # random-weight Llama-shaped cost curves
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from bench.cost_curve import cost_curve, write_cost_curve
from bench.models import SHAPES
from bench.report import default_out_dir, headline, write_results
from bench.sections import QUICK_SECTIONS, SECTIONS, run_all
from bench.workloads import Settings


def _default_device(device) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def cost_curve_main(argv, prog: str = "python -m bench") -> int:
    p = argparse.ArgumentParser(prog=f"{prog} cost-curve",
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
    if _default_device(a.device).type == "cpu":
        torch.set_num_threads(1)
    res = cost_curve(a.target_shape, a.draft_shape, a.draft_layers, a.device, a.dtype, a.context, a.max_tokens,
                     tuple(int(b) for b in a.batch_sizes.split(",")), reps=a.reps)
    out = Path(a.out) if a.out else default_out_dir(a.device) / "cost_curve"
    write_cost_curve(res, out)
    print(f"cost-curve: wrote {out}/cost_curve.{{json,md,png}} in {res['seconds']:.0f}s")
    return 0


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="End-to-end benchmarks that measure what speculative "
                                "decoding buys: AR and speculative decoding of the same target, alternated in one run.",
                                epilog=f"subcommand: `{prog} cost-curve --help`")
    p.add_argument("--quick", action="store_true",
                   help=f"small prompt counts, fewer repeats; by default only {', '.join(QUICK_SECTIONS)}")
    p.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<machine>/)")
    p.add_argument("--target", default="builtin")
    p.add_argument("--draft", default="builtin", help="draft folder or 'builtin'; n-gram and self:N always run too")
    p.add_argument("--device", default=None)
    p.add_argument("--sections", default=None,
                   help=f"comma list of {', '.join(SECTIONS)} (default: all; with --quick the quick ones)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats per comparison (default 5, --quick 3; the batch section 9 unless given)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one of the run's settings (bench.workloads.Settings), e.g. draft_length=6, "
                        "long_contexts=512,1024,2048, penalty_temperatures=0,0.8; repeatable")
    return p


def apply_setting(s: Settings, text: str) -> None:
    """``--set NAME=VALUE``: a Settings field from text, typed like its current value (a tuple
    from a comma list of numbers). ValueError naming the field otherwise."""
    name, sep, value = text.partition("=")
    fields = {f.name for f in dataclasses.fields(s)}
    if not sep or name not in fields:
        raise ValueError(f"--set: expected NAME=VALUE with NAME one of {', '.join(sorted(fields))}, got {text!r}")
    old = getattr(s, name)

    def number(x: str):          # typed like the default's items (a float setting may be written "0")
        if old and isinstance(old[0], float) or any(c in x for c in ".eE"):
            return float(x)
        return int(x)
    try:
        if isinstance(old, tuple):
            new = tuple(number(x.strip()) for x in value.split(",") if x.strip())
        else:
            new = type(old)(value)
    except ValueError:
        raise ValueError(f"--set {name}: {value!r} is not a {type(old).__name__}"
                         + (" (a comma list of numbers)" if isinstance(old, tuple) else "")) from None
    setattr(s, name, new)


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cost-curve":
        return cost_curve_main(argv[1:], prog)
    p = _parser(prog)
    a = p.parse_args(argv)
    s = Settings.quick() if a.quick else Settings()
    if a.repeats:
        s.repeats = a.repeats
        s.batch_repeats = a.repeats     # an explicit count holds for the batch section too
    if a.prompts:
        s.prompts_per_category = a.prompts
    if a.max_tokens:
        s.max_tokens = a.max_tokens
    for text in a.set:
        try:
            apply_setting(s, text)
        except ValueError as e:
            p.error(str(e))
    if a.threads or _default_device(a.device).type == "cpu":
        # one thread by default on CPU: tiny models gain nothing from more, and on a shared
        # machine extra threads only add contention noise (recorded in the JSON)
        torch.set_num_threads(a.threads or 1)
    chosen = a.sections or ",".join(QUICK_SECTIONS if a.quick else SECTIONS)
    sections = tuple(x.strip() for x in chosen.split(",") if x.strip())
    bad = [x for x in sections if x not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {SECTIONS}")
    out = Path(a.out) if a.out else default_out_dir(a.device)
    # results are rewritten after every section, so a run cut short still leaves a report
    res = run_all(a.target, a.draft, a.device, s, sections, on_section=lambda r: write_results(r, out))
    write_results(res, out)
    print(headline(res))
    print(f"{prog}: wrote {out}/results.json, report.md and plots in {res['meta']['total_seconds']:.0f}s")
    return 0
