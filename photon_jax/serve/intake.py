"""`photon-serve`'s intake: a request's body and image, each paid for before it is taken.

Owns: `Intake`, which reads a body under the body budget and one deadline (a slow or short
sender is cut off, and bytes are reserved before they are read), parses it as JSON (deep
nesting and huge numbers are a 400, never a 500), and turns an `image_url` into crops on the
device: a data URI parsed without a regular expression (or a remote fetch by
`fetch.RemoteImages`), the image's header read first (format allow-list, --max-image-pixels,
its decode cost and crop bytes), then the decode on the intake's own thread pool under the
decode budget, and the crops held in the queued budget until the request finishes.

Each budget (`limits.Budget`) counts bytes, so "what the server holds" is a sum of three
numbers docs/serving.md states.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import ClientDisconnect, Request as HTTPRequest

from ..api import ImageError
from .fetch import FetchError
from .inputs import ApiError, bad
from .limits import MiB, Budget, ServerLimits

log = logging.getLogger("photon_jax.serve")

# A body is held about three times while it is parsed: the bytes, the JSON's strings, and
# an image's decoded base64.
BODY_COPIES = 3
# Bodies above this are parsed on a thread (tens of ms of JSON on the event loop would
# stall every other stream's next token).
BIG = 1 << 20
# A data URI's header ("data:image/png;charset=...;base64") is short; a longer one is not
# an image URI (and is not scanned further).
MAX_URI_HEADER = 256


def busy(what: str) -> ApiError:
    return ApiError(503, f"server busy: {what}; retry after a moment", "overloaded",
                    headers={"Retry-After": "2"})


class Reservation:
    """Bytes held in a budget until `release()` (idempotent; any thread)."""

    def __init__(self, budget: Budget, n: int):
        self.budget, self.n = budget, n
        self._lock = threading.Lock()

    def release(self, *_):
        with self._lock:
            n, self.n = self.n, 0
        if n:
            self.budget.release(n)


class Intake:
    """Bodies and images, bounded by `limits` (see the module docstring)."""

    def __init__(self, limits: ServerLimits, max_body: int, fetcher=None):
        self.limits, self.max_body, self.fetcher = limits, max_body, fetcher
        self.bodies = Budget(limits.body_budget, "body")
        self.decodes = Budget(limits.decode_budget, "decode")
        self.queued = Budget(limits.queued_budget, "queued")
        self.pool = ThreadPoolExecutor(limits.decode_threads, thread_name_prefix="photon-decode")
        self.reading = 0   # bodies being read now (admission counts them)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.fetcher is not None:
            self.fetcher.close()

    # -- bodies ------------------------------------------------------------------------------

    async def body(self, request: HTTPRequest) -> tuple[dict, Reservation]:
        """The JSON object of the body and its reservation in the body budget (the caller
        releases it once the request is submitted or refused).  413 past max_body without
        reading the rest; 408 when the whole body has not arrived within body_timeout."""
        limit = self.max_body
        too_big = ApiError(413, f"request body over the {limit / MiB:g} MiB limit "
                           f"(--max-body-mb); send a smaller image (JPEG, downscaled)",
                           "request_too_large")
        cl = request.headers.get("content-length")
        if cl is not None:
            if not (cl.isascii() and cl.strip().isdigit()):
                raise bad("Content-Length is not a number")
            size = int(cl)
            if size > limit:
                raise too_big
        else:
            size = limit   # chunked: reserve for the worst
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout
        res = Reservation(self.bodies, BODY_COPIES * max(size, 1))
        try:
            await self.bodies.reserve(res.n, min(self.limits.wait, self.limits.body_timeout))
        except asyncio.TimeoutError:
            raise busy(f"{self.bodies.used / MiB:.0f} MiB of request bodies are being read "
                       "(--max-body-buffer-mb)") from None
        self.reading += 1
        try:
            raw = await asyncio.wait_for(self._read(request, limit, too_big),
                                         max(0.0, deadline - loop.time()))
            if len(raw) < BIG:
                return self._parse(raw), res
            return await loop.run_in_executor(self.pool, self._parse, raw), res
        except asyncio.TimeoutError:
            res.release()
            raise ApiError(408, f"the request body did not arrive within "
                           f"{self.limits.body_timeout:g} s (--body-timeout); send it "
                           "faster, or a smaller image", "timeout") from None
        except BaseException:
            res.release()
            raise
        finally:
            self.reading -= 1

    @staticmethod
    async def _read(request: HTTPRequest, limit: int, too_big: ApiError) -> bytes:
        chunks, n = [], 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "client closed the request while sending it",
                           "cancelled") from None
        return b"".join(chunks)

    @staticmethod
    def _parse(raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except RecursionError:
            raise bad("the body's JSON is nested too deeply; send a flat JSON object") \
                from None
        except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError, int digit limit
            raise bad(f"the body is not valid JSON ({_short(str(e), 120)}); send a JSON "
                      "object with Content-Type: application/json") from None
        if not isinstance(body, dict):
            raise bad(f"the body must be a JSON object, got {type(body).__name__}")
        return body

    # -- images ------------------------------------------------------------------------------

    async def image(self, md, url, param: str, allow_remote: bool):
        """`url` (a data URI, or http(s) when allowed) -> (PreparedImage, Reservation of its
        crops in the queued budget).  The caller releases the reservation when the request
        finishes (or at once if it is not submitted)."""
        if not isinstance(url, str):
            raise bad(f"{param} must be a string (a data:image/...;base64,... URI)", param)
        if url[:8].lower().startswith(("http://", "https://")):
            if not allow_remote or self.fetcher is None:
                raise bad(f"{param}: remote URLs are refused (the server would fetch them on "
                          "your behalf); send the image inline as data:image/jpeg;base64,... "
                          "or start the server with --allow-remote-images", param)
            try:
                raw = await self.fetcher.fetch(url, self.max_body, self.limits.fetch_timeout,
                                               param=param)
            except FetchError as e:   # one message for every failure: no port-scan oracle
                raise ApiError(413 if e.too_large else 400, e.message, param=param) from None
        elif len(url) < BIG:
            raw = decode_data_uri(url, param)
        else:
            raw = await asyncio.get_running_loop().run_in_executor(
                self.pool, decode_data_uri, url, param)
        return await self.decode(md, raw, param)

    async def decode(self, md, raw: bytes, param: str = "image_url"):
        loop = asyncio.get_running_loop()
        cap = self.limits.max_image_pixels
        try:
            cost, crops = await loop.run_in_executor(self.pool, md._image_costs, raw, cap)
        except ImageError as e:
            raise bad(f"{param}: {_hint(e)}", param) from None
        held = Reservation(self.queued, crops)
        if not self.queued.take(crops):
            raise busy(f"{self.queued.used / MiB:.0f} MiB of images are queued for the model "
                       "(--max-queued-images-mb)")
        try:
            try:
                await self.decodes.reserve(cost, self.limits.wait)
            except asyncio.TimeoutError:
                raise busy("images are being decoded (--max-decode-mb)") from None
            try:
                prep = await loop.run_in_executor(self.pool, md._prepare_image, raw, cap, True)
            finally:
                self.decodes.release(cost)
        except ImageError as e:
            held.release()
            raise bad(f"{param}: {_hint(e)}", param) from None
        except BaseException:
            held.release()
            raise
        return prep, held


def _hint(e: ImageError) -> str:
    msg = str(e)
    return msg.replace("downscale it to at most", "downscale it (--max-image-pixels) to at most")


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n] + "..."


def decode_data_uri(url: str, param: str = "image_url") -> bytes:
    """`data:image/...;base64,...` -> the file's bytes.  Parsed by position (the header
    before the first comma, at most MAX_URI_HEADER characters), so no input can make it
    backtrack; the decoded file's format and size are checked when it is decoded."""
    head, comma, data = url[:MAX_URI_HEADER + 1].partition(",")
    if not head[:5].lower() == "data:" or not comma:
        raise bad(f"{param} must be a data URI such as \"data:image/jpeg;base64,...\" (remote "
                  "URLs are refused unless the server runs with --allow-remote-images)", param)
    mime, *params = head[5:].split(";")
    mime = mime.strip().lower()
    if mime and not mime.startswith("image/"):
        raise bad(f"{param} is a data URI of {_short(mime, 40)!r}, not an image; send "
                  "data:image/jpeg;base64,... (or png, webp...)", param)
    if "base64" not in (p.strip().lower() for p in params):
        raise bad(f"{param} must be base64-encoded: data:image/...;base64,<data>", param)
    data = url[len(head) + 1:]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        try:   # line-wrapped base64 (MIME style): drop the whitespace, then strictly
            raw = base64.b64decode("".join(data.split()), validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{param}: the base64 data does not decode (invalid characters or "
                      "padding); encode the image file with standard base64", param) from None
    if not raw:
        raise bad(f"{param}: the data URI holds no bytes", param)
    return raw
