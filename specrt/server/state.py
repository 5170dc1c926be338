"""What the app shares between requests: the engine and its runner, settings, tags, counters,
the tokenizer pool and the draining flag."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Executor, Future

from specrt.server.parse import TagSet
from specrt.server.runner import EngineRunner
from specrt.server.settings import PROMPT_CHARS_PER_TOKEN, ServerSettings

TOKENIZER_THREADS = 2


class DaemonPool(Executor):
    """A fixed pool of daemon threads (for loop.run_in_executor). Unlike ThreadPoolExecutor,
    whose threads the interpreter joins at exit, a parse still running when the server stops
    cannot hold the process up (issue 39, defect 3)."""

    def __init__(self, num_threads: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args, kwargs = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:      # noqa: BLE001 - handed to the waiting coroutine
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        fut: Future = Future()
        self._jobs.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()


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
        self.drain_started: float | None = None            # time.monotonic() of begin_drain
        self.parses: set[threading.Event] = set()          # cancel flags of the parses running; event loop only
        # parsing + tokenizing: off the event loop (and off the step thread)
        self.pool = DaemonPool(TOKENIZER_THREADS, "specrt-tokenize")
        self.runner = EngineRunner(engine)

    def begin_drain(self, timeout_s: float) -> None:
        """Stop admitting (new requests get 503) and give in-flight ones `timeout_s` to finish.
        Safe from a signal handler: it only sets flags and enqueues a command."""
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()
            self.runner.drain(timeout_s)

    def close(self) -> None:
        for cancel in list(self.parses):
            cancel.set()
        self.runner.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
