"""Llama-family models (Llama, Qwen2, Mistral) from local Hugging Face folders and GGUF files; the
attention metadata and KV writes their layers issue (attention), the paged KV cache (kv_cache), and
where an engine's models come from (sources: names, folders, dtype, quantization, the loader hook)."""
from specrt.models.config import ModelConfig, check_prompt_length
from specrt.models.gguf import GGUFModel, QuantBlocks, convert_gguf, is_gguf, open_gguf
from specrt.models.llama import LlamaForCausalLM
from specrt.models.loader import (
    check_draft_compatible,
    check_dtype_supported,
    load_config,
    load_generation_config,
    load_model,
    load_tokenizer,
)
from specrt.models.registry import NAMED_MODELS, resolve_model
from specrt.models.tokenizer import Tokenizer

__all__ = [
    "ModelConfig", "check_prompt_length", "LlamaForCausalLM", "load_model", "load_config", "load_tokenizer",
    "load_generation_config", "check_draft_compatible", "check_dtype_supported", "Tokenizer",
    "GGUFModel", "QuantBlocks", "open_gguf", "is_gguf", "convert_gguf", "resolve_model", "NAMED_MODELS",
]
