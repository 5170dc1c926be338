"""A ``tokenizers`` tokenizer and its tokenizer_config from a GGUF file's ``tokenizer.*`` metadata.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``, what Llama 3, Qwen2 and
SmolLM ship) are rebuilt here from the file's tokens, merges and token types, with the
pre-tokenizer llama.cpp uses for the file's ``tokenizer.ggml.pre``. Any other tokenizer
is delegated to transformers' GGUF tokenizer conversion when transformers is installed.
"""
from __future__ import annotations

from typing import Any

_CONTROL, _USER_DEFINED = 3, 4          # llama.cpp token types (tokenizer.ggml.token_type)
# llama.cpp's split patterns per pre-tokenizer name (llama-vocab.cpp), in tokenizers' regex syntax
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_KINDS = {  # tokenizer.ggml.pre -> (split kind, ignore_merges)
    "default": ("gpt2", False), "gpt-2": ("gpt2", False), "gpt2": ("gpt2", False),
    "smollm": ("digits+gpt2", False),
    "llama3": ("llama3", True), "llama-v3": ("llama3", True), "llama-bpe": ("llama3", True),
    "qwen2": ("qwen2", False),
}


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=kind not in ("llama3", "qwen2"))
    if kind == "gpt2":
        return byte_level
    if kind == "digits+gpt2":   # every digit its own piece, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    byte_level])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    kind, ignore_merges = _PRE_KINDS[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=ignore_merges))
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(kind)
    tok.decoder = decoders.ByteLevel()
    return tok


def _via_transformers(model) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{model.path}: its tokenizer (tokenizer.ggml.model="
                         f"{model.field('tokenizer.ggml.model')!r}, pre={model.field('tokenizer.ggml.pre')!r}) "
                         f"is not one specrt builds itself (byte-level BPE with pre-tokenizer "
                         f"{', '.join(_PRE_KINDS)}); install transformers to convert it") from None
    hf = AutoTokenizer.from_pretrained(str(model.path.parent), gguf_file=model.path.name)
    return hf.backend_tokenizer


def _add_special_tokens(tok, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (both are
    matched whole in text, as llama.cpp does); their ids are already in the vocabulary."""
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _post_processor(tok, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    from tokenizers import processors

    pre = [bos] if add_bos and bos else []
    post = [eos] if add_eos and eos else []
    if not pre and not post:
        return
    single = " ".join([*pre, "$A:0", *post])
    pair = " ".join([*pre, "$A:0", *post, *pre, "$B:1", *post])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(pre + post)])


def _chat_template(model) -> str | list | None:
    default = model.field("tokenizer.chat_template")
    names = model.field("tokenizer.chat_templates") or []
    if not names:
        return default
    named = [{"name": n, "template": model.field(f"tokenizer.chat_template.{n}")} for n in names]
    return ([{"name": "default", "template": default}] if default else []) + [t for t in named if t["template"]]


def build_tokenizer(model) -> tuple[Any, dict]:
    """(tokenizers.Tokenizer, tokenizer_config dict) for a GGUFModel; ValueError if it has none."""
    tok_model = model.field("tokenizer.ggml.model")
    tokens = model.field("tokenizer.ggml.tokens")
    if tok_model is None or not tokens:
        raise ValueError(f"{model.path}: the GGUF has no tokenizer (tokenizer.ggml.* metadata)")
    pre = model.field("tokenizer.ggml.pre", "default")
    types = model.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if tok_model == "gpt2" and pre in _PRE_KINDS:
        tok = _byte_level_bpe(tokens, model.field("tokenizer.ggml.merges") or [], pre)
        _add_special_tokens(tok, tokens, types)
    else:
        tok = _via_transformers(model)

    def token(key: str) -> str | None:
        i = model.field(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(model.field("tokenizer.ggml.add_bos_token", tok_model == "llama"))
    add_eos = bool(model.field("tokenizer.ggml.add_eos_token", False))
    if tok_model == "gpt2" and pre in _PRE_KINDS:
        _post_processor(tok, bos, eos, add_bos, add_eos)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
              "add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
              "model_max_length": int(model.field(f"{model.arch}.context_length", 2048))}
    template = _chat_template(model)
    if template:
        config["chat_template"] = template
    return tok, config
