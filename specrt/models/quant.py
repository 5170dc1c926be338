"""Weight-only quantized models: whole-model quantization, and the int8 checkpoint format.

    model = load_model(path, quantize="q4_1")         # specrt model; layers stay quantized
    quantize_model_(model, "q8_0")                    # the same, in place, on a loaded model
    quantize_linear_layers_(hf_model)                 # any nn.Module (e.g. transformers): int8
    save_quantized(hf_model, "out/"); load_quantized("out/")

The layers are specrt.models.linear.QuantLinear (int8 per output row, or GGUF-style
Q8_0 / Q4_0 / Q4_1 groups of 32): weights stay quantized at run time and are
dequantized in registers by the small-M kernel, so an int8 draft takes ~1/4 of its fp32
memory (and Q4 ~1/7) instead of being widened to float at load.

Int8 checkpoint format (safetensors): ``<name>.weight`` int8 ``[out, in]`` and
``<name>.weight_scale`` float32 ``[out]`` for every quantized linear (W = q * scale[:, None],
``scale[o] = max|W[o, :]| / 127``); every other tensor unchanged. ``config.json`` gets
``"specrt_quantization": "int8"`` and ``"specrt_quantized_modules": [names]``; a quantized
``lm_head`` is stored untied (``tie_word_embeddings`` false).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn

from specrt.models.linear import KINDS, QuantEmbedding, QuantLinear, quantize

QUANT_FLAG = "specrt_quantization"
QUANT_MODULES = "specrt_quantized_modules"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w[out, in] float -> (q[out, in] int8, scale[out] float32), symmetric per row."""
    q, scale, _ = quantize(w, "int8")
    return q, scale


