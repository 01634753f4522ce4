"""The API key check the engine's server and the router share (torch-free: the router imports it).

A request carries `Authorization: Bearer <key>`; the key is compared in time independent of where
it differs. Each server chooses which paths need no key (/health always, so load balancers can
probe without it).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.entrypoints.openai.errors import APIError


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def check_api_key(scope: Scope, api_key: str) -> APIError | None:
    """None if the request carries the key, else the 401 to answer."""
    authorization = header(scope, b"authorization")
    if authorization is None:
        return APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                        code="invalid_api_key")
    scheme, _, token = authorization.partition(" ")
    # compare_digest takes time independent of where the strings differ.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("latin-1"), api_key.encode("utf-8")):
        return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return None


class ApiKeyGate:
    """ASGI middleware: 401 for an HTTP request to any path but `open_paths` without the key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app, self.api_key, self.open_paths = app, api_key, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            error = check_api_key(scope, self.api_key)
            if error is not None:
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
