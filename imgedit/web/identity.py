"""Who owns a job or a stored result: a browser, a signed-in user, or an API token.

Browsers get a random `imgedit_browser` cookie (HttpOnly, set by `BrowserCookie` on the first
response), so history is per browser without a login; with GRADIO_AUTH it is per user instead.
REST callers are told apart by their key: with API_KEYS each named key is its own owner
(`key:<name>`), except that a key named as a GRADIO_AUTH user is that user (one person, one History:
the page shows what their scripts made); with the one shared API_KEY every holder is one owner; with
neither, any bearer token is accepted and names its owner (no token at all: the shared anonymous
owner). Owners are hashed (or named) before they are stored, so the database never holds a cookie or
a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import sqlite3
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from imgedit.config.settings import Settings
from imgedit.web.api.errors import ApiError

log = logging.getLogger(__name__)

COOKIE = "imgedit_browser"
_VALID = re.compile(r"[A-Za-z0-9_-]{32}")
_MAX_AGE = 400 * 24 * 3600  # the longest browsers keep a cookie


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _cookie(header: str | None) -> str | None:
    if not header:
        return None
    try:
        jar = SimpleCookie(header)
    except Exception:  # a malformed Cookie header from some other app on the host
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None and _VALID.fullmatch(morsel.value) else None


def user_owner(name: str) -> str:
    """A GRADIO_AUTH user's owner, and that of a key of API_KEYS named as the user."""
    return "user:" + _digest(name)


def login_keys(settings: Settings) -> tuple[str, ...]:
    """The names of API_KEYS that are also GRADIO_AUTH users: their holders own as those users."""
    users = {user for user, _ in settings.gradio_auth}
    return tuple(name for name, _ in settings.api_keys if name in users)


def page_owner(request, auth_enabled: bool) -> str | None:
    """The owner of a page (or gradio API) call: the user with GRADIO_AUTH, else the browser cookie.
    None when neither is known (a client that drops cookies): such calls keep no history."""
    if request is None:
        return None
    username = getattr(request, "username", None)
    if auth_enabled and username:
        return user_owner(username)
    value = _cookie(request.headers.get("cookie"))
    return "browser:" + _digest(value) if value else None


def bearer_token(authorization: str) -> str:
    """The key an Authorization header's value carries ("Bearer <key>"); "" for none or another scheme. The
    REST routes' check and the connection guard's (imgedit.web.connections) read keys alike."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def bearer(request) -> str:
    return bearer_token(request.headers.get("authorization", ""))


def rest_owner(request, api_key: str | None = None, api_keys: tuple[tuple[str, str], ...] = (),
               users: tuple[str, ...] = ()) -> str | None:
    """The owner of a REST call, or None when it may not be served (keys are set and it has none of
    them). Every configured key is compared, in constant time, whichever matches. `users`: the names of
    API_KEYS that own as the GRADIO_AUTH user of that name (login_keys)."""
    token = bearer(request).encode()
    named = [name for name, key in api_keys if hmac.compare_digest(token, key.encode())]
    if named:
        return user_owner(named[0]) if named[0] in users else "key:" + named[0]
    if api_key:
        return "token:" + _digest(token.decode()) if hmac.compare_digest(token, api_key.encode()) else None
    return None if api_keys else "token:" + _digest(token.decode())


UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer <key>)"


def merge_login_keys(settings: Settings, *stores) -> None:
    """What an older version stored under a key now owned by its user (`key:<name>`, login_keys) moves to
    that user, so that neither the page nor the key loses it. Each store has `merge_owner(old, new)`."""
    for name in login_keys(settings):
        log.info("API_KEYS' key %r and GRADIO_AUTH's login %r are one owner: one History, one set of jobs "
                 "(name them apart to keep them apart)", name, name)
        for store in stores:
            try:
                moved = store.merge_owner("key:" + name, user_owner(name))
            except sqlite3.Error as exc:  # e.g. another server holding the database: served as they are
                log.warning("could not move the %s stored under key %r to its login: %s",
                            store.rows, name, exc)
                continue
            if moved:
                log.info("%d stored %s of key %r now belong to the login %r", moved, store.rows, name, name)


def key_holder(settings: Settings) -> Callable[[Request], Awaitable[str]]:
    """The REST routes' key check, as a FastAPI dependency (`Depends(key_holder(settings))`): the caller's
    owner, or a 401 in OpenAI's shape when keys are set (API_KEY, API_KEYS) and it sent none of them."""
    api_key, api_keys, users = settings.api_key, settings.api_keys, login_keys(settings)

    # declared for the OpenAPI schema (/docs: its Authorize button); the header is read by rest_owner
    scheme = HTTPBearer(auto_error=False,
                        description="API_KEY, or your key of API_KEYS (any text when unset)")

    async def owner(request: Request, _: HTTPAuthorizationCredentials | None = Security(scheme)) -> str:
        if (found := rest_owner(request, api_key, api_keys, users)) is None:
            raise ApiError(401, UNAUTHORIZED, "invalid_api_key")
        return found

    return owner


class BrowserCookie:
    """ASGI middleware: give every browser a random id cookie on its first response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if _cookie(headers.get(b"cookie", b"").decode("latin-1")):
            return await self.app(scope, receive, send)
        value = secrets.token_urlsafe(24)  # 32 characters
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{COOKIE}={value}; Path=/; Max-Age={_MAX_AGE}; HttpOnly; SameSite=Lax{secure}"

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_cookie)
