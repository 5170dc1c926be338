"""A tiny target/draft pair with a tokenizer, saved as HF folders, for engine tests.

The draft is the target's first layer plus its embeddings, final norm and head
(layer-init), so it agrees with the target often enough for speculation to matter.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 96
EOS = 2


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def make_pair(root: Path, layers: int = 3, draft_layers: int = 1, seed: int = 0,
              max_position_embeddings: int = 512) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=EOS,
                      tie_word_embeddings=True)
    target = LlamaForCausalLM(cfg).eval()
    tdir, ddir = root / "target", root / "draft"
    target.save_pretrained(str(tdir), safe_serialization=True)
    dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": draft_layers})
    draft = LlamaForCausalLM(dcfg).eval()
    sd = {k: v for k, v in target.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    draft.load_state_dict(sd, strict=False)
    draft.save_pretrained(str(ddir), safe_serialization=True)
    for d in (tdir, ddir):
        _tokenizer(d)
    return tdir, ddir


def pair_for_tests(tmp_path_factory, accept_head: bool = False) -> tuple[Path, Path]:
    """A module's pair in a fresh temp folder, torch pinned to one thread. With ``accept_head``
    an untrained acceptance head lies beside the draft for policy="head" (untrained is fine:
    the policy must be output-neutral whatever the head says)."""
    torch.set_num_threads(1)
    tdir, ddir = make_pair(tmp_path_factory.mktemp("pair"))
    if accept_head:
        from specrt.models.accept_head import AcceptanceHead

        torch.manual_seed(0)
        AcceptanceHead(hidden_size=64, width=16).save(str(ddir / "accept_head"))
    return tdir, ddir


class LLMCache:
    """``llm(pair, draft, **spec)``: one specrt.LLM per (draft, spec) over a pair, built once; a
    tree-growing engine drafts its whole budget every step (tree="fixed") unless the test names
    a tree mode (the planner of tree="dynamic", the default, may switch a poor pair's drafting off).
    draft "model" is the pair's draft, "target" the target itself, "none" no draft; any other
    value ("ngram", "self:1", a folder) goes to the LLM as is. No lookup goes in front of a model
    unless the test names one (lookup=...)."""

    def __init__(self) -> None:
        self._llms: dict = {}

    def __call__(self, pair, draft, **spec):
        import specrt
        from specrt import SpecConfig

        if spec.get("policy", "fixed") in ("fixed", "auto") and not spec.get("overlap") and "tree" not in spec:
            spec = {**spec, "tree": "fixed"}   # tree steps always draft: identity tests are never vacuous
        spec = {"lookup": None, **spec}        # the drafter's own drafts (the lookup in front: test_suffix_drafter)
        key = (draft, tuple(sorted(spec.items())))
        if key not in self._llms:
            tdir, ddir = pair
            d = {"model": str(ddir), "none": None, "target": str(tdir)}.get(draft, draft)
            # the target as its own draft stays the target (the default would quantize a draft model)
            same = {"draft_quantize": None} if d == str(tdir) else {}
            self._llms[key] = specrt.LLM(target=str(tdir), draft=d, spec=SpecConfig(**spec), seed=0, **same)
        return self._llms[key]


def tokens(outs) -> list[list[int]]:
    """The token ids of each output."""
    return [o.token_ids for o in outs]


def exact_tables(tdir: Path, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact p(x0 | prompt) [V] and p(x1 | prompt, x0) [V, V] at T=1, top-k 8."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).eval()

    def dist(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        top = torch.topk(logits, 8)
        p = torch.zeros(VOCAB, dtype=torch.float64)
        p[top.indices] = torch.softmax(top.values, -1)
        return p.numpy()

    first = dist(prompt)
    second = np.zeros((VOCAB, VOCAB))
    for x0 in np.nonzero(first)[0]:
        second[x0] = dist(prompt + [int(x0)])
    return first, second
