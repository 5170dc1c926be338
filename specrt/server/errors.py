"""OpenAI-style errors: every client error is a 4xx with {"error": {message, type, param, code}}."""
from __future__ import annotations

import json


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client disconnected before its request was read: nobody is left to answer."""


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 for the request's fault."""
    return APIError(400, message, "invalid_request_error", param, code)


def server_error(message: str, code: str = "engine_error", status: int = 500) -> APIError:
    return APIError(status, message, "server_error", None, code)


def type_name(x) -> str:
    """JSON's name for a Python value's type."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(x), type(x).__name__)


def show(x, limit: int = 40) -> str:
    """A value as JSON, cut to `limit` characters (huge numbers and strings stay readable)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 100:
        return f"an integer of {len(str(abs(x))) if x.bit_length() < 10000 else 'many'} digits"
    try:
        text = json.dumps(x, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."
