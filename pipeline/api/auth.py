"""API keys: `Authorization: Bearer <key>` on every endpoint; each key owns what it creates.

AuthMiddleware checks the header of every request before the app reads a byte of its body: a wrong
key gets its 401 (with `Connection: close`) while an upload is still on its way, and the body is
never read, parsed or spooled. Routes get the owner from the request's state (require_owner).

An owner id is a hash of the key (the key itself is never stored), so a key sees and cancels only its
own files and batches, and objects survive a restart as long as the key is configured again. With no
key configured every request is the one owner "local", and only loopback clients are served, unless
the operator passed --insecure-no-auth.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.api.config import normalize_keys
from pipeline.api.errors import APIError, error_response

LOCAL_OWNER = "local"


def owner_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class KeyRing:
    def __init__(self, keys: list[str], *, insecure_no_auth: bool = False):
        keys = normalize_keys(keys)  # as ServeConfig has them; ValueError for a blank key
        self._digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]
        self._owners = [owner_id(k) for k in keys]
        self.insecure_no_auth = insecure_no_auth

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def owner_for(self, key: str) -> str | None:
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        found = None
        for d, owner in zip(self._digests, self._owners):
            if hmac.compare_digest(d, digest):  # every key compared: the time says nothing about which matched
                found = owner
        return found

    def authenticate(self, authorization: str | None, client_host: str | None) -> str:
        """The owner id for a request, or APIError 401/403."""
        if not self.enabled:
            if not self.insecure_no_auth and not is_loopback(client_host):
                raise APIError(403, "this server has no API key configured and serves only loopback clients "
                                    "(start it with --api-key, or --insecure-no-auth)", code="forbidden")
            return LOCAL_OWNER
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        owner = self.owner_for(key.strip())
        if owner is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return owner


def closing(err: APIError) -> APIError:
    """The same error, answered with `Connection: close`: the server reads nothing more of the request
    (a body the client is still sending is dropped with the connection, not read)."""
    return APIError(err.status_code, err.message, param=err.param, code=err.code, type=err.type,
                    headers={**(err.headers or {}), "Connection": "close"})


class AuthMiddleware:
    """Authenticates every HTTP request from its headers alone, before any of its body is read (FastAPI
    reads and parses a body, multipart uploads included, before it resolves a route's dependencies)."""

    def __init__(self, app: ASGIApp, keyring: KeyRing):
        self.app = app
        self.keyring = keyring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        try:
            owner = self.keyring.authenticate(Headers(scope=scope).get("authorization"), client[0] if client else None)
        except APIError as e:
            await error_response(closing(e))(scope, receive, send)
            return
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)


async def require_owner(request: Request) -> str:
    """FastAPI dependency on every route: the caller's owner id (AuthMiddleware found it; without the
    middleware, it is found here)."""
    owner = getattr(request.state, "owner", None)
    if owner is None:
        ring: KeyRing = request.app.state.keyring
        client = request.client.host if request.client else None
        owner = ring.authenticate(request.headers.get("authorization"), client)
        request.state.owner = owner
    return owner
