"""OpenAI-compatible HTTP server: `specrt serve`.

    specrt serve --target-model builtin --draft-model builtin --speculative-decoding --max-draft-length 5

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text 0.0.4),
GET /openapi.json (the request schemas); HEAD on /health, /metrics and /v1/models.

Modules: app (the factory), routes (the endpoints), schemas (pydantic request models),
parse + prompts (body -> ParsedRequest with token ids, on a small pool of daemon threads),
runner (the one thread that steps the engine), responses (JSON and server-sent events),
logprobs (their OpenAI shapes), middleware (API key, request cap, counters), connections
(header timeout, connection caps per server and per client, under uvicorn), serve (the
command line).

OpenAI sampling fields: temperature, top_p, max_tokens, stop, seed, presence_penalty,
frequency_penalty, logit_bias, logprobs (completions: an integer; chat: true with
top_logprobs), echo (completions; with max_tokens 0 it only scores the prompt). `suffix`,
`best_of` > 1, `n` > 1 and tools are refused with a 400 (see specrt.sampling.controls for what each
control and the log-probabilities mean). As in OpenAI and vLLM, a prompt plus an explicit
`max_tokens` (or `max_completion_tokens`) beyond the model's context is a 400 naming the field
and both numbers (without one, generation runs to the context, or 16 tokens on completions);
`stream_options` without `"stream": true` is a 400.

Chat messages: a special-token string in a message ("<|im_end|>", "<|im_start|>system") is
tokenized as plain text, not as the control token, so a client cannot forge a turn
(`specrt serve --allow-special-tokens-in-content` restores the old behaviour). A completions
prompt is tokenized as given.

Extensions to the OpenAI schema (all optional):
- request: `top_k`, `min_p`, `repetition_penalty`, `allowed_token_ids`, `bad_words` (at most
  4096 words of at most 1024 characters and 64 tokens each, 65536 characters in all; beyond
  them a 400 naming `bad_words`), `min_tokens`, `ignore_eos` (vLLM-style, top level) and a `specrt` object
  `{"tag": str, "return_token_ids": bool}`; the tag may also come from the
  `X-Specrt-Tag` header. Tags label the Prometheus metrics (`tag="..."`).
- response: `"specrt": {...}` with the request's speculative statistics (steps,
  drafted/accepted tokens, acceptance per position, tokens per target forward, ...).
"""
from __future__ import annotations

from specrt.server.serve import build_parser, engine_kwargs, main   # no fastapi needed to parse arguments

_LAZY = {"create_app": "specrt.server.app", "APIError": "specrt.server.errors",
         "EngineRunner": "specrt.server.runner", "ServerSettings": "specrt.server.settings"}


def __getattr__(name: str):
    # Lazy: `specrt serve` without fastapi installed gets an install hint, not an ImportError
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specrt.server' has no attribute {name!r}")


__all__ = ["build_parser", "engine_kwargs", "main", *_LAZY]
