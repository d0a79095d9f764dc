"""`photon-serve`'s remote image fetcher for --allow-remote-images: an http(s) `image_url`
fetched on the client's behalf without turning the server into a proxy onto its own network.

Owns: `RemoteImages` (a dedicated, bounded thread pool and `await fetch(url, limit_bytes,
deadline_s)`), `FetchError` (the one error a client sees), and the address policies
`public_only` (the default) and `private_allowed` (opt-in for intranet image servers;
dangerous, see its docstring).

What a fetch guarantees:
- Only http and https, no userinfo, a non-empty host.  The host is resolved once per hop, the
  hop is refused if ANY address it resolves to fails the policy, and the connection goes to
  that validated address (never re-resolved: DNS rebinding), with the Host header, TLS SNI and
  the certificate check on the URL's own host name.
- At most `max_redirects` redirects, followed by hand so each hop's scheme and addresses are
  checked again.
- One deadline for the whole fetch, redirects included.  Every socket wait is at most
  min(time left, a short step), so a server trickling bytes is cut off at the deadline and a
  cancelled fetch frees its thread within a step.  Name resolution (getaddrinfo) cannot be
  interrupted: it runs on the fetch's thread and counts against the deadline, and the caller
  is answered at the deadline even while a thread is still stuck in it.
- At most `limit_bytes` of body: a larger Content-Length is refused before reading, and the
  read stops at limit + 1 bytes.
- A failure reads the same to the client whatever its cause (refused address, DNS, refused
  connection, timeout, HTTP status, content type), so the error cannot map the server's
  network; only "too large" is told apart.  The cause is logged on "photon_jax.serve".
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import io
import ipaddress
import logging
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Union

log = logging.getLogger("photon_jax.serve")

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
AddressPolicy = Callable[[IPAddress], bool]
# (host, port) -> getaddrinfo-shaped rows: (family, type, proto, canonname, sockaddr).
Resolver = Callable[[str, int], list]

REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_URL_CHARS = 8192
# The answer to the caller comes this long after the deadline at the latest: the thread
# normally gives up exactly at the deadline and reports its own cause (logged); the grace
# only matters when the thread is stuck where it cannot look at the clock (getaddrinfo).
_GRACE_S = 0.25
_READ_CHUNK = 64 * 1024
_URL_SAFE = "".join(chr(c) for c in range(0x21, 0x7F))   # all printable ASCII kept as is

# Addresses that embed an IPv4 address a gateway would forward to: judged by that address too.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
# Cloud metadata services outside link-local (which both policies refuse): refused even with
# allow_private, since credentials behind them are the usual prize of a fetch-on-behalf bug.
_METADATA = (ipaddress.ip_network("fd00:ec2::254/128"),        # AWS IMDS over IPv6
             ipaddress.ip_network("100.100.100.200/32"))       # Alibaba Cloud metadata


class FetchError(Exception):
    """An image URL that could not be fetched, worded for the client.  The message names the
    input and the rule, never the cause (the cause is logged): every failure but "too large"
    (`too_large`) reads the same, so answers cannot be used to probe the server's network."""

    def __init__(self, message: str, param: str = "image_url", too_large: bool = False):
        super().__init__(message)
        self.message, self.param, self.too_large = message, param, too_large


class _Refused(Exception):
    """(Internal.)  A hop refused by this module's rules; its text goes to the log only."""


# -- address policies -----------------------------------------------------------------------

