"""Errors as HTTP answers: every error the server returns is JSON in OpenAI's shape,

    {"error": {"message": "...", "type": "...", "param": "<field or null>", "code": <status>}}

`APIError` carries one through the handlers; the app's exception handlers (slora.server.app)
turn it, FastAPI's validation errors and anything unexpected into that body.
"""

from __future__ import annotations

import json

# HTTP status -> the error type OpenAI's API reports for it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answer: HTTP `status`, a message naming the thing and the reason, the request
    field at fault (`param`) and extra headers (Retry-After on 503)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": status}}


def sse_error(error: APIError) -> str:
    """An error inside a stream that has started (its HTTP status already sent): one
    server-sent event with the error body; `error_type` lets LoRAX clients classify it."""
    return f"data: {json.dumps({**error.body(), 'error_type': 'generation'})}\n\n"
