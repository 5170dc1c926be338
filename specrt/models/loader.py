"""Load a local model: a Hugging Face folder (config.json, *.safetensors, tokenizer,
generation config) or a GGUF file (specrt.models.gguf).

Never touches the network and never runs repository code: only JSON, safetensors,
``tokenizer.json`` and GGUF metadata/tensors are read; chat templates render in a jinja2 sandbox.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specrt.models.config import ModelConfig
from specrt.models.gguf import is_gguf, open_gguf
from specrt.models.llama import LlamaForCausalLM
from specrt.models.quant import KINDS as QUANT_KINDS, install_int8_, quantize_model_, take_int8_
from specrt.models.tokenizer import Tokenizer, _read_json, load_tokenizer

__all__ = ["load_model", "load_config", "load_tokenizer", "load_generation_config", "check_draft_compatible",
           "check_dtype_supported", "resolve_dtype", "Tokenizer"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
_IGNORED_KEYS = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype, config: ModelConfig) -> torch.dtype:
    """None -> float32; "auto" -> the checkpoint's torch_dtype (float32 if absent); str/torch.dtype as given."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported: use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        dtype = config.torch_dtype or "float32"
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        if name not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported: use float32, bfloat16 or float16")
        return _DTYPES[name]
    raise ValueError(f"dtype {dtype!r} is not supported")


def check_dtype_supported(dtype: torch.dtype, device) -> None:
    """Run a tiny linear + attention + RMSNorm in ``dtype`` on ``device``; ValueError if it cannot."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype {dtype} cannot run the model on {device}: a floating-point dtype is required")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)
        w = torch.ones(8, 8, dtype=dtype, device=device)
        y = torch.nn.functional.linear(x, w)
        q = torch.ones(1, 1, 2, 8, dtype=dtype, device=device)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        y = (y.float() + a[0, 0].float()).sum()
        if not torch.isfinite(y):
            raise RuntimeError("non-finite result")
    except Exception as e:  # noqa: BLE001 - any failure means this dtype is unusable here
        raise ValueError(f"dtype {dtype} cannot run the model on device {device}: {type(e).__name__}: {e}") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt {index}: {e}") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shards listed in model.safetensors.index.json are missing: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    extra = " (found PyTorch .bin weights: convert them to safetensors)" if list(folder.glob("*.bin")) else ""
    raise ValueError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors found{extra}")


def _read_safetensors(files: list[Path], device, select=None) -> dict[str, torch.Tensor]:
    """Every tensor of the files; ``select(name, lazy_slice) -> Tensor`` reads only part of one
    (tensor parallelism: each rank reads just its shard)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    tensors[key] = sf.get_tensor(key) if select is None else select(key, sf.get_slice(key))
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, header errors
            raise ValueError(f"corrupt or unreadable safetensors file {f}: {type(e).__name__}: {e}") from None
    return tensors


def _dequantize_int8(state: dict[str, torch.Tensor]) -> None:
    """specrt.models.quant checkpoints: int8 ``<name>.weight`` + float ``<name>.weight_scale`` [out]
    -> float weights (W = q * scale[:, None]); only for tensor-parallel shards (else they stay int8)."""
    for key in [k for k in state if k.endswith(".weight_scale")]:
        wkey = key[: -len("_scale")]
        q, scale = state.get(wkey), state.pop(key)
        if q is None or q.dtype != torch.int8 or scale.shape != q.shape[:1]:
            raise ValueError(f"int8 checkpoint: {key} {tuple(scale.shape)} does not match {wkey} "
                             f"{None if q is None else (q.dtype, tuple(q.shape))}")
        state[wkey] = q.float() * scale.float()[:, None]


def load_config(path) -> ModelConfig:
    """The ModelConfig of a model folder (config.json) or a GGUF file (its metadata)."""
    if is_gguf(path):
        return ModelConfig.from_json(open_gguf(path).hf_config())
    return ModelConfig.from_json(os.fspath(path))


