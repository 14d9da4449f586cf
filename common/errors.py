"""The error shape of OpenAI's API. A module of its own, with no dependency beyond the standard
library: the router (kvscale.router) answers in the same shape and its image carries
none of the worker's dependencies."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
