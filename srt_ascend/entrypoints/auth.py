"""API keys (`--api-key`, `--admin-api-key`) with SGLang's rules, as an ASGI middleware.

- `/health*`, `/ready` and `/metrics` are always open, as in SGLang (Kubernetes probes and
  Prometheus scrapers carry no secrets; none of them returns one).
- Admin endpoints (`ADMIN_PATHS`, SGLang's ADMIN_OPTIONAL level): with an admin key they need
  it (the API key does not open them); else the API key when one is set; else open.
- Routes with an admin operation chosen by their body (`MIXED_PATHS`: /abort_request's
  `abort_all`) let either key through; the route asks `admin_allowed` before an admin
  operation (the ADMIN_PATHS rule), so with an admin key only it may abort every request,
  while an abort by rid stays a user operation.
- Every other endpoint needs `Authorization: Bearer <api key>` when an API key is set.
A refused request gets HTTP 401 with the route's error shape. The middleware is plain ASGI
(not BaseHTTPMiddleware) so client disconnects still reach the routes.
"""

from __future__ import annotations

import secrets

from srt_ascend.entrypoints.http_utils import route_error_response

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_PATHS = frozenset({"/flush_cache"})
MIXED_PATHS = frozenset({"/abort_request"})
UNAUTHORIZED = "missing or wrong API key: send the header Authorization: Bearer <key>"


def _bearer_matches(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), key)


def is_authorized(
    path: str, method: str, authorization: str | None, api_key: str | None, admin_key: str | None
) -> bool:
    """The decision alone (pure, unit-tested)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_PATHS:
        return admin_allowed(authorization, api_key, admin_key)
    if path in MIXED_PATHS and admin_key and _bearer_matches(authorization, admin_key):
        return True  # the route checks which operation the admin key may run
    if api_key:
        return _bearer_matches(authorization, api_key)
    return True


def admin_allowed(authorization: str | None, api_key: str | None, admin_key: str | None) -> bool:
    """Whether an admin operation may run (SGLang's ADMIN_OPTIONAL level): with an admin key
    only it opens them; else the API key when one is set; else they are open."""
    if admin_key:
        return _bearer_matches(authorization, admin_key)
    if api_key:
        return _bearer_matches(authorization, api_key)
    return True


def unauthorized_response(path: str):
    """HTTP 401 in the route's error shape, asking for a bearer token."""
    response = route_error_response(path, UNAUTHORIZED, 401)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        if is_authorized(path, scope["method"], authorization, self.api_key, self.admin_api_key):
            await self.app(scope, receive, send)
            return
        await unauthorized_response(path)(scope, receive, send)
