"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.metrics import REJECTIONS

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 408: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An answer in OpenAI's error shape. `reason`: why a 429 refused the request, as the
    `pdserve_rejections_total{reason}` label (not sent to the client)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.reason = reason


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    if exc.status == 429:
        REJECTIONS.labels(exc.reason or "other").inc()
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        msg, param = "request body is not valid JSON", None
    return JSONResponse(error_body(400, f"{param}: {msg}" if param else msg, param), 400)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)
