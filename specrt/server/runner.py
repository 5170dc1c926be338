"""The engine runner: the one thread that touches the engine.

HTTP handlers (on the asyncio event loop) never call into the engine; they put commands
("add", "abort", ...) on a thread-safe queue and await a per-request asyncio.Queue that the
step thread feeds with `loop.call_soon_threadsafe`. A slow or vanished client therefore
never stalls decoding: the step thread never waits on a client, it only enqueues. A client
that disconnects sends "abort", which finishes its request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger("specrt.server")


@dataclass
class Admitted:
    """First item on a request's queue once the engine accepted it."""
    request_id: str


@dataclass
class Refused:
    """First item on a request's queue when add_request raised ValueError (the request's fault)."""
    message: str


@dataclass
class Failed:
    """The request cannot go on for a server-side reason (a failed step, shutdown)."""
    message: str
    status: int = 500
    code: str = "engine_error"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Cmd:
    kind: str                        # "add" | "abort" | "sync" | "drain" | "stop"
    request_id: str | None = None
    args: tuple = ()
    stream: _Stream | None = None
    done: threading.Event | None = field(default=None, repr=False)


SHUTTING_DOWN = "the server is shutting down"


class EngineRunner:
    """Owns the engine and the single thread that steps it."""

    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}     # step thread only
        self._must_step = False                    # an abort left a finished request to drain
        self._drain_deadline: float | None = None  # set by drain(): refuse adds, fail what is left then
        self.num_in_flight = 0                     # read by /health, /metrics (int: atomic under the GIL)
        self.steps = 0
        self.failures = 0
        self._failed_in_a_row = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="specrt-engine-step", daemon=True)
        self._thread.start()

    # -- called from the event loop (never blocks on the engine)
    def submit(self, request_id: str, prompt_ids: list[int], params, tag: str,
               tenant: str | None = None) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(_Cmd("add", request_id, (prompt_ids, params, tag, tenant), _Stream(loop, q)))
        return q

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Cmd("abort", request_id))

    def drain(self, timeout_s: float) -> None:
        """Stop admitting; requests still running after `timeout_s` fail with a final event.
        Safe from a signal handler (SimpleQueue.put is reentrant)."""
        self._cmds.put(_Cmd("drain", args=(time.monotonic() + max(0.0, timeout_s),)))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._cmds.put(_Cmd("stop"))
            self._thread.join(timeout)

    def sync(self, timeout: float = 10.0) -> bool:
        """Block (not from the event loop) until every command queued so far was handled."""
        ev = threading.Event()
        self._cmds.put(_Cmd("sync", done=ev))
        return ev.wait(timeout)

    # -- the step thread
    @staticmethod
    def _deliver(s: _Stream, item) -> None:
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:          # that client's event loop is closed: nobody is listening
            pass

    def _forget(self, request_id: str) -> _Stream | None:
        """Drop a request's stream; the gauge changes BEFORE its last item is delivered, so a
        client that has its answer never sees itself still in flight."""
        s = self._streams.pop(request_id, None)
        self.num_in_flight = len(self._streams)
        return s

    def _add(self, cmd: _Cmd) -> None:
        prompt_ids, params, tag, tenant = cmd.args
        if self._drain_deadline is not None:
            self._deliver(cmd.stream, Failed(SHUTTING_DOWN, 503, "server_shutting_down"))
            return
        try:
            self.engine.add_request(prompt_ids, params, request_id=cmd.request_id, tag=tag, tenant=tenant)
        except ValueError as e:
            self._deliver(cmd.stream, Refused(str(e)))
        except Exception as e:    # not the request's fault: a 500 for it, the server goes on
            logger.exception("add_request failed")
            self._deliver(cmd.stream, Failed(f"could not queue the request: {type(e).__name__}: {e}"))
        else:
            self._streams[cmd.request_id] = cmd.stream
            self.num_in_flight = len(self._streams)
            self._deliver(cmd.stream, Admitted(cmd.request_id))

    def _handle(self, cmd: _Cmd) -> bool:
        if cmd.kind == "stop":
            return False
        if cmd.kind == "sync":
            cmd.done.set()
        elif cmd.kind == "add":
            self._add(cmd)
        elif cmd.kind == "abort":
            if self._forget(cmd.request_id) is not None:
                try:
                    self.engine.abort_request(cmd.request_id)
                except Exception:
                    logger.exception("abort_request failed")
                self._must_step = True
        elif cmd.kind == "drain":
            self._drain_deadline = cmd.args[0]
            logger.info("draining: %d request(s) in flight get %.1f s to finish; new requests get 503",
                        len(self._streams), max(0.0, self._drain_deadline - time.monotonic()))
        return True

    def _busy(self) -> bool:
        return self._must_step or self.engine.has_unfinished()

    def _next_commands(self) -> list[_Cmd]:
        cmds = []
        try:
            if self._busy():
                cmds.append(self._cmds.get_nowait())
            elif self._drain_deadline is not None:
                cmds.append(self._cmds.get(timeout=0.05))     # wake up to check the deadline
            else:
                cmds.append(self._cmds.get())
            while True:
                cmds.append(self._cmds.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _run(self) -> None:
        while True:
            for cmd in self._next_commands():
                if not self._handle(cmd):
                    self._fail_all(SHUTTING_DOWN, 503, "server_shutting_down")
                    return
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline and self._streams:
                self._fail_all(SHUTTING_DOWN, 503, "server_shutting_down")
            if self._busy():
                self._step()

    def _step(self) -> None:
        self._must_step = False
        try:
            outs = self.engine.step()
            self.steps += 1
        except Exception as e:    # a bug in a step must not take the server down
            logger.exception("engine step failed")
            self.failures += 1
            self._failed_in_a_row += 1
            self.last_error = f"{type(e).__name__}: {e}"
            self._fail_all(f"the engine failed: {self.last_error}")
            self._must_step = False
            time.sleep(min(1.0, 0.01 * 2 ** min(self._failed_in_a_row, 7)))   # no hot loop on a broken engine
            return
        self._failed_in_a_row = 0
        for out in outs:
            s = self._forget(out.request_id) if out.finished else self._streams.get(out.request_id)
            if s is not None:
                self._deliver(s, out)

    def _fail_all(self, message: str, status: int = 500, code: str = "engine_error") -> None:
        """Abort every request in flight and give each a Failed as its last item."""
        for rid in list(self._streams):
            s = self._forget(rid)
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort_request failed")
            self._deliver(s, Failed(message, status, code))
        self._must_step = True         # the next step releases the aborted requests
