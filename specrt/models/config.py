"""ModelConfig: the subset of a Hugging Face ``config.json`` the Llama-family decoder needs.

Handles both the transformers<5 layout (``rope_theta`` + ``rope_scaling``) and the
transformers>=5 layout (``rope_parameters``), and ``torch_dtype`` / ``dtype``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass
class ModelConfig:
    architecture: str  # "LlamaForCausalLM" | "Qwen2ForCausalLM" | "MistralForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # normalised: always has "rope_type" when not None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and o for Llama's attention_bias) biases
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    sliding_window: int | None = None  # attend to the last `sliding_window` positions (incl. self)
    sliding_window_layers: list[bool] | None = None  # per layer: does the window apply (None = all layers)
    o_proj_bias: bool = False  # Llama attention_bias=True also biases o_proj; Qwen2 does not
    mlp_bias: bool = False
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # the raw config.json

    @classmethod
    def from_json(cls, path_or_dict) -> "ModelConfig":
        """Parse a config.json path, a model folder, or an already-loaded dict.

        Raises ValueError naming an unsupported architecture / rope type or missing keys.
        """
        if isinstance(path_or_dict, dict):
            raw, where = dict(path_or_dict), "config dict"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"config.json not found: {path}")
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"config.json is not valid JSON: {path}: {e}") from None
            where = path
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object")

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            if archs:
                raise ValueError(
                    f"{where}: unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
            arch = _MODEL_TYPE_TO_ARCH.get(raw.get("model_type"))
            if arch is None:
                raise ValueError(
                    f"{where}: unsupported architecture (model_type={raw.get('model_type')!r}, no 'architectures'); "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if raw.get(k) is None]
        if missing:
            raise ValueError(f"{where}: missing required keys {missing}")

        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_attention_heads={num_heads} not divisible by "
                             f"num_key_value_heads={num_kv_heads}")

        # RoPE: transformers>=5 writes rope_parameters {rope_type, rope_theta, ...}; older: rope_theta + rope_scaling
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict) and rope_params and isinstance(next(iter(rope_params.values())), dict):
            raise ValueError(f"{where}: per-layer-type rope_parameters are not supported")
        rope_params = dict(rope_params or {})
        rope_theta = float(rope_params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = dict(raw.get("rope_scaling") or {}) or rope_params
        rope_scaling = None
        if scaling:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"{where}: unsupported rope_scaling type {rtype!r}; supported: {SUPPORTED_ROPE_TYPES}")
            if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
                raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
            if rtype != "default":
                rope_scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
                rope_scaling["rope_type"] = rtype
                need = {"linear": ("factor",), "dynamic": ("factor",),
                        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
                miss = [k for k in need[rtype] if k not in rope_scaling]
                if miss:
                    raise ValueError(f"{where}: rope_scaling type {rtype!r} is missing {miss}")

        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{where}: unsupported hidden_act {act!r}; supported: {SUPPORTED_ACTIVATIONS}")

        num_layers = int(raw["num_hidden_layers"])
        sliding_window, sliding_layers = None, None
        if arch == "MistralForCausalLM":
            if raw.get("sliding_window") is not None:
                sliding_window = int(raw["sliding_window"])
        elif arch == "Qwen2ForCausalLM":
            layer_types = raw.get("layer_types")
            if layer_types is None and raw.get("use_sliding_window"):
                mwl = int(raw.get("max_window_layers", num_layers))
                layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(num_layers)]
            if layer_types and "sliding_attention" in layer_types and raw.get("sliding_window") is not None:
                sliding_window = int(raw["sliding_window"])
                sliding_layers = [t == "sliding_attention" for t in layer_types]

        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = raw.get("bos_token_id")
        if isinstance(bos, list):
            bos = bos[0] if bos else None

        if arch == "Qwen2ForCausalLM":
            attention_bias, o_bias = True, False  # Qwen2: q/k/v always biased, o_proj never
        else:
            attention_bias = bool(raw.get("attention_bias", False))
            o_bias = attention_bias

        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
            sliding_window=sliding_window,
            sliding_window_layers=sliding_layers,
            o_proj_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=act,
            extra=raw,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence the model serves: max_position_embeddings, times the factor for dynamic NTK RoPE."""
        if self.rope_scaling and self.rope_scaling["rope_type"] == "dynamic":
            return int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """Sliding window size applying to `layer`, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or self.sliding_window_layers[layer]:
            return self.sliding_window
        return None


def check_prompt_length(config: ModelConfig, prompt_len: int, max_new_tokens: int = 0,
                        max_model_len: int | None = None) -> None:
    """Raise ValueError when a prompt (plus the tokens to generate) does not fit the model's context."""
    limit = config.max_model_len if max_model_len is None else min(max_model_len, config.max_model_len)
    if prompt_len <= 0:
        raise ValueError("prompt is empty: at least one token is required")
    if prompt_len > limit:
        raise ValueError(f"prompt has {prompt_len} tokens, longer than the model's context of {limit} tokens")
    if prompt_len + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"context of {limit} tokens")
