"""The asyncio bridge: awaiting engine `Handle`s on an event loop without a thread per
request.  `Moondream`'s `a*` methods (`acaption`, `aquery`, ...) and the HTTP server
(`serve`) are built on it.

Owns: turning a handle's completion into an asyncio wake-up (`add_done_callback` on the
scheduler thread -> `loop.call_soon_threadsafe`), the async text stream (a wake-up per text
piece via `add_progress_callback`, the pieces taken with `take_texts`), and cancellation:
a cancelled awaiting task, or a stream closed before its end, cancels its request, so no row
keeps decoding for nobody.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .engine.request import Handle


def _poker(loop: asyncio.AbstractEventLoop, fn, live=None):
    """A callback for the scheduler thread that runs `fn()` on `loop` (never blocks; a loop
    that closed meanwhile has nobody left to tell).  `live`: a one-item list; once it holds
    False the callback does nothing (handles cannot unregister callbacks)."""
    def poke(_handle) -> None:
        if live is not None and not live[0]:
            return
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:   # the loop is closed
            pass
    return poke


async def wait(handle: Handle) -> None:
    """Until `handle` finished.  Cancelling the awaiting task cancels the request."""
    if handle.done():
        return
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle():
        if not fut.done():
            fut.set_result(None)

    handle.add_done_callback(_poker(loop, settle))
    try:
        await fut
    except asyncio.CancelledError:
        handle.cancel()
        raise


async def wait_all(handles: list[Handle]) -> None:
    """Until every handle finished; cancelling the awaiting task cancels them all."""
    try:
        await asyncio.gather(*(wait(h) for h in handles))
    except asyncio.CancelledError:
        for h in handles:
            if not h.done():
                h.cancel()
        raise


async def result(handle: Handle):
    """-> the handle's result (`Handle.result`), awaited; raises the request's error."""
    await wait(handle)
    return handle.result(0)


async def results(handles: list[Handle]) -> list:
    """-> every handle's result in order (the first error raised, after all finished)."""
    await wait_all(handles)
    return [h.result(0) for h in handles]


async def reasoning(handle: Handle) -> dict | None:
    """-> a reasoning query's reasoning as soon as its phase ended (`Handle.reasoning`)."""
    if not handle.reasoning_ready():
        loop = asyncio.get_running_loop()
        ready, live = asyncio.Event(), [True]
        poke = _poker(loop, ready.set, live)   # off once the reasoning is in: the answer's
        handle.add_progress_callback(poke)     # pieces then wake only the text stream
        handle.add_done_callback(poke)
        try:
            while not handle.reasoning_ready():
                ready.clear()
                if handle.reasoning_ready():
                    break
                await ready.wait()
        except asyncio.CancelledError:
            handle.cancel()
            raise
        finally:
            live[0] = False
    return handle.reasoning(0)


async def text_stream(handle: Handle) -> AsyncIterator[str]:
    """Text pieces as the engine commits tokens, then the request's error if it failed.
    Closing the iterator early (`aclose()`, a cancelled consumer, garbage collection)
    cancels the request."""
    loop = asyncio.get_running_loop()
    more, live = asyncio.Event(), [True]
    poke = _poker(loop, more.set, live)
    handle.add_progress_callback(poke)
    handle.add_done_callback(poke)
    try:
        while True:
            # Clear before taking: a piece queued after the take sets the event again, so
            # no wake-up is lost.
            more.clear()
            pieces, ended = handle.take_texts()
            for piece in pieces:
                yield piece
            if ended:
                break
            await more.wait()
        handle.result(0)   # raises the request's error, if any
    finally:
        live[0] = False
        if not handle.done():
            handle.cancel()