def load_model(path, dtype=None, device="cpu", tp: tuple | None = None,
               quantize: str | None = None) -> LlamaForCausalLM:
    """Load a Llama / Qwen2 / Mistral checkpoint from a local folder (config.json + safetensors)
    or a GGUF file (dequantized to ``dtype`` by the gguf package).

    dtype: None (float32), "auto" (the checkpoint's torch_dtype), a name or a torch.dtype.
    tp: (rank, world_size, process_group) loads only this rank's tensor-parallel shard (reading
    just those slices of the files) into a model sharded by specrt.models.tp.
    Raises ValueError with a clear message for a missing folder/config/weights, corrupt
    files, unsupported architecture, missing/mis-shaped tensors, or a dtype the device can't run.
    quantize: None, or "int8" / "q8_0" / "q4_0" / "q4_1": every projection, the LM head and the
    embeddings become weight-only quantized layers that stay quantized (specrt.models.quant);
    activations keep ``dtype``. int8 weight-only checkpoints (specrt.models.quant) load as int8
    layers (dequantized to ``dtype`` only for tensor-parallel shards).
    """
    if quantize is not None and quantize not in QUANT_KINDS:
        raise ValueError(f"quantize must be one of {QUANT_KINDS} or None, got {quantize!r}")
    if quantize is not None and tp is not None and tp[1] > 1:
        raise ValueError("quantize is not supported with tensor parallelism")
    source = Path(path)
    if is_gguf(source):
        gguf_model = open_gguf(source)
        config = ModelConfig.from_json(gguf_model.hf_config())
        read = lambda select: gguf_model.state_dict(torch.float32, select=select)  # noqa: E731
    else:
        if not source.is_dir():
            raise ValueError(f"model folder not found: {source}")
        config = ModelConfig.from_json(source / "config.json")
        files = _weight_files(source)
        read = lambda select: _read_safetensors(files, "cpu", select)  # noqa: E731
    torch_dtype = resolve_dtype(dtype, config)
    check_dtype_supported(torch_dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    select = None
    if tp is not None and tp[1] > 1:
        from specrt.models.tp import shard_model_, shard_selector

        rank, world_size, group = tp
        shard_model_(model, rank, world_size, group)  # on meta: just the per-rank structure and shapes
        select = shard_selector(config, rank, world_size)
    state = read(select)
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_KEYS)}
    int8 = take_int8_(state) if select is None else {}  # stays int8 (TP shards are widened below)
    _dequantize_int8(state)
    _check_state(state, model, config, source, skip=int8)
    for k in dict(model.named_parameters(remove_duplicate=False)):
        if k in state:
            state[k] = state[k].to(device=device, dtype=torch_dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    install_int8_(model, int8, device)
    if quantize is not None:
        quantize_model_(model, quantize)
    model.eval()
    model.requires_grad_(False)
    model.prepare()  # fuse q/k/v and gate/up (the fused tensors ARE the parameters' storage: no extra memory)
    return model


def _check_state(state: dict, model: LlamaForCausalLM, config: ModelConfig, source: Path, skip=()) -> None:
    """ValueError unless ``state`` holds exactly the model's float tensors with matching shapes
    (drops a tied lm_head, as transformers does); ``skip``: layers loaded as int8 elsewhere."""
    expected = dict(model.named_parameters(remove_duplicate=False))
    for name in skip:
        expected.pop(f"{name}.weight", None)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)  # transformers ignores it too when tied
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: checkpoint does not match {config.architecture} config: "
                         f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    bad = [f"{k}: {tuple(state[k].shape)} != {tuple(p.shape)}" for k, p in expected.items()
           if tuple(state[k].shape) != tuple(p.shape)]
    if bad:
        raise ValueError(f"{source}: tensor shapes do not match config.json: {bad[:8]}")
    for k in expected:
        if not state[k].is_floating_point():
            raise ValueError(f"{source}: tensor {k} has non-float dtype {state[k].dtype}")


def load_generation_config(path) -> dict:
    """generation_config.json as a dict ({} if absent); a GGUF file's bos / eos / pad ids."""
    if is_gguf(path):
        return open_gguf(path).generation_config()
    return _read_json(Path(path) / "generation_config.json")


def _config_of(x) -> ModelConfig:
    if isinstance(x, ModelConfig):
        return x
    if isinstance(x, LlamaForCausalLM):
        return x.config
    return load_config(x)


def _has_tokenizer(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and (is_gguf(path) or (Path(path) / "tokenizer.json").is_file())


def check_draft_compatible(target_path_or_model, draft_path_or_model, target_tok=None, draft_tok=None) -> dict:
    """Raise ValueError listing every difference that breaks a shared vocabulary.

    Accepts folders, ModelConfig or LlamaForCausalLM for the models; tokenizers are loaded
    from the folders when not given (skipped when neither is available).

    Model vocab sizes may differ only by padding rows beyond the (identical) tokenizer's
    vocabulary (e.g. Qwen2.5-7B 152064 vs Qwen2.5-0.5B 151936); the engine then compares
    the first ``shared_vocab_size`` logits and gives the remaining target ids zero draft
    probability. Returns {"target_vocab_size", "draft_vocab_size", "shared_vocab_size"}.
    """
    tcfg, dcfg = _config_of(target_path_or_model), _config_of(draft_path_or_model)
    if target_tok is None and _has_tokenizer(target_path_or_model):
        target_tok = load_tokenizer(target_path_or_model)
    if draft_tok is None and _has_tokenizer(draft_path_or_model):
        draft_tok = load_tokenizer(draft_path_or_model)

    diffs: list[str] = []
    if target_tok is not None and draft_tok is not None:
        diffs += target_tok.differences(draft_tok)
        tok_vocab = target_tok.vocab_size
        for name, cfg in (("target", tcfg), ("draft", dcfg)):
            if cfg.vocab_size < tok_vocab:
                diffs.append(f"{name} model vocab_size {cfg.vocab_size} < tokenizer vocabulary {tok_vocab}")
    elif tcfg.vocab_size != dcfg.vocab_size:
        diffs.append(f"vocab_size: target {tcfg.vocab_size} != draft {dcfg.vocab_size}")
    if tcfg.bos_token_id != dcfg.bos_token_id:
        diffs.append(f"bos_token_id: target {tcfg.bos_token_id} != draft {dcfg.bos_token_id}")
    if target_tok is None and set(tcfg.eos_token_ids) != set(dcfg.eos_token_ids):
        diffs.append(f"eos_token_id: target {tcfg.eos_token_ids} != draft {dcfg.eos_token_ids}")
    if diffs:
        raise ValueError("draft model is incompatible with the target (the runtime requires a shared "
                         "vocabulary):\n  - " + "\n  - ".join(diffs))
    return {"target_vocab_size": tcfg.vocab_size, "draft_vocab_size": dcfg.vocab_size,
            "shared_vocab_size": min(tcfg.vocab_size, dcfg.vocab_size)}
