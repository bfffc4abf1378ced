"""What ``rallyrl serve`` and the agent gateway check before a route runs: who may reach them and how
much they may send (docs/reliability.md, "Threat model").

A server bound to loopback is reachable by every program of the machine, and by every web page its
browser opens: a page cannot read the answers, but it can send simple requests (``text/plain``, form
bodies) and, through DNS rebinding, name the server under a hostname of its own. So, in order:

1. **Host**: bound to loopback, only loopback ``Host`` values (``localhost``, ``127.0.0.1``, ``[::1]``)
   are served (403), which defeats DNS rebinding.
2. **Cross-site**: a request whose ``Origin`` is not the server itself, or that a browser marks
   ``Sec-Fetch-Site: cross-site``/``same-site``, is refused (403); programs send neither header.
3. **Key**: with an API key, ``Authorization: Bearer KEY`` compared in constant time (401), except on
   the open paths (health probes).
4. **Body**: a body that is not JSON (415, or the server's own status: the three content types a page
   may send without asking), or whose ``Content-Length`` is over the route's limit, is refused before a byte
   is read (413);
   a body sent without a length is cut off at the limit as it is read (``read_limited``).

Methods are the routes' own: aiohttp answers 405 to any other (``OPTIONS`` and ``TRACE`` included).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

Reply = Callable[[web.Request, int, str, str], web.StreamResponse]
"""Writes an error in the server's own shape: (request, status, message, code)."""

STATE_CHANGING_GETS = frozenset({"/flush_cache"})
"""GET routes that change state (SGLang serves ``/flush_cache`` on GET): checked like a POST."""
JSON_TYPES = ("application/json",)


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine's loopback.
    (Cached: it is asked for every request, and parsing the address was 15 % of opening a gateway session.)"""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The host of a ``Host`` header value, without its port."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


@dataclass(frozen=True)
class HttpGuard:
    """The checks of one server (module docstring); ``middleware`` runs them before every route."""

    bound_host: str
    reply: Reply
    api_key: str | None = None
    open_paths: frozenset[str] = frozenset()
    max_body_bytes: int = 16 * 2**20
    body_limits: Mapping[str, int] = field(default_factory=dict)
    """Routes allowed a larger body than ``max_body_bytes`` (weights sent as tensors)."""
    body_limit_hint: str = "limits.max_body_mb"
    max_json_items: int | None = None
    """Most JSON values a body may hold, counted before it is parsed (``count_json_items``); None: any."""
    json_items_hint: str = "limits.max_json_items"
    not_json_status: int = 415
    """The status of a body that is not JSON (``rallyrl serve`` answers 400, as SGLang's ``/v1`` routes do)."""

    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.bound_host)

    def body_limit(self, path: str) -> int:
        return self.body_limits.get(path, self.max_body_bytes)

    def refusal(self, request: web.Request) -> tuple[int, str, str] | None:
        """(status, message, code) of the first check ``request`` fails, or None (also for a path or
        method no route serves: the router answers those, 404 or 405)."""
        if request.match_info.http_exception is not None:
            return None
        host = request.headers.get("Host")
        if self.loopback_only and host is not None and not is_loopback(host_name(host)):
            return (403, f"Host {host!r}: this server is bound to loopback and answers only loopback host names "
                         "(localhost, 127.0.0.1, [::1])", "host_not_allowed")  # fmt: skip
        open_path = request.path in self.open_paths
        if not open_path:
            if (origin := request.headers.get("Origin")) is not None and not _same_origin(origin, host):
                return 403, f"Origin {origin!r}: cross-origin requests are refused", "cross_origin"
            site = request.headers.get("Sec-Fetch-Site", "").lower()
            if site in ("cross-site", "same-site"):
                return 403, f"Sec-Fetch-Site {site}: requests from other sites are refused", "cross_origin"
        if self.api_key and not open_path:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return 401, "missing or wrong API key (Authorization: Bearer ...)", "unauthorized"
        if request.method in ("POST", "PUT", "PATCH") and request.body_exists:
            kind = request.content_type
            if "Content-Type" in request.headers and kind not in JSON_TYPES and not kind.endswith("+json"):
                return self.not_json_status, f"Content-Type {kind!r}: send the body as application/json", "not_json"
            limit = self.body_limit(request.path)
            if request.content_length is not None and request.content_length > limit:
                return (413, f"the body of {request.content_length} bytes is over this server's limit of {limit} "
                             f"bytes ({self.body_limit_hint})", "body_too_large")  # fmt: skip
        return None

    def middleware(self) -> Any:
        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            refused = self.refusal(request)
            if refused is not None:
                response = self.reply(request, *refused)
                if request.body_exists:  # unread: the connection cannot carry another request
                    response.force_close()
                return response
            return await handler(request)

        return guard

    def install(self, app: web.Application) -> None:
        """Run the checks first in ``app`` and let ``read_limited`` find this guard's limits."""
        app[GUARD_KEY] = self
        app.middlewares.insert(0, self.middleware())


GUARD_KEY = web.AppKey("guard", HttpGuard)


def _same_origin(origin: str, host: str | None) -> bool:
    if host is None:
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


def check_json_items(raw: bytes, limit: int | None, hint: str) -> None:
    """A ``BodyTooLarge`` when ``raw`` may hold more than ``limit`` JSON values: its ``,``, ``[`` and ``{``
    characters are counted (those in strings too, an upper bound), milliseconds for megabytes."""
    if limit is not None and len(raw) > limit:
        items = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if items > limit:
            raise TooManyValues(f"the body holds up to {items} JSON values (its ',', '[' and '{{' characters), over "
                               f"this server's limit of {limit} ({hint})")  # fmt: skip


class BodyTooLarge(ValueError):
    """A body sent without a ``Content-Length`` that went over the route's limit as it was read."""


class TooManyValues(BodyTooLarge):
    """A body within the byte limit that holds more JSON values than the server's ``max_json_items``."""


async def read_limited(request: web.Request, limit: int | None = None) -> bytes:
    """The body of ``request``, at most ``limit`` bytes (default: its server guard's limit for the
    route, else the application's ``client_max_size``); what was read of a longer one is let go at once."""
    if limit is None:
        guard = request.app.get(GUARD_KEY)
        limit = guard.body_limit(request.path) if guard is not None else request.app._client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"the body of {request.content_length} bytes is over this route's limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(2**20):
        size += len(chunk)
        if size > limit:
            chunks.clear()
            raise BodyTooLarge(f"the body is over this route's limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    guard = request.app.get(GUARD_KEY)
    if guard is not None:
        check_json_items(raw, guard.max_json_items, guard.json_items_hint)
    return raw
