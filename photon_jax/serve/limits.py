"""`photon-serve`'s resource bounds below the routes: byte budgets and the HTTP protocol.

Owns: `Budget` (bytes that requests reserve before the step that commits them: reading a
body, decoding an image, holding crops while queued; an asyncio waiter or an immediate
refusal), `ServerLimits` (the defaults, one place), and `uvicorn_config` (uvicorn with
`limit_concurrency`, the keep-alive timeout and a header deadline: uvicorn 0.55 has no
timeout for a request whose headers never finish, so the HTTP protocol here closes such a
connection itself).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

MiB = 1 << 20


@dataclass
class ServerLimits:
    """What one request may cost, and what all of them together may hold (docs/serving.md
    lists each with its flag)."""
    max_image_pixels: int = 50_000_000    # refused from the header, before decoding
    max_text_chars: int = 32_768          # question / object / message text, before tokenizing
    max_spatial_refs: int = 64
    body_timeout: float = 30.0            # seconds for a whole request body to arrive
    header_timeout: float = 10.0          # seconds for a request's headers to arrive
    keep_alive: float = 5.0               # seconds an idle connection stays open
    max_connections: int = 512            # uvicorn's limit_concurrency: 503 above
    body_budget: int = 192 * MiB          # bodies being read and parsed (3x their size)
    decode_budget: int = 384 * MiB        # images being decoded (estimated peak bytes)
    decode_threads: int = 2               # threads decoding images (their own pool)
    queued_budget: int = 256 * MiB        # crops of admitted requests until they finish
    fetch_threads: int = 4                # threads fetching remote images (their own pool)
    fetch_timeout: float = 15.0           # seconds for a whole remote fetch, redirects included
    wait: float = 10.0                    # seconds a request waits for a budget before 503


class Budget:
    """A number of bytes shared by concurrent requests.  `reserve` waits (on the event loop)
    until the bytes are free; a reservation larger than the whole budget waits until
    nothing else is held and then runs alone, so a legal but large request is slow, never
    refused for its size.  `take` is the non-waiting form (any thread).  Releases happen
    on any thread (an engine handle's done callback)."""

    def __init__(self, total: int, name: str):
        self.total, self.name = total, name
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.total or self.used == 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes now, or return False."""
        with self._lock:
            if not self._fits(n):
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    async def reserve(self, n: int, timeout: float) -> None:
        """Reserve `n` bytes, waiting up to `timeout` s (asyncio.TimeoutError after)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.take(n):
            fut = loop.create_future()
            with self._lock:
                if self._fits(n):          # released between take() and here
                    continue
                self._waiters.append((loop, fut))
            try:
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            finally:
                with self._lock:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:   # wake all: each re-checks what it needs
            loop.call_soon_threadsafe(_set, fut)


def _set(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def uvicorn_config(app, limits: ServerLimits, **kwargs):
    """A uvicorn.Config for `app` with the connection bounds of `limits`: at most
    max_connections connections and tasks (503 above), idle keep-alive connections closed
    after keep_alive s, and a connection whose request headers are not complete within
    header_timeout s (slowloris) closed."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    header_timeout = limits.header_timeout

    class Protocol(H11Protocol):
        """uvicorn's h11 protocol plus a deadline for each request's headers: armed when
        the connection opens and after each response; disarmed once headers arrive."""

        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self):
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm_header_timer(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self):
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:   # no request running
                self.transport.close()

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_timer()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc):
            self._disarm_header_timer()
            super().connection_lost(exc)

    kwargs.setdefault("timeout_keep_alive", limits.keep_alive)
    return uvicorn.Config(app, http=Protocol, limit_concurrency=limits.max_connections,
                          **kwargs)
