"""`photon-serve`'s HTTP application for one loaded model (`pip install ".[serve]"`).

Owns: the Starlette app (`create_app`: routes, admission, streaming, cancellation); request
parsing lives in `inputs`, metrics in `metrics`, the command line in `photon_jax.cli.serve`.
Routes:

- Moondream's cloud API, as the `moondream` client (`md.vl(endpoint=".../v1")`) calls it:
  POST /v1/caption, /v1/query, /v1/detect, /v1/point, /v1/segment (Moondream 3 only);
  streams are server-sent events `data: {"chunk": ..., "completed": false}` ending with
  `"completed": true` (segment: the client's bbox / path_delta / final events).
- OpenAI's POST /v1/chat/completions for what maps to `query` (one user turn: text and at
  most one image) and GET /v1/models.
- GET /health (200 once the model is loaded and warm, 503 before) and GET /metrics
  (Prometheus text, a registry per app).

One engine serves every connection: handlers submit requests and await their handles on the
event loop (`aio`), so concurrent requests share the engine's batch and no thread waits per
request.  Every bad input gets a 4xx JSON body {"error": {"message", "type", "param"}} that
names the input and the fix; the server keeps serving.  A client that goes away, or a
request past --request-timeout, cancels its engine request.  Security notes:
docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import aio
from ..api import EngineError, ImageError, RequestError
from .inputs import (ApiError, Fields, bad, check_settings, decode_data_uri, fetch_image,
                     openai_finish, parse_chat)
from .metrics import Metrics

log = logging.getLogger("photon_jax.serve")

LENGTHS = ("short", "normal", "long")
# Bodies and data URIs above this are parsed / decoded on a worker thread: tens of ms of
# JSON or base64 on the event loop would stall every other stream's next token.
BIG = 1 << 20


@dataclass
class ServeConfig:
    """What the server enforces (the command line's flags)."""
    api_key: str | None = None          # X-Moondream-Auth or "Authorization: Bearer"
    max_body_bytes: int = 20 << 20      # 413 above; checked before the body is read
    max_queue: int = 256                # requests waiting beyond the batch; 429 above
    request_timeout: float | None = 600.0   # seconds; the request is cancelled after
    allow_remote_images: bool = False   # fetch http(s) image_url (capped at max_body_bytes)
    model_name: str = "moondream"       # /v1/models and the responses' "model"


# -- the app --------------------------------------------------------------------------------

class Server:
    """The state behind one app: the model (given, or loaded in the background), limits,
    admission counts and metrics.  Routes are its methods."""

    def __init__(self, model, config: ServeConfig):
        self.config = config
        self.md = None
        self.load_error: BaseException | None = None
        self._loader = None
        self._owns = False
        if callable(model) and not hasattr(model, "engine"):
            self._loader, self._owns = model, True
        else:
            self.md = model
        self.ready = threading.Event()
        if self.md is not None:
            self.ready.set()
        self.live: set = set()   # handles submitted by this server, pruned when done
        self.metrics = Metrics(self)

    # lifecycle
    def start_loading(self) -> threading.Thread | None:
        """Load (and warm) the model on a thread: /health says 503 until it is ready."""
        if self._loader is None:
            return None

        def load():
            try:
                self.md = self._loader()
                self.ready.set()
                log.info("model loaded and warm; ready")
            except BaseException as e:  # noqa: BLE001 - reported by /health and main
                self.load_error = e
                log.error("loading the model failed: %r", e)

        t = threading.Thread(target=load, name="photon-serve-load", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        if self._owns and self.md is not None:
            self.md.close()   # finishes what is still running, frees the device

    @property
    def capacity(self) -> int:
        """Requests in flight before new ones are refused (429): the rows plus the queue."""
        rows = self.md.engine.max_batch_size if self.md is not None else 0
        return rows + self.config.max_queue

    # plumbing
    def _auth(self, request: HTTPRequest) -> None:
        key = self.config.api_key
        if not key:
            return
        got = request.headers.get("x-moondream-auth")
        if got is None:
            auth = request.headers.get("authorization", "")
            got = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        if got is None or not hmac.compare_digest(got.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send it in the X-Moondream-Auth "
                           "header (or \"Authorization: Bearer KEY\")", "authentication_error",
                           headers={"WWW-Authenticate": "Bearer"})

    def _model(self):
        if self.md is None:
            if self.load_error is not None:
                raise ApiError(503, f"the model failed to load: {self.load_error}",
                               "server_error")
            raise ApiError(503, "the model is still loading; retry shortly (GET /health says "
                           "when it is ready)", "not_ready", headers={"Retry-After": "5"})
        return self.md

    async def _body(self, request: HTTPRequest) -> dict:
        """The JSON object of the body, refused (413) past max_body_bytes without reading the
        rest: Content-Length first, then a count while streaming."""
        limit = self.config.max_body_bytes
        cl = request.headers.get("content-length")
        too_big = ApiError(413, f"request body over the {limit / (1 << 20):g} MiB limit "
                           f"(--max-body-mb); send a smaller image (JPEG, downscaled)",
                           "request_too_large")
        if cl is not None:
            if not cl.strip().isdigit():
                raise bad("Content-Length is not a number")
            if int(cl) > limit:
                raise too_big
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
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if n < BIG else await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the body is not valid JSON ({e}); send a JSON object with "
                       "Content-Type: application/json") from None
        if not isinstance(body, dict):
            raise bad(f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def _image(self, url, param: str = "image_url"):
        if not isinstance(url, str):
            raise bad(f"{param} must be a string (a data:image/...;base64,... URI)", param)
        if url.startswith(("http://", "https://")):
            if not self.config.allow_remote_images:
                raise bad(f"{param}: remote URLs are refused (the server would fetch them on "
                           "your behalf); send the image inline as data:image/jpeg;base64,... "
                           "or start the server with --allow-remote-images", param)
            return await asyncio.to_thread(fetch_image, url, self.config.max_body_bytes)
        if len(url) < BIG:
            return decode_data_uri(url, param)
        return await asyncio.to_thread(decode_data_uri, url, param)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (counted from the handles, so a response that
        never ran its body cannot leak a slot)."""
        self.live = {h for h in self.live if not h.done()}
        return len(self.live)

    def _admit(self) -> None:
        if self.in_flight >= self.capacity:
            raise ApiError(429, f"server busy: {self.in_flight} requests in flight (rows + "
                           f"--max-queue {self.config.max_queue}); retry after a moment",
                           "rate_limit_error", headers={"Retry-After": "1"})

    def _submit(self, make):
        """`make()` -> the API's `_Call` (submits at once); ValueErrors are the client's."""
        self._admit()
        try:
            call = make()
        except (ValueError, TypeError, RequestError) as e:
            raise bad(str(e)) from None
        except EngineError as e:
            raise ApiError(503, f"the engine stopped: {e}", "server_error") from None
        self.live.update(call.handles)
        for h in call.handles:
            # (Scheduler thread; prometheus_client's metrics are thread-safe.)
            h.add_done_callback(self.metrics.finished)
        return call

    @staticmethod
    def _result_error(e: BaseException) -> ApiError:
        if isinstance(e, ImageError):
            return bad(f"image_url: {e}", "image_url")
        if isinstance(e, (RequestError, ValueError)):
            return bad(str(e))
        if isinstance(e, EngineError):
            return ApiError(503, f"the engine stopped: {e}", "server_error")
        log.exception("request failed", exc_info=e)
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    async def _finish(self, request: HTTPRequest, call) -> None:
        """Await the call's handles; a client that disconnects meanwhile, or the request
        timeout, cancels them (no row keeps decoding for nobody)."""
        work = asyncio.ensure_future(aio.wait_all(call.handles))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=self.config.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()   # -> handle.cancel() for each
        if work in done:
            return
        if gone in done:
            raise ApiError(499, "client closed the request", "cancelled")
        raise ApiError(504, f"request timed out after {self.config.request_timeout} s "
                       "(--request-timeout); it was cancelled; ask for fewer tokens",
                       "timeout")

    def _shape(self, call):
        try:
            return call.shape(call.handles[0])
        except Exception as e:  # noqa: BLE001 - mapped to a status
            raise self._result_error(e) from None

    def _sse(self, request: HTTPRequest, call, events, route: str) -> StreamingResponse:
        """Server-sent events from the async iterator `events` (dicts, or "[DONE]"), with
        the disconnect watch and the deadline; the call's handles are cancelled if the
        stream ends early for any reason."""
        t0 = time.perf_counter()
        deadline = None if self.config.request_timeout is None else \
            time.monotonic() + self.config.request_timeout

        async def body():
            watch = asyncio.ensure_future(_cancel_when_gone(request, call.handles))
            it = events.__aiter__()
            try:
                while True:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        ev = await asyncio.wait_for(it.__anext__(), left)
                    except StopAsyncIteration:
                        break
                    except asyncio.TimeoutError:
                        ev = {"error": {"message": "request timed out after "
                                        f"{self.config.request_timeout} s (--request-timeout)"
                                        "; it was cancelled", "type": "timeout"},
                              "completed": True}
                        yield _event(ev)
                        break
                    except ApiError as e:
                        yield _event({"error": {"message": e.message, "type": e.kind},
                                      "completed": True})
                        break
                    yield _event(ev)
            finally:
                watch.cancel()
                for h in call.handles:
                    if not h.done():
                        h.cancel()
                await _aclose(it)
                self.metrics.latency.labels(route).observe(time.perf_counter() - t0)

        self.metrics.requests.labels(route, "200").inc()
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    async def _text_events(self, call):
        """Moondream's stream events: {"chunk", "completed": false} per piece, then
        {"completed": true, "finish_reason", "usage"}; errors as an "error" event."""
        h = call.handles[0]
        if h.request.reasoning:
            try:
                reasoning = await aio.reasoning(h)
            except Exception as e:  # noqa: BLE001
                raise self._result_error(e) from None
            yield {"reasoning": reasoning, "completed": False}
        stream = aio.text_stream(h)
        try:
            async for piece in stream:
                yield {"chunk": piece, "completed": False}
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._result_error(e) from None
        finally:
            await stream.aclose()
        m = h.metrics()
        yield {"chunk": "", "completed": True, "finish_reason": m["finish_reason"],
               "usage": _usage(m)}

    # routes
    async def route(self, request: HTTPRequest, name: str, handler):
        """Run one route: errors become their JSON response; every outcome is counted."""
        t0 = time.perf_counter()
        try:
            self._auth(request)
            resp = await handler(request)
        except ApiError as e:
            resp = e.response()
        except Exception as e:  # noqa: BLE001 - a bug here must not take the server down
            log.exception("%s failed", name)
            resp = ApiError(500, f"internal error: {type(e).__name__}: {e}",
                            "server_error").response()
        if not isinstance(resp, StreamingResponse):   # a stream counts itself when it ends
            self.metrics.requests.labels(name, str(resp.status_code)).inc()
            self.metrics.latency.labels(name).observe(time.perf_counter() - t0)
        return resp

    async def skill(self, request: HTTPRequest, route: str) -> Response:
        md = self._model()
        body = await self._body(request)
        f = Fields(body, route)
        f.take("model", str, what="a string (ignored: this server runs one model)")
        stream = f.take("stream", bool, False, what="true or false")
        settings = check_settings(f.take("settings", dict, what="an object"),
                                  md.engine.max_context)
        if route == "query":
            url = f.take("image_url", str, what="a data:image/...;base64,... URI")
            image = None if url is None else await self._image(url)
            question = f.take("question", str, required=True, what="a non-empty string")
            reasoning = f.take("reasoning", bool, False, what="true or false")
            refs = f.take("spatial_refs", list, what="a list of [x, y] points and "
                          "[x_min, y_min, x_max, y_max] boxes")
            f.done()
            call = self._submit(lambda: md._query(image, question, reasoning, refs, stream,
                                                  settings, False))
        else:
            image = await self._image(f.take("image_url", str, required=True,
                                             what="a data:image/...;base64,... URI"))
            if route == "caption":
                length = f.take("length", str, "normal", what=f"one of {list(LENGTHS)}")
                if length not in LENGTHS:
                    raise bad(f"caption: length must be one of {list(LENGTHS)}, got "
                               f"{length!r}", "length")
                f.done()
                call = self._submit(lambda: md._caption(image, length, stream, settings,
                                                        False))
            else:
                obj = f.take("object", str, required=True, what="a non-empty string")
                refs = f.take("spatial_refs", list, what="a list of points and boxes") \
                    if route in ("point", "segment") else None
                f.done()
                if stream and route != "segment":
                    raise bad(f"{route} does not stream; send stream false", "stream")
                if route == "segment":
                    call = self._submit(lambda: md._segment(image, obj, refs, settings,
                                                            False))
                else:
                    key = "objects" if route == "detect" else "points"
                    call = self._submit(lambda: md._locate(route, key, image, obj,
                                                           settings, False))
        if stream:
            events = self._segment_events(call) if route == "segment" else \
                self._text_events(call)
            return self._sse(request, call, events, route)
        await self._finish(request, call)
        return JSONResponse(self._shape(call))

    async def _segment_events(self, call):
        """The client's segment stream: bbox, the path (in one piece: it is parsed from the
        whole output), final."""
        h = call.handles[0]
        await aio.wait(h)
        out = self._shape(call)
        if out["bbox"] is not None:
            yield {"type": "bbox", "bbox": out["bbox"], "completed": False}
        yield {"type": "path_delta", "chunk": out["path"], "completed": False}
        yield {"type": "final", "path": out["path"], "bbox": out["bbox"], "completed": True}

    async def segment(self, request: HTTPRequest) -> Response:
        md = self._model()
        if not md.can_segment:
            raise ApiError(400, f"segment needs a Moondream 3 model; this server runs "
                           f"{md.config.family}; use /v1/detect for boxes", "unsupported")
        return await self.skill(request, "segment")

    async def chat(self, request: HTTPRequest) -> Response:
        md = self._model()
        body = await self._body(request)
        c = parse_chat(body, md.engine.max_context)
        image = None if c["image"] is None else await self._image(c["image"], "messages")
        call = self._submit(lambda: md._query(image, c["question"], c["reasoning"], None,
                                              c["stream"], c["settings"], False))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": self.config.model_name}
        if c["stream"]:
            return self._sse(request, call, self._chat_events(call, base, c["include_usage"]),
                             "chat")
        await self._finish(request, call)
        out = self._shape(call)
        h = call.handles[0]
        m = h.metrics()
        message = {"role": "assistant", "content": out["answer"]}
        if c["reasoning"] and out.get("reasoning"):
            message["reasoning"] = out["reasoning"]["text"]
            message["reasoning_details"] = {"grounding": out["reasoning"]["grounding"]}
        return JSONResponse({**base, "object": "chat.completion",
                             "choices": [{"index": 0, "message": message,
                                          "finish_reason": openai_finish(m["finish_reason"])}],
                             "usage": _usage(m)})

    async def _chat_events(self, call, base: dict, include_usage: bool):
        h = call.handles[0]
        chunk = {**base, "object": "chat.completion.chunk"}

        def delta(d, finish=None):
            return {**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

        yield delta({"role": "assistant", "content": ""})
        async for ev in self._text_events(call):
            if "reasoning" in ev:
                r = ev["reasoning"] or {}
                yield delta({"reasoning": r.get("text", ""),
                             "reasoning_details": {"grounding": r.get("grounding", [])}})
            elif not ev["completed"]:
                yield delta({"content": ev["chunk"]})
        m = h.metrics()
        yield delta({}, openai_finish(m["finish_reason"]))
        if include_usage:
            yield {**chunk, "choices": [], "usage": _usage(m)}
        yield "[DONE]"

    async def models(self, request: HTTPRequest) -> Response:
        md = self._model()
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": 0,
            "owned_by": "photon_jax", "family": md.config.family,
            "max_context": md.engine.max_context}]})

    async def health(self, request: HTTPRequest) -> Response:
        if self.md is not None and self.ready.is_set():
            return JSONResponse({"status": "ok", "model": self.config.model_name})
        if self.load_error is not None:
            return JSONResponse({"status": "error", "error": str(self.load_error)}, 503)
        return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "5"})

    async def prometheus(self, request: HTTPRequest) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


def _usage(m: dict) -> dict:
    p, c = m["input_tokens"] or 0, m["output_tokens"] or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _event(ev) -> str:
    return f"data: {ev if isinstance(ev, str) else json.dumps(ev)}\n\n"


async def _aclose(it) -> None:
    if hasattr(it, "aclose"):
        try:
            await it.aclose()
        except Exception:  # noqa: BLE001 - the stream's own error was reported already
            pass


async def _disconnected(request: HTTPRequest) -> None:
    """Returns once the client has closed the connection (the body was read already, so
    the next ASGI message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _cancel_when_gone(request: HTTPRequest, handles) -> None:
    await _disconnected(request)
    for h in handles:
        if not h.done():
            h.cancel()


def create_app(model, config: ServeConfig | None = None) -> Starlette:
    """The ASGI app serving `model`: a loaded `Moondream` (the caller keeps owning it), or a
    zero-argument function that loads one (called on a thread at start-up, closed at
    shutdown; /health is 503 until it returns).  `app.state.server` is the `Server`."""
    server = Server(model, config or ServeConfig())

    def wrap(name, handler):
        async def endpoint(request):
            return await server.route(request, name, handler)
        return endpoint

    def skill(name):
        return wrap(name, lambda r: server.skill(r, name))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(server.close)

    async def http_error(request, exc: HTTPException):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                        f"{exc.detail}", "not_found" if exc.status_code == 404 else
                        "invalid_request_error").response()

    async def prometheus(request):
        try:
            server._auth(request)
        except ApiError as e:
            return e.response()
        return await server.prometheus(request)

    routes = [Route(f"/v1/{n}", skill(n), methods=["POST"])
              for n in ("caption", "query", "detect", "point")]
    routes += [Route("/v1/segment", wrap("segment", server.segment), methods=["POST"]),
               Route("/v1/chat/completions", wrap("chat", server.chat), methods=["POST"]),
               Route("/v1/models", wrap("models", server.models), methods=["GET"]),
               Route("/health", server.health, methods=["GET"]),
               Route("/metrics", prometheus, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app


# -- command line ---------------------------------------------------------------------------