def _embedded_ipv4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries and some gateway or stack would deliver to:
    IPv4-mapped, 6to4, Teredo (server and client) and NAT64."""
    if ip.version != 6:
        return []
    out = []
    if ip.ipv4_mapped is not None:
        out.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        out.append(ip.sixtofour)
    if ip.teredo is not None:
        out.extend(ip.teredo)
    if ip in _NAT64:
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _is_public(ip: IPAddress) -> bool:
    # is_global alone is not enough on this Python: it calls multicast, site-local (fec0::/10)
    # and the NAT64 / 6to4 prefixes global, so each property is checked on its own.
    if (not ip.is_global or ip.is_private or ip.is_loopback or ip.is_link_local
            or ip.is_multicast or ip.is_reserved or ip.is_unspecified):
        return False
    if ip.version == 6 and (ip.is_site_local or ip in _NAT64_LOCAL):
        return False
    return True


def public_only(ip: IPAddress) -> bool:
    """The default policy: only globally routable unicast addresses.  Refuses private,
    loopback, link-local (cloud metadata at 169.254.169.254), CGNAT, multicast, reserved,
    unspecified (0.0.0.0, which Linux connects to loopback) and documentation ranges, and an
    IPv6 address carrying an IPv4 one (::ffff:127.0.0.1, 6to4, Teredo, NAT64) unless both are
    public.  IPv4-mapped and NAT64 (64:ff9b::/96) addresses are judged by their IPv4 address
    alone: DNS64 gives an IPv6-only host such an address for every IPv4-only site."""
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return _is_public(ip.ipv4_mapped)
    if ip in _NAT64:   # (this Python files the prefix under ::/8, "reserved")
        return _is_public(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return _is_public(ip) and all(_is_public(v4) for v4 in _embedded_ipv4(ip))


def private_allowed(ip: IPAddress) -> bool:
    """The allow_private policy.  DANGEROUS: any client can then make the server fetch from
    its own network (intranet services, admin pages, the host's loopback).  Still refused:
    unspecified, multicast, link-local (169.254.0.0/16 and fe80::/10, where cloud metadata
    lives) and the known metadata addresses outside it."""
    cands = [ip] + _embedded_ipv4(ip)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        cands = [ip.ipv4_mapped]
    for a in cands:
        if a.is_unspecified or a.is_multicast or a.is_link_local:
            return False
        if any(a in net for net in _METADATA if net.version == a.version):
            return False
    return True


def _getaddrinfo(host: str, port: int) -> list:
    return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, socket.IPPROTO_TCP)


# -- URLs -----------------------------------------------------------------------------------

class _Target:
    """One hop's URL, split: scheme, ASCII host (IDNA), port and request path."""

    __slots__ = ("url", "scheme", "host", "port", "path")

    def __init__(self, url: str):
        if not isinstance(url, str) or not url:
            raise _Refused("empty URL")
        if len(url) > MAX_URL_CHARS:
            raise _Refused(f"URL longer than {MAX_URL_CHARS} characters")
        # Control characters, spaces and backslashes are read differently by different URL
        # parsers (urlsplit strips some, browsers turn "\" into "/"): refused, not guessed at.
        if any(c <= " " or c == "\x7f" or c == "\\" for c in url):
            raise _Refused("URL holds whitespace, control characters or a backslash")
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise _Refused(f"malformed URL ({e})") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise _Refused(f"scheme {scheme!r} is not http or https")
        if "@" in parts.netloc:
            raise _Refused("URL holds userinfo (user:password@)")
        host = parts.hostname or ""
        if not host:
            raise _Refused("URL has no host")
        if not host.isascii():
            try:
                host = host.encode("idna").decode("ascii")
            except UnicodeError as e:
                raise _Refused(f"host is not a valid domain name ({e})") from None
        if port == 0:
            raise _Refused("port 0")
        self.url, self.scheme, self.host = url, scheme, host
        self.port = port or (443 if scheme == "https" else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # http.client sends the path as ASCII: percent-encode what a browser would (only
        # non-ASCII is left unencoded at this point; existing escapes are kept).
        self.path = path if path.isascii() else urllib.parse.quote(path, safe=_URL_SAFE)

    def where(self) -> str:
        """The hop for the log, without query or fragment (signed URLs carry secrets there)."""
        return f"{self.scheme}://{self.host}:{self.port}{self.path.split('?')[0][:200]}"


# -- the deadline and deadline-bound sockets ------------------------------------------------

class _Clock:
    """One fetch's deadline (monotonic) and cancel flag, shared by every hop and socket."""

    def __init__(self, end: float, step: float):
        self.end, self.step = end, step
        self.cancelled = threading.Event()

    def left(self) -> float:
        """Seconds left; raises TimeoutError once the deadline passed or the fetch was
        cancelled, so every loop that asks stops there."""
        if self.cancelled.is_set():
            raise TimeoutError("fetch cancelled")
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("fetch deadline passed")
        return left

    def wait(self) -> float:
        """One socket wait: at most a step, so the deadline and cancellation are seen soon."""
        return min(self.left(), self.step)


class _DeadlineRaw(io.RawIOBase):
    """The socket's receive side for http.client's buffered reader: each recv waits at most
    a step and is retried until the deadline.  http.client's own timeout is per recv, so
    a server sending a byte at a time (headers or body) could otherwise hold a fetch forever."""

    def __init__(self, sock: socket.socket, clock: _Clock):
        super().__init__()
        self._sock, self._clock = sock, clock

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            self._sock.settimeout(self._clock.wait())
            try:
                return self._sock.recv_into(buf)
            except TimeoutError:
                continue   # a step passed with nothing: look at the clock again


class _DeadlineSocket:
    """The connected (maybe TLS) socket as http.client sees it: sendall, makefile, close."""

    def __init__(self, sock: socket.socket, clock: _Clock):
        self._sock, self._clock = sock, clock

    def sendall(self, data) -> None:
        # A partial send cannot be resumed after a timeout, so the send gets the time left
        # (sendall's timeout bounds the whole call); the request is a few hundred bytes.
        self._sock.settimeout(self._clock.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineRaw(self._sock, self._clock))

    def close(self) -> None:
        # http.client closes the connection as soon as a "Connection: close" response is
        # parsed, while the response still reads the body from makefile()'s reader (a real
        # socket defers that close until its files are closed); the owning connection closes
        # the socket itself when the fetch is done with it (`_PinnedConnection.release`).
        pass


def _connect(sockaddr, family: int, clock: _Clock) -> socket.socket:
    """A TCP connection to an already validated address, waiting a step at a time."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Non-blocking connect so a blackholed address is abandoned at the deadline (or on
        # cancel) rather than at the kernel's connect timeout.
        sock.setblocking(False)
        err = sock.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
            raise OSError(err, f"connect: {errno.errorcode.get(err, err)}")
        if err != 0:
            with selectors.DefaultSelector() as sel:
                sel.register(sock, selectors.EVENT_WRITE)
                while not sel.select(clock.wait()):
                    pass
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, f"connect: {errno.errorcode.get(err, err)}")
        sock.setblocking(True)
        return sock
    except BaseException:
        sock.close()
        raise


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to one validated address, whatever the host name resolves to
    now; the host name is only used for the Host header, SNI and the certificate check."""

    def __init__(self, target: _Target, addrs: list, clock: _Clock,
                 tls: ssl.SSLContext | None):
        super().__init__(target.host, target.port)
        if tls is not None:
            self.default_port = 443   # Host: without ":443" (http.client compares with it)
        self._addrs, self._clock, self._tls = addrs, clock, tls
        self._real: socket.socket | None = None

    def release(self) -> None:
        """Closes the response and the socket (http.client's close() leaves the socket)."""
        try:
            self.close()
        finally:
            if self._real is not None:
                self._real.close()
                self._real = None

    def connect(self) -> None:
        last: Exception | None = None
        for family, sockaddr in self._addrs:
            try:
                sock = _connect(sockaddr, family, self._clock)
            except TimeoutError:
                raise
            except OSError as e:   # the next address, as create_connection would
                last = e
                continue
            try:
                if self._tls is not None:
                    # The handshake cannot be resumed after a timeout either: time left.
                    sock.settimeout(self._clock.left())
                    sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
            self._real = sock
            self.sock = _DeadlineSocket(sock, self._clock)
            return
        raise last or OSError("no address to connect to")


# -- the fetcher ----------------------------------------------------------------------------

class RemoteImages:
    """Fetches remote images on a dedicated pool of `max_workers` threads, so slow servers
    queue behind each other here instead of starving asyncio's shared default executor.

    `allow_address(ip) -> bool` decides which resolved addresses may be connected to (default
    `public_only`); `allow_private=True` selects `private_allowed` instead, which lets every
    client reach the server's own network: only for servers that must read images from an
    intranet and whose clients are all trusted.  `resolve(host, port)` (default getaddrinfo)
    and `ssl_context` (default: the system's CAs) are for tests and private CAs; whatever
    they return is still checked by the policy and the certificate check.
    """

    def __init__(self, max_workers: int = 4, *, allow_address: AddressPolicy | None = None,
                 allow_private: bool = False, max_redirects: int = 5, step_s: float = 0.25,
                 resolve: Resolver | None = None, ssl_context: ssl.SSLContext | None = None,
                 user_agent: str = "photon-serve"):
        if max_workers < 1 or step_s <= 0:
            raise ValueError(f"max_workers must be >= 1 and step_s > 0, got {max_workers}, "
                             f"{step_s}")
        if allow_address is not None and allow_private:
            raise ValueError("pass allow_address or allow_private, not both")
        self.allow_address = allow_address or (private_allowed if allow_private
                                               else public_only)
        self.allow_private = allow_private
        self.max_redirects, self.step_s, self.user_agent = max_redirects, step_s, user_agent
        self._resolve = resolve or _getaddrinfo
        self._ssl = ssl_context or ssl.create_default_context()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="photon-fetch")
        self._lock = threading.Lock()
        self._running: set[_Clock] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Fetches a pool thread is working on now (a caller may have given up on some)."""
        with self._lock:
            return len(self._running)

    def failure(self, deadline_s: float, param: str = "image_url") -> FetchError:
        """The one message every failed fetch gets, whatever the cause."""
        where = "an http(s) address" if self.allow_private else \
            "a public http(s) address"
        return FetchError(f"{param}: the image could not be fetched (the URL must be {where} "
                          f"answering 200 with an image within {deadline_s:g} s)", param)

    async def fetch(self, url: str, limit_bytes: int, deadline_s: float = 15.0, *,
                    param: str = "image_url") -> bytes:
        """The body of `url` (at most `limit_bytes`), within `deadline_s` seconds of this
        call, queueing for a pool thread included.  Raises `FetchError` only."""
        if self._closed:
            raise RuntimeError("RemoteImages is closed")
        if limit_bytes < 0 or deadline_s <= 0:
            raise ValueError(f"limit_bytes must be >= 0 and deadline_s > 0, got "
                             f"{limit_bytes}, {deadline_s}")
        try:
            _Target(url)   # a malformed URL or wrong scheme is refused without a thread
        except _Refused as e:
            log.info("image fetch %s refused: %s", _short(url), e)
            raise self.failure(deadline_s, param) from None
        clock = _Clock(time.monotonic() + deadline_s, self.step_s)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, self._work, url, limit_bytes, clock,
                                   deadline_s, param)
        try:
            # A fetch still queued when this times out is cancelled before it starts; a
            # running one sees the cancel flag within a step.
            return await asyncio.wait_for(fut, deadline_s + _GRACE_S)
        except asyncio.TimeoutError:
            log.info("image fetch %s: no answer from the fetch thread by the deadline "
                     "(stuck resolving the host, or the pool was busy)", _short(url))
            raise self.failure(deadline_s, param) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise   # the caller was cancelled (client gone): that is not ours to hide
            # close() dropped the queued fetch: a failure, not a cancelled caller
            log.info("image fetch %s: dropped, the fetcher was closed", _short(url))
            raise self.failure(deadline_s, param) from None
        finally:
            clock.cancelled.set()

    def close(self) -> None:
        """Stops the pool: queued fetches are dropped and running ones give up within a step
        (their callers get `FetchError`, or wait out their deadline).  Idempotent."""
        self._closed = True
        with self._lock:
            for clock in self._running:
                clock.cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on a pool thread --

    def _work(self, url: str, limit: int, clock: _Clock, deadline_s: float,
              param: str) -> bytes:
        with self._lock:
            self._running.add(clock)
        try:
            return self._fetch(url, limit, clock, param)
        except FetchError as e:
            log.info("image fetch %s refused: %s", _short(url), e.message)
            raise
        except (_Refused, OSError, http.client.HTTPException, ssl.SSLError, ValueError,
                UnicodeError) as e:
            log.info("image fetch %s refused or failed: %s: %s", _short(url),
                     type(e).__name__, e)
        except Exception:   # noqa: BLE001 - a bug here still must not leak to the client
            log.warning("image fetch %s failed unexpectedly", _short(url), exc_info=True)
        finally:
            with self._lock:
                self._running.discard(clock)
        raise self.failure(deadline_s, param)

    def _fetch(self, url: str, limit: int, clock: _Clock, param: str) -> bytes:
        for hop in range(self.max_redirects + 1):
            clock.left()
            target = _Target(url)
            addrs = self._addresses(target)
            clock.left()   # resolving may have taken the time left
            conn = _PinnedConnection(target, addrs, clock,
                                     self._ssl if target.scheme == "https" else None)
            try:
                conn.request("GET", target.path, headers={
                    "User-Agent": self.user_agent, "Accept": "image/*",
                    "Connection": "close"})
                resp = conn.getresponse()
                if resp.status in REDIRECTS:
                    location = resp.getheader("Location")
                    if not location:
                        raise _Refused(f"{target.where()}: {resp.status} without Location")
                    url = urllib.parse.urljoin(target.url, location.strip())
                    log.debug("image fetch hop %d: %s -> %s", hop, target.where(),
                              _short(url))
                    continue
                if resp.status != 200:
                    raise _Refused(f"{target.where()}: HTTP {resp.status}")
                return self._body(resp, target, limit, param)
            finally:
                conn.release()
        raise _Refused(f"more than {self.max_redirects} redirects")

    def _addresses(self, target: _Target) -> list:
        """getaddrinfo once for this hop; every address must pass the policy (a name with one
        public and one private address is refused, not half-trusted)."""
        rows = self._resolve(target.host, target.port)
        out = []
        for family, _type, _proto, _canon, sockaddr in rows:
            if family not in (socket.AF_INET, socket.AF_INET6):
                raise _Refused(f"{target.host} resolved to address family {family}")
            ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
            if not self.allow_address(ip):
                raise _Refused(f"{target.host} resolves to {ip}, refused by the address "
                               "policy")
            out.append((family, sockaddr))
        if not out:
            raise _Refused(f"{target.host} resolved to no address")
        return out

    def _body(self, resp: http.client.HTTPResponse, target: _Target, limit: int,
              param: str) -> bytes:
        ctype = (resp.getheader("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype and not (ctype.startswith("image/") or ctype == "application/octet-stream"):
            raise _Refused(f"{target.where()}: Content-Type {ctype!r}")
        length = resp.getheader("Content-Length")
        if length is not None:
            length = length.strip()
            if not length.isdigit():   # "10, 10" and friends: ambiguous framing, refused
                raise _Refused(f"{target.where()}: Content-Length {length[:40]!r}")
            if int(length) > limit:
                raise self._too_large(param, limit, int(length))
        buf = bytearray()
        while len(buf) <= limit:
            chunk = resp.read(min(_READ_CHUNK, limit + 1 - len(buf)))
            if not chunk:
                return bytes(buf)
            buf += chunk
        raise self._too_large(param, limit)

    @staticmethod
    def _too_large(param: str, limit: int, n: int | None = None) -> FetchError:
        size = f"{n} bytes" if n is not None else "larger"
        return FetchError(f"{param}: the remote image is {size}, more than the {limit}-byte "
                          "limit (--max-body-mb)", param, too_large=True)


def _short(url, n: int = 120) -> str:
    """A URL for the log: no query or fragment (they may carry signatures), truncated."""
    s = str(url).split("?", 1)[0].split("#", 1)[0]
    return repr(s if len(s) <= n else s[:n] + "...")
