"""Request body size limit: 413 in OpenAI's error shape, before or while the body is read.

A body whose Content-Length is over the limit is refused before any of it is read; a body without
one (chunked) is counted as it arrives and refused when the count passes the limit. File uploads
get their own, larger limit (the file size limit plus the multipart envelope).
"""
from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.api.errors import APIError, error_response


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is over the limit of {limit:,} bytes", code="request_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit_for: Callable[[str, str], int]):
        self.app = app
        self.limit_for = limit_for  # (method, path) -> bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["method"], scope["path"])
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(too_large(limit))(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(limit)  # an HTTPException: the app's handler answers 413
            return message

        await self.app(scope, counted, send)
