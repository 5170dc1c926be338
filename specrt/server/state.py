"""What the app shares between requests: the engine and its runner, settings, tags, counters,
the tokenizer pool and the draining flag."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from specrt.server.parse import TagSet
from specrt.server.runner import EngineRunner
from specrt.server.settings import PROMPT_CHARS_PER_TOKEN, ServerSettings

TOKENIZER_THREADS = 2


class ServerState:
    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.model_name = settings.model_name
        self.api_key = settings.api_key
        self.max_body_bytes = settings.max_body_bytes
        self.max_prompt_chars = settings.max_prompt_chars or engine.max_model_len * PROMPT_CHARS_PER_TOKEN
        self.tags = TagSet(settings.max_tags)
        self.created = int(time.time())
        self.num_kv_blocks = engine.num_free_blocks()      # idle now: every block is free
        self.http_requests: dict[tuple[str, int], int] = {}    # (path, status) -> count; event loop only
        self.active_requests = 0                           # capped by settings.max_connections; event loop only
        self.draining = False
        # parsing + tokenizing: off the event loop (and off the step thread)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="specrt-tokenize")
        self.runner = EngineRunner(engine)

    def begin_drain(self, timeout_s: float) -> None:
        """Stop admitting (new requests get 503) and give in-flight ones `timeout_s` to finish.
        Safe from a signal handler: it only sets a flag and enqueues a command."""
        if not self.draining:
            self.draining = True
            self.runner.drain(timeout_s)

    def close(self) -> None:
        self.runner.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
