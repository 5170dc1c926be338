"""Llama-family models (Llama, Qwen2, Mistral) from local Hugging Face folders."""
from specrt.models.config import ModelConfig, check_prompt_length
from specrt.models.llama import LlamaForCausalLM
from specrt.models.loader import (
    check_draft_compatible,
    check_dtype_supported,
    load_generation_config,
    load_model,
)
from specrt.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ModelConfig", "check_prompt_length", "LlamaForCausalLM", "load_model", "load_tokenizer",
    "load_generation_config", "check_draft_compatible", "check_dtype_supported", "Tokenizer",
]
