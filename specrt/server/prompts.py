"""Prompt -> token ids, bounded before any tokenizing and run on the tokenizer pool (never on
the event loop, never on the step thread).

A prompt longer than `max_prompt_chars` characters cannot fit the context and is refused
without being tokenized: tokenizing megabytes takes seconds (defect 2 of issue 14).
"""
from __future__ import annotations

from specrt.server.errors import APIError, bad


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, releasing the GIL while it runs where the tokenizer allows it:
    the `tokenizers` package holds the GIL for all of `encode`, not for `encode_batch`."""
    inner = getattr(tokenizer, "tokenizer", None)
    encode_batch = getattr(inner, "encode_batch", None)
    if encode_batch is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def too_long(what: str, param: str, message: str) -> APIError:
    return APIError(400, f"{what} {message}", "invalid_request_error", param, "context_length_exceeded")


def _check_chars(n_chars: int, max_prompt_chars: int, max_model_len: int, param: str) -> None:
    if n_chars > max_prompt_chars:
        subject = "the prompt has" if param == "prompt" else "the messages hold"
        raise too_long(subject, param, f"{n_chars} characters, more than the {max_prompt_chars} this server "
                       f"accepts for the model's context of {max_model_len} tokens")


def _check_tokens(ids: list[int], max_model_len: int, param: str) -> list[int]:
    if not ids:
        raise bad("the prompt is empty: at least one token is required", param)
    if len(ids) > max_model_len - 1:
        raise too_long("the prompt", param, f"has {len(ids)} tokens; the model's context of {max_model_len} tokens "
                       f"holds at most {max_model_len - 1} prompt tokens")
    return ids


def chat_text(tokenizer, messages: list[dict], max_prompt_chars: int, max_model_len: int) -> str:
    """Render chat messages with the model's chat template (bounded in size before and after)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template, so it cannot take chat messages; send the text as "
                       "a plain prompt to /v1/completions", "invalid_request_error", None, "no_chat_template")
    chars = sum(len(m["content"]) + len(m.get("name", "")) for m in messages)
    _check_chars(chars, max_prompt_chars, max_model_len, "messages")
    if len(messages) > max_model_len:
        raise too_long("the messages", "messages", f"are {len(messages)}, more than the model's context of "
                       f"{max_model_len} tokens can hold")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:     # template errors (raise_exception, undefined) are the request's fault
        raise bad(f"the chat template could not render these messages: {e}", "messages") from None
    _check_chars(len(text), max_prompt_chars, max_model_len, "messages")
    return text


def prompt_token_ids(prompt, chat: bool, tokenizer, max_model_len: int, max_prompt_chars: int) -> list[int]:
    """Token ids of a parsed prompt: a string, token ids, or chat messages (list of dicts)."""
    if chat:
        text = chat_text(tokenizer, prompt, max_prompt_chars, max_model_len)
        # like HF apply_chat_template(tokenize=True): the template writes its own special tokens
        return _check_tokens(encode_text(tokenizer, text, False), max_model_len, "messages")
    if isinstance(prompt, str):
        _check_chars(len(prompt), max_prompt_chars, max_model_len, "prompt")
        return _check_tokens(encode_text(tokenizer, prompt), max_model_len, "prompt")
    return _check_tokens(list(prompt), max_model_len, "prompt")
