"""OpenAI-style errors: every failure is a JSON body {"error": {"message", "type", "param", "code"}}.

Each refusal also has a reason, the label it is counted under in redline_rejections_total
(server/metrics.py): "queue_full", "too_long", "bad_field", ... by default the status's (REASONS).
"""

from __future__ import annotations

REASONS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "bad_method",
           408: "read_timeout", 413: "too_large", 415: "not_json", 429: "queue_full", 500: "internal",
           503: "unavailable"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None,
                 reason: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}
        self.reason = reason or REASONS.get(status, str(status))

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return {"error": error}


def invalid(param: str, message: str, reason: str = "bad_field") -> APIError:
    return APIError(400, f"{param}: {message}", param, reason=reason)


def internal(request_id: str, what: str = "internal server error") -> APIError:
    """A 500 that says what failed in a user's terms and names the request: the exception (which may
    name files, ports and the build) goes only to the server's log, under the same id."""
    message = f"{what} (request id {request_id}; the server's log has the details)"
    return APIError(500, message, kind="server_error")
