"""Helpers shared by the server tests: a live uvicorn server on a free loopback port (of the tiny pair),
SSE parsing, streamed token ids."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class LiveServer:
    """uvicorn serving `app` on a free loopback port in a daemon thread."""

    def __init__(self, app, **uvicorn_kw):
        import uvicorn

        self.port = free_port()
        self.app = app
        self.state = app.state.specrt
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **uvicorn_kw)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(15)
        self.state.runner.stop()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Every queued command handled and no request left in the engine."""
        assert self.state.runner.sync(timeout)
        deadline = time.time() + timeout
        eng = self.state.engine
        while (self.state.runner.num_in_flight or eng.has_unfinished()) and time.time() < deadline:
            time.sleep(0.02)
        assert self.state.runner.sync(timeout)
        assert not eng.has_unfinished() and self.state.runner.num_in_flight == 0


def serve_pair(pair, max_draft_length: int, max_batch_size: int = 8, spec: dict | None = None,
               **app_kw) -> LiveServer:
    """A live server of the tiny pair (draft: the pair's draft, model name "tiny", on the CPU).

    ``spec`` holds further SpecConfig fields; ``app_kw`` goes to create_app (warmup, max_body_bytes...)."""
    from specrt.config import SpecConfig
    from specrt.server import create_app

    tdir, ddir = pair
    cfg = SpecConfig(max_draft_length=max_draft_length, max_batch_size=max_batch_size, **(spec or {}))
    return LiveServer(create_app(target=str(tdir), draft=str(ddir), device="cpu", model_name="tiny", spec=cfg,
                                 **app_kw))


async def stream_token_ids(client, body: dict, drop_after: int | None = None, label: str = "request"):
    """POST a streaming /v1/completions. Returns the token ids of its chunks up to [DONE]; None when
    the connection was dropped after ``drop_after`` chunks; (status, error) when it was refused."""
    ids, chunks = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())["error"]
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return ids
            event = json.loads(data)
            assert "error" not in event, event
            ids += event["choices"][0]["token_ids"]
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return None              # leaving the block closes the connection mid-stream
    raise AssertionError(f"{label}: the stream ended without [DONE]")


def sse(lines) -> list[dict]:
    """Parse `data: ...` events; the stream must end with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        assert not done, "data after [DONE]"
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    assert done, "the stream did not end with data: [DONE]"
    return events


def post_ok(srv, path: str, **body) -> dict:
    """POST ``body`` (model "tiny") to a live server; asserts a 200 and returns the JSON answer."""
    r = srv.client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def api_of(pair, max_draft_length: int, max_batch_size: int = 8):
    """The Python API over the pair with serve_pair's settings (what a server's answers must match)."""
    from specrt import LLM, SpecConfig

    tdir, ddir = pair
    return LLM(target=str(tdir), draft=str(ddir), device="cpu",
               spec=SpecConfig(max_draft_length=max_draft_length, max_batch_size=max_batch_size))
