"""Weight-only int8 quantisation (per-output-channel scales) for any nn.Linear.

    model = quantize_linear_layers_(model)            # in place, returns model
    save_quantized(model, "out/")                     # int8 + scales, config flag
    model = load_quantized("out/")                    # transformers Llama, int8 linears

Each weight row ``W[o, :]`` is stored as ``int8 q[o, :]`` with
``scale[o] = max|W[o, :]| / 127`` so ``W ~= q * scale[:, None]``; the rounding
error per element is at most ``scale[o] / 2``. Forward dequantises on the fly:
``y = (x @ q.T) * scale + bias`` (the int8 -> activation dtype cast happens per
call). On CPU this saves memory (4x vs fp32) but not time for small matrices.

On-disk format (safetensors): ``<name>.weight`` int8 ``[out, in]`` and
``<name>.weight_scale`` float32 ``[out]`` for every quantised linear; every
other tensor unchanged. ``config.json`` gets ``"specrt_quantization": "int8"``
and ``"specrt_quantized_modules": [names]``; a quantised ``lm_head`` is stored
untied (``tie_word_embeddings`` false).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

QUANT_FLAG = "specrt_quantization"
QUANT_MODULES = "specrt_quantized_modules"


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w[out, in] float -> (q[out, in] int8, scale[out] float32), symmetric per row."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """Drop-in nn.Linear with int8 weights and per-output-channel float32 scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "Int8Linear":
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None)
        q, s = quantize_weight_int8(lin.weight)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        if lin.bias is not None:
            m.bias.data = lin.bias.detach().clone()
        return m

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Cast int8 -> activation dtype per call and scale the output columns (cheaper
        # than scaling the weight). torch._weight_int8pack_mm was measured 3-30x slower
        # than this on our CPU (torch 2.14) for draft-sized matrices, so it is not used.
        y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)  # [..., out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linear_layers_(module: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every nn.Linear below ``module`` (names not in ``skip``) by Int8Linear, in place."""
    for name, child in list(module.named_modules()):
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(sub, nn.Linear) and full not in skip:
                setattr(child, cname, Int8Linear.from_linear(sub))
    if hasattr(module, "config") and any(isinstance(m, Int8Linear) for m in module.modules()):
        names = [n for n, m in module.named_modules() if isinstance(m, Int8Linear)]
        setattr(module.config, QUANT_FLAG, "int8")
        setattr(module.config, QUANT_MODULES, names)
        if "lm_head" in names:
            module.config.tie_word_embeddings = False
    return module


def save_quantized(model: nn.Module, out_dir: str, dtype: torch.dtype = torch.float16) -> None:
    """Write config.json (with the int8 flag) + model.safetensors (int8 + scales, rest in dtype)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if v.dtype == torch.int8 or k.endswith("weight_scale"):
            sd[k] = v.contiguous()
        else:
            sd[k] = v.to(dtype).contiguous()
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in sd \
            and sd["lm_head.weight"].dtype != torch.int8:
        del sd["lm_head.weight"]  # tied to model.embed_tokens.weight: store once
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
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
    sd = {k: (v if v.dtype == torch.int8 or k.endswith("weight_scale") else v.to(dtype)) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")
               and not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: missing {missing} unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval() if dtype != torch.float32 else model.eval()


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
