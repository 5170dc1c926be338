"""The models a benchmark runs: the target/draft pair it was asked for (or a random pair when the
built-in one is not installed) and random-weight Llama-shaped models built in memory."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

SHAPES = {   # Llama-family shapes (hidden, ffn, layers, heads, kv_heads, vocab)
    "tiny": (128, 256, 4, 4, 2, 1024),
    "160m": (768, 2048, 12, 12, 4, 32000),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "3b": (3072, 8192, 28, 24, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}


def _char_tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n", "\t"]:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def random_pair(root: Path) -> tuple[Path, Path]:
    """A random-weight char-level Llama pair (fallback when the built-in pair is not installed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=112, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    target = LlamaForCausalLM(cfg).eval()
    dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(dcfg).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < 1}, strict=False)
    dirs = root / "target", root / "draft"
    for m, d in zip((target, draft), dirs):
        m.save_pretrained(str(d), safe_serialization=True)
        _char_tokenizer(d)
    return dirs


def resolve_pair(target: str, draft: str, log=print) -> tuple[str, str, str]:
    """(target, draft, note). 'builtin' falls back, with a clear message, to a random pair."""
    from specrt.models.sources import BUILTIN_DIR

    if target == "builtin" and not (BUILTIN_DIR / "target" / "config.json").is_file():
        root = Path(tempfile.mkdtemp(prefix="specrt-bench-"))
        t, d = random_pair(root)
        note = (f"THE BUILT-IN PAIR IS NOT INSTALLED ({BUILTIN_DIR}); benchmarking a RANDOM-WEIGHT char-level "
                f"pair instead (timings are real, acceptance numbers are meaningless). Pass --target/--draft.")
        log("specrt bench: " + note)
        return str(t), (str(d) if draft == "builtin" else draft), note
    if draft == "builtin" and not (BUILTIN_DIR / "draft" / "config.json").is_file():
        note = "the built-in draft is missing; using draft='self:2'"
        log("specrt bench: " + note)
        return target, "self:2", note
    return target, draft, ""


def model_dir(path: str, role: str) -> Path:
    """The local folder of a model argument ('builtin' or a path)."""
    from specrt.models.sources import resolve_model_path

    return resolve_model_path(path, role)


def random_model(shape, device, dtype, layers: int | None = None):
    """A random-weight specrt LlamaForCausalLM of a named shape, created on the device (no files)."""
    from specrt.models import LlamaForCausalLM, ModelConfig

    h, f, n, heads, kvh, vocab = SHAPES[shape] if isinstance(shape, str) else shape
    cfg = ModelConfig.from_json({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": h, "intermediate_size": f,
        "num_hidden_layers": layers or n, "num_attention_heads": heads, "num_key_value_heads": kvh,
        "head_dim": h // heads, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
