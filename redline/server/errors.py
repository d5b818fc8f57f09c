"""OpenAI-style errors: every failure is a JSON body {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return {"error": error}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def internal(error: Exception) -> APIError:
    """A 500 for an exception nobody expected (it is logged where it is caught)."""
    return APIError(500, f"internal server error: {type(error).__name__}: {error}", kind="server_error")
