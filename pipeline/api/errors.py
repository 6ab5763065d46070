"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, for every error the API returns."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's error type per HTTP status
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "server_error", 504: "server_error"}


class APIError(StarletteHTTPException):
    """An error response in OpenAI's shape. A Starlette HTTPException, so that one raised while the
    body is read (the size limit) passes through FastAPI's body parsing unchanged."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(status_code=status_code, detail=message, headers=headers)
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind}: {object_id!r}", param=param, code="not_found")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc, APIError):
        return error_response(exc)
    if exc.status_code in (404, 405):
        # No route for this method and path (every other 404 is an APIError): OpenAI's answer, word for word.
        return error_response(APIError(404, f"Invalid URL ({request.method} {request.url.path})"))
    code = {413: "request_too_large"}.get(exc.status_code)
    return error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(x) for x in loc if x not in ("body", "query", "path", "header", "form")]
    return ".".join(parts) or None


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    messages = []
    for e in errors:
        where = _loc_param(tuple(e.get("loc", ())))
        messages.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return error_response(APIError(400, "; ".join(messages) or "invalid request",
                                   param=_loc_param(tuple(first.get("loc", ()))), code="invalid_value"))


async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
    # What recursion a request can cause is JSON nested past what the parser recurses into (nearly 1000
    # levels); shallower nesting is refused by pipeline.batch_file.json_depth with the same words.
    from pipeline.batch_file import too_deep_message

    return error_response(APIError(400, f"We could not parse the JSON body of your request: {too_deep_message()}",
                                   code="invalid_json"))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(RecursionError, _too_deep)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
