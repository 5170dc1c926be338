"""Byte-level BPE tokenizer trained on the stdlib corpus (train split only).

    python -m specrt.training.tokenizer --out ckpt/tokenizer --vocab-size 4096

Writes ``tokenizer.json`` + ``tokenizer_config.json`` (loadable by
``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer``).
Special token ``<|endoftext|>`` has id 0 and serves as BOS, EOS and padding.
"""
from __future__ import annotations

import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specrt.training import corpus

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps encode/decode an exact roundtrip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str, model_max_length: int = 2048) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def load_tokenizer(path: str) -> Tokenizer:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.tokenizer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ckpt/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args(argv)
    texts = corpus.load_texts("train")
    tok = train_tokenizer(texts, args.vocab_size)
    save_tokenizer(tok, args.out)
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(texts))
    print(f"vocab {tok.get_vocab_size()}  train tokens {n_tok}  bytes/token {n_bytes / n_tok:.2f}"
          f"  -> {args.out}/tokenizer.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
