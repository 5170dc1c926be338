"""Connection-level guards for uvicorn's h11 protocol (issue 39, defect 1).

Without them, uvicorn keeps a connection that sends nothing, or only part of its request
headers, open forever, and its own ``limit_concurrency`` counts those connections: a few
hundred idle sockets made every request, /health and /metrics included, a 503.

`GuardedH11` (one subclass per server, made by `guarded_protocol`) adds:

- a header timeout: a connection must deliver a complete request head within
  ``header_timeout_s`` of opening (or of its previous response); otherwise it is closed
  (a 408 first when it had sent part of a request). The body has its own timeout in the app
  (``body_timeout_s``), the idle time between requests uvicorn's ``timeout_keep_alive``.
- a cap on open connections (``max_connections`` + CONNECTION_HEADROOM) and a cap per client
  address (``max_connections_per_client``). A connection beyond a cap closes the oldest *idle*
  connection (waiting for a request head) of that client (per-client cap) or of anyone (total
  cap); only when none is idle is the new connection refused (a 503, then closed). So idle
  sockets never lock anyone out: a new connection (a health probe) always displaces them.

uvicorn's own ``limit_concurrency`` is not used: it answers 503 to every request, health
included, once the connections (idle or not) reach it. Requests are capped by the app
(``max_connections`` concurrent requests, /health and /metrics exempt).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict

logger = logging.getLogger("specrt.server")
# open connections beyond the app's request cap: room for /health, /metrics and the 503s
CONNECTION_HEADROOM = 64
MIN_PER_CLIENT = 64


def default_per_client(max_connections: int) -> int:
    """The default per-client connection cap: half the request cap, at least MIN_PER_CLIENT."""
    return max(MIN_PER_CLIENT, max_connections // 2)


def _raw_response(status: int, reason: str, code: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body


class _Registry:
    """Open connections of one server: counts per client and the idle ones, oldest first.
    Event loop only."""

    def __init__(self, max_total: int, max_per_client: int):
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.total = 0
        self.per_client: dict[str, int] = {}
        self.idle: OrderedDict = OrderedDict()      # protocol -> None, longest idle first
        self.evicted = 0
        self.refused = 0

    def _oldest_idle(self, host: str | None):
        for p in self.idle:
            if host is None or p._specrt_host == host:
                return p
        return None

    def admit(self, p) -> bool:
        """Count a new connection, closing an idle one to make room; False: refuse it."""
        host = p._specrt_host
        if self.per_client.get(host, 0) >= self.max_per_client:
            victim = self._oldest_idle(host)
            if victim is None:
                return False
            victim._specrt_close("per-client connection limit")
        if self.total >= self.max_total:
            victim = self._oldest_idle(None)
            if victim is None:
                return False
            victim._specrt_close("connection limit")
        self.total += 1
        self.per_client[host] = self.per_client.get(host, 0) + 1
        p._specrt_counted = True
        return True

    def forget(self, p) -> None:
        self.idle.pop(p, None)
        if p._specrt_counted:
            p._specrt_counted = False
            self.total -= 1
            n = self.per_client.get(p._specrt_host, 0) - 1
            if n > 0:
                self.per_client[p._specrt_host] = n
            else:
                self.per_client.pop(p._specrt_host, None)


def guarded_protocol(header_timeout_s: float, max_total: int, max_per_client: int):
    """A subclass of uvicorn's H11Protocol with its own registry (pass it as uvicorn's ``http``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    registry = _Registry(max_total, max_per_client)

    class GuardedH11(H11Protocol):
        registry_ = registry

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._specrt_host = self.client[0] if self.client else ""
            self._specrt_counted = False
            self._specrt_timer = None
            self._specrt_partial = False
            if not registry.admit(self):
                registry.refused += 1
                if registry.refused in (1, 10, 100) or registry.refused % 1000 == 0:
                    logger.warning("%s: connection refused (%d open, %d from this client; limits %d and %d per "
                                   "client, none idle); %d refused so far", self._specrt_host, registry.total,
                                   registry.per_client.get(self._specrt_host, 0), registry.max_total,
                                   registry.max_per_client, registry.refused)
                transport.write(_raw_response(503, "Service Unavailable", "too_many_connections",
                                              "too many open connections; retry shortly", "retry-after: 1\r\n"))
                transport.close()
                return
            self._specrt_wait_for_request()

        # -- idle (waiting for a request head) <-> busy (a request is being handled)
        def _specrt_wait_for_request(self) -> None:
            self._specrt_cancel_timer()
            self._specrt_partial = False
            registry.idle[self] = None
            registry.idle.move_to_end(self)
            self._specrt_timer = self.loop.call_later(header_timeout_s, self._specrt_header_timeout)

        def _specrt_cancel_timer(self) -> None:
            if self._specrt_timer is not None:
                self._specrt_timer.cancel()
                self._specrt_timer = None

        def _specrt_busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if not self._specrt_busy():
                self._specrt_partial = True
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self._specrt_busy():            # a request head arrived: no longer idle
                self._specrt_cancel_timer()
                registry.idle.pop(self, None)

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._specrt_wait_for_request()    # before uvicorn handles a pipelined request
            super().on_response_complete()

        def _specrt_header_timeout(self) -> None:
            self._specrt_timer = None
            if self._specrt_busy() or self.transport.is_closing():
                return
            if self._specrt_partial:
                self.transport.write(_raw_response(408, "Request Timeout", "request_timeout",
                                                   f"the request head did not arrive within {header_timeout_s:g} s"))
            self._specrt_close(None)

        def _specrt_close(self, why: str | None) -> None:
            """Close an idle connection (a timeout, or to make room for a new one)."""
            registry.forget(self)
            self._specrt_cancel_timer()
            if why is not None:
                registry.evicted += 1
                if registry.evicted in (1, 10, 100) or registry.evicted % 1000 == 0:
                    logger.warning("%s: idle connection closed to make room (%s); %d so far", self._specrt_host,
                                   why, registry.evicted)
            if self.conn.our_state in (h11.IDLE, h11.DONE):
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._specrt_cancel_timer()
            registry.forget(self)
            super().connection_lost(exc)

    return GuardedH11


def uvicorn_options(settings) -> dict:
    """uvicorn.Config / uvicorn.run keyword arguments for a server with these ServerSettings."""
    protocol = guarded_protocol(settings.header_timeout_s, settings.max_connections + CONNECTION_HEADROOM,
                                settings.max_connections_per_client)
    return {"http": protocol, "timeout_keep_alive": settings.keep_alive_timeout_s, "limit_concurrency": None}
