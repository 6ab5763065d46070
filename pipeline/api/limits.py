"""Request body size limit: 413 in OpenAI's error shape, before or while the body is read; and the
per-key limit on requests in flight: 429.

A body whose Content-Length is over the limit is refused before any of it is read; a body without
one (chunked) is counted as it arrives and refused when the count passes the limit. File uploads
get their own, larger limit (the file size limit plus the multipart envelope).

Requests in flight are counted per owner (the key AuthMiddleware found) in this server process, from
the headers to the end of the response (a stream counts until its last event); one over the limit is
answered 429 at once, its body unread.
"""
from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.api.errors import APIError, error_response


def too_many_in_flight(count: int, limit: int) -> APIError:
    return APIError(429, f"this API key has {count} requests in flight, the limit is {limit}: wait for one to end",
                    code="rate_limit_exceeded", headers={"Retry-After": "1", "Connection": "close"})


def too_many(what: str) -> APIError:
    """429 for a per-key limit on what a key holds at once (batches, their lines)."""
    return APIError(429, f"{what}: wait for some of this key's batches to end, or cancel some",
                    code="rate_limit_exceeded")


class InFlightLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit
        self.counts: dict[str, int] = {}  # owner -> requests in flight (the event loop's: no lock needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = scope.get("state", {}).get("owner") if scope["type"] == "http" else None
        if owner is None:
            await self.app(scope, receive, send)
            return
        count = self.counts.get(owner, 0)
        if count >= self.limit:
            await error_response(too_many_in_flight(count, self.limit))(scope, receive, send)
            return
        self.counts[owner] = count + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.counts[owner] - 1
            if left:
                self.counts[owner] = left
            else:
                del self.counts[owner]


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
