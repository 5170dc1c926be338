"""Pure ASGI middleware (keeps streaming and disconnect semantics intact): the API key check,
the cap on concurrent requests, and the per-path/status counter behind /metrics."""
from __future__ import annotations

import hmac
import logging

from specrt.server.errors import APIError

logger = logging.getLogger("specrt.server")
COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
UNCAPPED_PATHS = ("/health", "/metrics")      # cheap, and what an operator looks at under load


def _authorized(scope, api_key: str) -> bool:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    given = headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
    # constant-time compare (hmac.compare_digest on bytes of any length)
    return hmac.compare_digest(token.encode("latin-1"), api_key.encode("utf-8"))


class GateAndCount:
    def __init__(self, app, state, error_response):
        self.app = app
        self.state = state
        self.error_response = error_response      # APIError -> Response

    def _count(self, path: str, status: int) -> None:
        key = (path if path in COUNTED_PATHS else "other", status)
        self.state.http_requests[key] = self.state.http_requests.get(key, 0) + 1

    async def _refuse(self, path: str, err: APIError, scope, receive, send, headers=None) -> None:
        self._count(path, err.status)
        await self.error_response(err, headers)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope.get("path", "")
        if state.api_key is not None and path != "/health" and not _authorized(scope, state.api_key):
            err = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")
            return await self._refuse(path, err, scope, receive, send, {"WWW-Authenticate": "Bearer"})
        capped = path not in UNCAPPED_PATHS
        if capped and state.active_requests >= state.settings.max_connections:
            err = APIError(503, f"the server is at its limit of {state.settings.max_connections} concurrent "
                           "requests; retry shortly", "server_error", None, "server_overloaded")
            return await self._refuse(path, err, scope, receive, send, {"Retry-After": "1"})

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self._count(path, message["status"])
            await send(message)

        state.active_requests += capped
        try:
            return await self.app(scope, receive, counting_send)
        finally:
            state.active_requests -= capped
