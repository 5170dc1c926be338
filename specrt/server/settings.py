"""Server settings (one typed record) and their defaults; a flag kept under an old name."""
from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass

from specrt.config import parse_memory_size

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0     # a client must send its whole request body within this time
DEFAULT_MAX_CONNECTIONS = 512     # concurrent requests (health and metrics are never refused)
DEFAULT_DRAIN_TIMEOUT_S = 30.0    # on SIGTERM, in-flight requests get this long to finish
DEFAULT_HEADER_TIMEOUT_S = 10.0   # a connection must send a complete request head within this time
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle keep-alive connection is closed after this time
# After a SIGTERM, `specrt serve` exits at the latest this long after the drain time, whatever
# still runs (a tokenizer call, a stuck step, a non-daemon thread): see serve.py.
HARD_EXIT_GRACE_S = 8.0
MAX_TAGS = 64                     # distinct Prometheus tag values; later new tags become "other"
# Prompts are bounded in characters before they are tokenized: max_model_len tokens of real
# text average ~4 characters each; 32 per token leaves room for long tokens and whitespace.
PROMPT_CHARS_PER_TOKEN = 32


class DeprecatedAlias(argparse.Action):
    """A flag's old spelling (``--draft-length`` for ``--max-draft-length``): stores into the new
    flag's ``dest`` with a FutureWarning; the new flag, when given too, wins in either order."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        used = getattr(namespace, self.dest) is None        # the new flag has not set it (None: its default)
        warnings.warn(f"{option_string} is deprecated: use {self.new}"
                      + ("" if used else f" ({self.new} was given too and is used)"), FutureWarning, stacklevel=2)
        if used:
            setattr(namespace, self.dest, values)


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_prompt_chars: int | None = None      # None: max_model_len * PROMPT_CHARS_PER_TOKEN
    max_tags: int = MAX_TAGS
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections_per_client: int | None = None    # None: connections.default_per_client(max_connections)
    # chat messages: special-token strings in content/name are plain text unless this is True
    allow_special_tokens_in_content: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r:.40}")

        positive_int("max_body_bytes", 1024)
        positive_int("max_connections", 1)
        positive_int("max_tags", 1)
        if self.max_prompt_chars is not None:
            positive_int("max_prompt_chars", 1)
        if self.max_connections_per_client is None:
            from specrt.server.connections import default_per_client

            self.max_connections_per_client = default_per_client(self.max_connections)
        positive_int("max_connections_per_client", 1)
        for name, lo in (("body_timeout_s", 1e-3), ("drain_timeout_s", 0.0), ("header_timeout_s", 1e-3),
                         ("keep_alive_timeout_s", 1e-3)):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not lo <= t < float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= {lo:g}, got {t!r:.40}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.allow_special_tokens_in_content, bool):
            raise ValueError("allow_special_tokens_in_content must be a boolean")


parse_memory = parse_memory_size  # one parser for the serve flag and SpecConfig(kv_cache_memory=)


def read_prompts_file(path: str, limit: int = 1024) -> list[str]:
    """Typical prompts for warm-up: a text file with one prompt per line, or JSON lines (a
    string, or an object with a "prompt" string, per line). Blank lines are skipped; at most
    ``limit`` prompts. ValueError (naming the file and line) for anything else."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--warmup-prompts: no such file {path}")
    jsonl = p.suffix in (".jsonl", ".json")
    prompts = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--warmup-prompts {path}:{i}: not JSON ({e.msg})") from None
            item = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(item, str) or not item:
                raise ValueError(f"--warmup-prompts {path}:{i}: expected a non-empty string or "
                                 '{"prompt": "..."}')
            line = item
        prompts.append(line)
        if len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"--warmup-prompts {path}: no prompts in the file")
    return prompts