class Int8Linear(QuantLinear):
    """Drop-in nn.Linear with int8 weights and per-output-row float32 scales (kind "int8")."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, "int8", bias=bias)

    @classmethod
    def from_linear(cls, lin: nn.Linear, kind: str = "int8") -> "Int8Linear":
        if kind != "int8":
            raise ValueError(f"Int8Linear is kind 'int8', got {kind!r} (use QuantLinear.from_linear)")
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None)
        q, s = quantize_weight_int8(lin.weight)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        if lin.bias is not None:
            m.bias.data = lin.bias.detach().float().clone()
        return m

    def dequantized_weight(self) -> torch.Tensor:
        return self.dequantize()


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"quantize must be one of {KINDS} or None, got {kind!r}")


def quantize_model_(model, kind: str, embeddings: bool = True):
    """Quantize a specrt LlamaForCausalLM in place: every projection and the LM head become
    QuantLinear(kind); with ``embeddings`` the token embeddings are looked up in a quantized
    matrix too (tied embeddings share the LM head's, as llama.cpp does). Activations keep the
    model's dtype. Returns the model."""
    _check_kind(kind)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in _PROJECTIONS:
                lin = getattr(parent, name, None)
                if lin is None:
                    continue
                if type(lin) is not nn.Linear:
                    raise ValueError(f"cannot quantize {type(lin).__name__} {name} (tensor-parallel or already "
                                     f"quantized model?)")
                setattr(parent, name, QuantLinear.from_linear(lin, kind))
    emb = model.model.embed_tokens
    tied = model.config.tie_word_embeddings and model.lm_head.weight is emb.weight
    if type(model.lm_head) is nn.Linear:
        model.lm_head = QuantLinear.from_linear(model.lm_head, kind)
    if embeddings and isinstance(emb, nn.Embedding):
        source = model.lm_head if tied else QuantLinear.from_float(emb.weight, kind)
        model.model.embed_tokens = QuantEmbedding(source, emb.weight.dtype, owned=not tied)
    model.invalidate_prepared()
    return model


def take_int8_(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Remove the int8 checkpoint pairs (``<name>.weight`` int8 + ``<name>.weight_scale``) from a
    state dict; returns {module name: (q [out, in] int8, scale [out] float32)}."""
    taken = {}
    for key in [k for k in state if k.endswith(".weight_scale")]:
        wkey = key[: -len("_scale")]
        q, scale = state.get(wkey), state.pop(key)
        if q is None or q.dtype != torch.int8 or q.dim() != 2 or scale.shape != q.shape[:1]:
            raise ValueError(f"int8 checkpoint: {key} {tuple(scale.shape)} does not match {wkey} "
                             f"{None if q is None else (q.dtype, tuple(q.shape))}")
        del state[wkey]
        taken[wkey[: -len(".weight")]] = (q, scale.float())
    return taken


def install_int8_(model: nn.Module, taken: dict[str, tuple[torch.Tensor, torch.Tensor]], device) -> None:
    """Replace each named nn.Linear (bias already loaded) by an int8 QuantLinear holding (q, scale)."""
    for name, (q, scale) in taken.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        if not isinstance(lin, nn.Linear) or tuple(lin.weight.shape) != tuple(q.shape):
            raise ValueError(f"int8 checkpoint: {name}.weight {tuple(q.shape)} does not match the model's "
                             f"{type(lin).__name__} {tuple(getattr(lin, 'weight', torch.empty(0)).shape)}")
        bias = None if lin.bias is None else lin.bias.detach()
        setattr(parent, child, QuantLinear.from_parts("int8", q.to(device), scale.to(device), None, bias))


def quantize_linear_layers_(module: nn.Module, skip: tuple[str, ...] = (), kind: str = "int8") -> nn.Module:
    """Replace every nn.Linear below ``module`` (names not in ``skip``) by a QuantLinear, in place
    (Int8Linear for kind "int8"); works on any module tree, e.g. a transformers model."""
    _check_kind(kind)
    for name, child in list(module.named_modules()):
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(sub, nn.Linear) and full not in skip:
                setattr(child, cname, Int8Linear.from_linear(sub) if kind == "int8"
                        else QuantLinear.from_linear(sub, kind))
    if hasattr(module, "config") and "lm_head" in quantized_modules(module):
        module.config.tie_word_embeddings = False   # its own int8 head: the embedding stays float
    return module


def quantized_modules(module: nn.Module) -> dict[str, str]:
    """{name: kind} of every QuantLinear below ``module``, in module order (what save_quantized
    writes into config.json)."""
    return {n: m.kind for n, m in module.named_modules() if isinstance(m, QuantLinear)}


def _keeps_dtype(key: str, v: torch.Tensor) -> bool:
    return not v.is_floating_point() or key.endswith((".weight_scale", ".weight_min"))


def save_quantized(model: nn.Module, out_dir: str, dtype: torch.dtype = torch.float16) -> None:
    """Write config.json (with the int8 flag and the quantized modules' names, when it has any) +
    model.safetensors (int8 + scales, rest in dtype)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    quantized = quantized_modules(model)
    if any(kind != "int8" for kind in quantized.values()):
        raise ValueError("save_quantized writes the int8 format only (quantize with kind='int8')")
    sd = {k: (v if _keeps_dtype(k, v) else v.to(dtype)).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in sd \
            and sd["lm_head.weight"].dtype != torch.int8:
        del sd["lm_head.weight"]  # tied to model.embed_tokens.weight: store once
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    if quantized:
        cfg[QUANT_FLAG], cfg[QUANT_MODULES] = "int8", list(quantized)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def load_quantized(path: str, dtype: torch.dtype = torch.float32):
    """Load a folder written by save_quantized as a transformers LlamaForCausalLM with Int8Linear."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    with open(os.path.join(path, "config.json")) as f:
        cfg_d = json.load(f)
    if cfg_d.get(QUANT_FLAG) != "int8":
        raise ValueError(f"{path}/config.json has no {QUANT_FLAG}='int8' flag")
    names = set(cfg_d.get(QUANT_MODULES, []))
    cfg = LlamaConfig.from_dict(cfg_d)
    model = LlamaForCausalLM(cfg)
    for name, child in list(model.named_modules()):
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if full in names and isinstance(sub, nn.Linear):
                setattr(child, cname, Int8Linear(sub.in_features, sub.out_features, sub.bias is not None))
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd = {k: (v if _keeps_dtype(k, v) else v.to(dtype)) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")
               and not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: missing {missing} unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if dtype != torch.float32:  # the scales keep float32 (int8 weights are not touched by .to(dtype))
        scales = {m: m.weight_scale for m in model.modules() if isinstance(m, QuantLinear)}
        model = model.to(dtype)
        for m, s in scales.items():
            m.weight_scale = s
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    """python -m specrt.models.quant IN_DIR OUT_DIR [--keep-lm-head]: int8-quantise a HF Llama folder."""
    import argparse
    import shutil
    from transformers import LlamaForCausalLM
    ap = argparse.ArgumentParser(prog="specrt.models.quant", description=main.__doc__)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--keep-lm-head", action="store_true", help="leave lm_head (and its tie) in float")
    args = ap.parse_args(argv)
    model = LlamaForCausalLM.from_pretrained(args.src, dtype=torch.float32)
    quantize_linear_layers_(model, skip=("lm_head",) if args.keep_lm_head else ())
    save_quantized(model, args.dst)
    for fn in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(args.src, fn)):
            shutil.copy(os.path.join(args.src, fn), os.path.join(args.dst, fn))
    print(f"int8 model -> {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
