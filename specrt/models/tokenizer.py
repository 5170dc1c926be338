"""Tokenizer: ``tokenizer.json`` (or a GGUF file's tokenizer metadata) through the ``tokenizers``
package, special tokens and the chat template from ``tokenizer_config.json`` /
``chat_template.jinja`` (rendered in a sandboxed jinja2 environment).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


def _token_str(tok) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _ids(x) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(i) for i in x]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


class Tokenizer:
    """Wraps ``tokenizers.Tokenizer``; ``eos_token_ids`` merges tokenizer_config.json,
    generation_config.json and config.json (all stop a request)."""

    def __init__(self, tokenizer, tokenizer_config: dict | None = None, extra_eos_ids: list[int] | None = None,
                 bos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.tokenizer_config = tokenizer_config or {}
        cfg = self.tokenizer_config
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else bos_token_id
        eos: list[int] = []
        if self.eos_token is not None and tokenizer.token_to_id(self.eos_token) is not None:
            eos.append(tokenizer.token_to_id(self.eos_token))
        for i in extra_eos_ids or []:
            if i not in eos:
                eos.append(i)
        self.eos_token_ids = eos
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` with the checkpoint's chat template (sandboxed jinja2)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json); pass a plain prompt")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        ctx = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                   pad_token=self.pad_token or "")
        ctx.update(kwargs)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)

    def differences(self, other: "Tokenizer", max_examples: int = 5) -> list[str]:
        """Human-readable differences that break a shared vocabulary (empty if none)."""
        out: list[str] = []
        if self.vocab_size != other.vocab_size:
            out.append(f"tokenizer vocabulary size: target {self.vocab_size} != draft {other.vocab_size}")
        a, b = self.tokenizer.get_vocab(with_added_tokens=True), other.tokenizer.get_vocab(with_added_tokens=True)
        differing = sorted((i, t, b.get(t)) for t, i in a.items() if b.get(t) != i)
        if differing:
            ex = ", ".join(f"{t!r}: target id {i} / draft id {j}" for i, t, j in differing[:max_examples])
            out.append(f"{len(differing)} token ids differ, e.g. {ex}")
        only_b = sorted((i, t) for t, i in b.items() if t not in a)
        if only_b:
            ex = ", ".join(f"{t!r} (id {i})" for i, t in only_b[:max_examples])
            out.append(f"{len(only_b)} draft tokens are not in the target vocabulary, e.g. {ex}")
        for name in ("bos_token_id",):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: target {getattr(self, name)} != draft {getattr(other, name)}")
        if set(self.eos_token_ids) != set(other.eos_token_ids):
            out.append(f"eos_token_ids: target {self.eos_token_ids} != draft {other.eos_token_ids}")
        sa = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        sb = {t.content for t in other.tokenizer.get_added_tokens_decoder().values() if t.special}
        if sa != sb:
            out.append(f"special tokens differ: only in target {sorted(sa - sb)[:max_examples]}, "
                       f"only in draft {sorted(sb - sa)[:max_examples]}")
        return out


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"chat_template does not compile: {e}") from None


def _read_chat_template(folder: Path, tcfg: dict) -> None:
    """transformers>=5 saves the template as chat_template.jinja (named ones under
    additional_chat_templates/), older processors as chat_template.json; the file wins over
    tokenizer_config.json's ``chat_template``, as in transformers."""
    jinja, legacy = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        tcfg["chat_template"] = jinja.read_text(encoding="utf-8")
    elif legacy.is_file() and _read_json(legacy).get("chat_template"):
        tcfg["chat_template"] = _read_json(legacy)["chat_template"]
    extra = folder / "additional_chat_templates"
    named = sorted(extra.glob("*.jinja")) if extra.is_dir() else []
    if named:
        default = tcfg.get("chat_template")
        tcfg["chat_template"] = ([{"name": "default", "template": default}] if isinstance(default, str) else []) + [
            {"name": f.stem, "template": f.read_text(encoding="utf-8")} for f in named]


def load_tokenizer(path) -> Tokenizer:
    """Tokenizer from a local folder's tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
    generation_config.json), or from a GGUF file's tokenizer metadata."""
    from tokenizers import Tokenizer as _HFTokenizer

    from specrt.models.gguf import is_gguf, open_gguf

    if is_gguf(path):
        model = open_gguf(path)
        tok, tcfg = model.tokenizer()
        gen = model.generation_config()
        return Tokenizer(tok, tcfg, _ids(gen.get("eos_token_id")), gen.get("bos_token_id"))
    folder = Path(path)
    f = folder / "tokenizer.json"
    if not f.is_file():
        raise ValueError(f"tokenizer.json not found in {folder} (only the fast-tokenizer format is supported)")
    try:
        tok = _HFTokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on parse errors
        raise ValueError(f"corrupt tokenizer.json {f}: {e}") from None
    tcfg = _read_json(folder / "tokenizer_config.json")
    _read_chat_template(folder, tcfg)
    gen = _read_json(folder / "generation_config.json")
    model_cfg = _read_json(folder / "config.json")
    extra = _ids(gen.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
    return Tokenizer(tok, tcfg, extra, bos if isinstance(bos, int) else None)
