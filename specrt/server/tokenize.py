"""Prompt -> token ids, run on the tokenizer pool (never on the event loop, never on the step
thread)."""
from __future__ import annotations

from specrt.server.errors import APIError, bad


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def too_long(what: str, param: str, message: str) -> APIError:
    return APIError(400, f"{what} {message}", "invalid_request_error", param, "context_length_exceeded")


def _check_tokens(ids: list[int], max_model_len: int, param: str) -> list[int]:
    if not ids:
        raise bad("the prompt is empty: at least one token is required", param)
    if len(ids) > max_model_len - 1:
        raise too_long("the prompt", param, f"has {len(ids)} tokens; the model's context of {max_model_len} tokens "
                       f"holds at most {max_model_len - 1} prompt tokens")
    return ids


def chat_text(tokenizer, messages: list[dict]) -> str:
    """Render chat messages with the model's chat template."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:     # template errors (raise_exception, undefined) are the request's fault
        raise bad(f"the chat template could not render these messages: {e}", "messages") from None
    return text


def prompt_token_ids(prompt, chat: bool, tokenizer, max_model_len: int) -> list[int]:
    """Token ids of a parsed prompt: a string, token ids, or chat messages (list of dicts)."""
    if chat:
        text = chat_text(tokenizer, prompt)
        # like HF apply_chat_template(tokenize=True): the template writes its own special tokens
        return _check_tokens(encode_text(tokenizer, text, False), max_model_len, "messages")
    if isinstance(prompt, str):
        return _check_tokens(encode_text(tokenizer, prompt), max_model_len, "prompt")
    return _check_tokens(list(prompt), max_model_len, "prompt")
