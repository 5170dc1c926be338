"""Server settings (one typed record) and their defaults."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0     # a client must send its whole request body within this time
DEFAULT_MAX_CONNECTIONS = 512     # concurrent requests (health and metrics are never refused)
DEFAULT_DRAIN_TIMEOUT_S = 30.0    # on SIGTERM, in-flight requests get this long to finish
MAX_TAGS = 64                     # distinct Prometheus tag values; later new tags become "other"
# Prompts are bounded in characters before they are tokenized: max_model_len tokens of real
# text average ~4 characters each; 32 per token leaves room for long tokens and whitespace.
PROMPT_CHARS_PER_TOKEN = 32


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
        for name, lo in (("body_timeout_s", 1e-3), ("drain_timeout_s", 0.0)):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not lo <= t < float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= {lo:g}, got {t!r:.40}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
