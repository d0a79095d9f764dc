"""`photon-serve`'s answer to "who is calling": the API key, and what stands in for it.

Owns: `Gate`, which decides per request whether the caller may use the model.
- With a key: the key (X-Moondream-Auth, or Authorization: Bearer), compared in constant
  time.  `--allow-local-without-key` lets a keyless caller through when it is on this
  machine (loopback peer) and is not a browser page (see below): Station-style clients such
  as moonlabel send no key to a local endpoint.
- Without a key (or for such a keyless local caller): only requests a browser page cannot
  forge.  A page can make the browser POST to 127.0.0.1 (a "simple" cross-origin request
  with Content-Type text/plain needs no preflight), and with DNS rebinding it can even read
  the answer; so the Host must be one of this machine's names (or --allowed-hosts), and an
  Origin header, when present, must be a local one.  JSON bodies must say
  application/json on every route (a browser cannot send that cross-origin without a
  preflight, which this server never approves).
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from starlette.requests import Request as HTTPRequest

from .inputs import ApiError

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})


def host_name(value: str) -> str:
    """A Host header or URL netloc -> its lower-case host, without port or brackets."""
    v = value.strip().lower()
    if v.startswith("["):               # [::1]:2020
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:               # name:port (a bare IPv6 has several colons)
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def is_local_name(host: str) -> bool:
    if host in LOCAL_HOSTS or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Gate:
    """The per-request caller check (module docstring).  `allowed_hosts`: extra Host names
    a keyless server answers ("*" for any: a server behind a proxy that checks callers)."""

    def __init__(self, api_key: str | None, allowed_hosts=(), allow_local_without_key=False):
        self.key = api_key or None
        self.hosts = frozenset(host_name(h) for h in allowed_hosts if h != "*")
        self.any_host = "*" in allowed_hosts
        self.local_without_key = allow_local_without_key

    def check(self, request: HTTPRequest) -> None:
        """Raise the ApiError that refuses this caller, or return."""
        got = _presented_key(request)
        if self.key is not None:
            if got is not None and hmac.compare_digest(got.encode(), self.key.encode()):
                return
            if got is None and self.local_without_key and _peer_is_loopback(request):
                self._browser_check(request)
                return
            raise ApiError(401, "missing or wrong API key: send it in the X-Moondream-Auth "
                           "header (or \"Authorization: Bearer KEY\")", "authentication_error",
                           headers={"WWW-Authenticate": "Bearer"})
        self._browser_check(request)

    def _browser_check(self, request: HTTPRequest) -> None:
        host = host_name(request.headers.get("host", ""))
        if not (self.any_host or is_local_name(host) or host in self.hosts):
            raise ApiError(403, f"Host {host!r} is not one this server answers without an "
                           "API key (this machine's names only: a web page could otherwise "
                           "reach it by DNS rebinding); start it with --api-key, or list the "
                           "name in --allowed-hosts", "permission_error")
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            o = host_name(urlsplit(origin).netloc)
            if not (is_local_name(o) or o in self.hosts):
                raise ApiError(403, f"requests from web pages of another site (Origin "
                               f"{origin[:80]!r}) are refused without an API key; call from "
                               "a program, or start the server with --api-key",
                               "permission_error")
        elif origin == "null":   # sandboxed iframes, file:// pages: a page all the same
            raise ApiError(403, "requests from web pages (Origin null) are refused without "
                           "an API key", "permission_error")


def _presented_key(request: HTTPRequest) -> str | None:
    got = request.headers.get("x-moondream-auth")
    if got is None:
        auth = request.headers.get("authorization", "")
        got = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    return got or None


def _peer_is_loopback(request: HTTPRequest) -> bool:
    client = request.client
    if client is None:
        return False
    try:
        return ipaddress.ip_address(client.host).is_loopback
    except ValueError:
        return False


def require_json(request: HTTPRequest) -> None:
    """415 unless the body is declared JSON (application/json or application/*+json)."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype == "application/json" or (ctype.startswith("application/") and
                                        ctype.endswith("+json")):
        return
    raise ApiError(415, f"Content-Type {ctype or '(none)'!r} is refused: send the JSON body "
                   "with Content-Type: application/json", "invalid_request_error")
