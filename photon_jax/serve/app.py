"""`photon-serve`'s HTTP application for one loaded model (`pip install ".[serve]"`).

Owns: the Starlette app (`create_app`: routes, admission, streaming, cancellation); request
parsing lives in `inputs`, metrics in `metrics`, the command line in `photon_jax.cli.serve`.
Routes:

- Moondream's cloud API, as the `moondream` client (`md.vl(endpoint=".../v1")`) calls it:
  POST /v1/caption, /v1/query, /v1/detect, /v1/point, /v1/segment (Moondream 3 only);
  streams are server-sent events `data: {"chunk": ..., "completed": false}` ending with
  `"completed": true` (segment: the client's bbox / path_delta / final events).
- OpenAI's POST /v1/chat/completions (conversations: turns, up to 4 images, shapes,
  logprobs) and GET /v1/models.
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
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import aio
from ..api import EngineError, ImageError, RequestError
from .compat import normalize
from .fetch import RemoteImages
from .inputs import ApiError, Fields, bad, check_settings, openai_finish, parse_chat
from .intake import Intake
from .limits import ServerLimits
from .metrics import Metrics
from .trust import Gate, require_json

log = logging.getLogger("photon_jax.serve")

LENGTHS = ("short", "normal", "long")


@dataclass
class ServeConfig:
    """What the server enforces (the command line's flags)."""
    api_key: str | None = None          # X-Moondream-Auth or "Authorization: Bearer"
    max_body_bytes: int = 20 << 20      # 413 above; checked before the body is read
    max_queue: int = 256                # requests waiting beyond the batch; 429 above
    request_timeout: float | None = 600.0   # seconds; the request is cancelled after
    allow_remote_images: bool = False   # fetch http(s) image_url (capped at max_body_bytes)
    model_name: str = "moondream"       # /v1/models and the responses' "model"
    allowed_hosts: tuple = ()           # Host names answered without a key, beyond local ones
    allow_local_without_key: bool = False   # keyless loopback callers when a key is set
    allow_private_image_hosts: bool = False  # remote images from private/loopback addresses
    limits: ServerLimits = field(default_factory=ServerLimits)


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
        self.gate = Gate(config.api_key, config.allowed_hosts, config.allow_local_without_key)
        fetcher = RemoteImages(max_workers=config.limits.fetch_threads,
                               allow_private=config.allow_private_image_hosts) \
            if config.allow_remote_images else None
        self.intake = Intake(config.limits, config.max_body_bytes, fetcher)
        self.stopping = False                 # set by abort_all (shutdown)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
        self.intake.close()
        if self._owns and self.md is not None:
            self.md.close()   # finishes what is still running, frees the device

    @property
    def engine_failure(self) -> str | None:
        """Why the loaded model's engine stopped (None while it runs): /health's 503."""
        eng = getattr(self.md, "_engine", None)   # (None: not loaded yet, or closed)
        if eng is None:
            return None
        if eng.failure is not None:
            return f"the engine stopped after an error: {eng.failure!r}"
        if not eng.alive and not eng._closing:
            return "the engine's scheduler thread has stopped"
        return None

    def stop_event(self) -> asyncio.Event:
        if self._stop is None:
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            if self.stopping:
                self._stop.set()
        return self._stop

    def abort_all(self) -> None:
        """(Shutdown, on the event loop's thread.)  Every request still running is
        cancelled and answered: a JSON 503, or a stream's final error event."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()
        for h in list(self.live):
            if not h.done():
                h.cancel()

    @property
    def capacity(self) -> int:
        """Requests in flight before new ones are refused (429): the rows plus the queue."""
        rows = self.md.engine.max_batch_size if self.md is not None else 0
        return rows + self.config.max_queue

    # plumbing
    def _auth(self, request: HTTPRequest) -> None:
        self.gate.check(request)

    def _model(self):
        if self.md is None:
            if self.load_error is not None:
                raise ApiError(503, f"the model failed to load: {self.load_error}",
                               "server_error")
            raise ApiError(503, "the model is still loading; retry shortly (GET /health says "
                           "when it is ready)", "not_ready", headers={"Retry-After": "5"})
        return self.md

    async def _body(self, request: HTTPRequest, route: str):
        """(body, its reservation): JSON declared, admission checked before a byte is read,
        read and parsed by the intake, then the clients' spellings normalised."""
        require_json(request)
        if self.stopping:
            raise ApiError(503, "the server is shutting down; retry on another instance",
                           "server_error", headers={"Retry-After": "5"})
        self._admit()
        body, res = await self.intake.body(request)
        try:
            body, warnings = normalize(body, route)
        except ValueError as e:
            res.release()
            raise bad(str(e)) from None
        for w in warnings:
            log.warning("%s: %s", route, w)
        return body, res

    def _text(self, f: Fields, name: str, required: bool = False, what: str = "") -> str | None:
        """A string field, refused above max_text_chars before anything tokenizes it."""
        v = f.take(name, str, required=required, what=what)
        cap = self.config.limits.max_text_chars
        if v is not None and len(v) > cap:
            raise bad(f"{f.route}: field {name!r} has {len(v)} characters, more than the "
                      f"{cap}-character limit (--max-text-chars); send a shorter text", name)
        return v

    def _refs(self, f: Fields, what: str):
        refs = f.take("spatial_refs", list, what=what)
        if refs is not None and len(refs) > self.config.limits.max_spatial_refs:
            raise bad(f"{f.route}: {len(refs)} spatial_refs, more than "
                      f"{self.config.limits.max_spatial_refs}; send fewer", "spatial_refs")
        return refs

    async def _settings(self, md, settings, param: str | None = "settings") -> None:
        """Check settings and compile their output shape on the intake's pool: a large
        schema compiles for up to ~0.2 s, which must not hold the event loop."""
        if not settings:
            return
        v = settings.get("variant")
        if v not in (None, "") and isinstance(v, str) and v not in md.engine.adapters:
            # Never fetched on a client's word (a download, disk and a slot per id): the
            # server runs the adapters it was started with.
            raise bad(f"variant {v[:80]!r} is not loaded on this server; loaded: "
                      f"{md.adapters[:20]} (start it with --adapter NAME=PATH)",
                      param or "variant")
        try:
            await asyncio.get_running_loop().run_in_executor(self.intake.pool,
                                                             md.check_settings, settings)
        except (ValueError, RequestError) as e:
            raise bad(str(e), param) from None

    async def _image(self, md, url, param: str, held: list):
        prep, res = await self.intake.image(md, url, param, self.config.allow_remote_images)
        held.append(res)
        return prep

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (counted from the handles, so a response that
        never ran its body cannot leak a slot)."""
        self.live = {h for h in self.live if not h.done()}
        return len(self.live)

    def _admit(self) -> None:
        if self.in_flight + self.intake.reading >= self.capacity:
            raise ApiError(429, f"server busy: {self.in_flight} requests in flight (rows + "
                           f"--max-queue {self.config.max_queue}); retry after a moment",
                           "rate_limit_error", headers={"Retry-After": "1"})

    def _submit(self, make, held=()):
        """`make()` -> the API's `_Call` (submits at once); ValueErrors are the client's.
        `held`: reservations released when the call's requests finish."""
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
            for r in held:
                h.add_done_callback(r.release)
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
        stop = asyncio.ensure_future(self.stop_event().wait())
        try:
            done, _ = await asyncio.wait({work, gone, stop},
                                         timeout=self.config.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            stop.cancel()
            if not work.done():
                work.cancel()   # -> handle.cancel() for each
        if stop in done or (work in done and self.stopping and
                            any(h.cancel_requested for h in call.handles)):
            raise SHUTDOWN   # (a request that finished by itself keeps its answer)
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
            stop = self.stop_event()
            it = events.__aiter__()
            try:
                while True:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        ev = await _next_or_stop(it, stop, left)
                    except StopAsyncIteration:
                        break
                    except _Stopped:
                        yield _event({"error": {"message": SHUTDOWN.message,
                                                "type": SHUTDOWN.kind}, "completed": True})
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

    async def _text_events(self, call, h=None):
        """Moondream's stream events: {"chunk", "completed": false} per piece, then
        {"completed": true, "finish_reason", "usage"}; errors as an "error" event.  `h`: the
        call's handle to follow (default its first).  A request with settings "logprobs":
        each event also carries "logprobs", the entries of the tokens since the last."""
        h = call.handles[0] if h is None else h
        if h.request.reasoning:
            try:
                reasoning = await aio.reasoning(h)
            except Exception as e:  # noqa: BLE001
                raise self._result_error(e) from None
            yield {"reasoning": reasoning, "completed": False}
        scored = h.request.settings.logprobs is not None

        def event(ev):   # with the entries of the tokens committed since the last event
            return {**ev, "logprobs": h.take_logprobs()} if scored else ev

        stream = aio.text_stream(h)
        try:
            async for piece in stream:
                yield event({"chunk": piece, "completed": False})
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._result_error(e) from None
        finally:
            await stream.aclose()
        m = h.metrics()
        yield event({"chunk": "", "completed": True, "finish_reason": m["finish_reason"],
                     "usage": _usage(m)})

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
        body, res = await self._body(request, route)
        held = []
        try:
            call, stream = await self._skill_call(md, body, route, held)
        except BaseException:
            for r in held:
                r.release()
            raise
        finally:
            res.release()   # the body's bytes: parsed, decoded and handed on by now
        if stream:
            events = self._segment_events(call) if route == "segment" else \
                self._text_events(call)
            return self._sse(request, call, events, route)
        await self._finish(request, call)
        return JSONResponse(self._shape(call))

    async def _skill_call(self, md, body: dict, route: str, held: list):
        """Every field checked first, then the image decoded, then the request submitted:
        -> (the API's call, stream?)."""
        f = Fields(body, route)
        model = f.take("model", str, what="a string: this server's model, or "
                       "<model>@<adapter> / <adapter> for a loaded adapter")
        stream = f.take("stream", bool, False, what="true or false")
        settings = check_settings(f.take("settings", dict, what="an object"),
                                  md.engine.max_context)
        settings = self._with_variant(md, model, settings, route)
        await self._settings(md, settings)
        url = f.take("image_url", str, required=route != "query",
                     what="a data:image/...;base64,... URI")
        if route == "query":
            question = self._text(f, "question", required=True, what="a non-empty string")
            reasoning = f.take("reasoning", bool, False, what="true or false")
            refs = self._refs(f, "a list of [x, y] points and [x_min, y_min, x_max, y_max] "
                              "boxes")
            f.done()
            image = None if url is None else await self._image(md, url, "image_url", held)
            return self._submit(lambda: md._query(image, question, reasoning, refs, stream,
                                                  settings, False), held), stream
        if route == "caption":
            length = f.take("length", str, "normal", what=f"one of {list(LENGTHS)}")
            if length not in LENGTHS:
                raise bad(f"caption: length must be one of {list(LENGTHS)}, got "
                          f"{length!r}", "length")
            f.done()
            image = await self._image(md, url, "image_url", held)
            return self._submit(lambda: md._caption(image, length, stream, settings, False),
                                held), stream
        obj = self._text(f, "object", required=True, what="a non-empty string")
        refs = None
        if route == "segment":
            refs = self._refs(f, "a list of points and boxes")
        elif f.body.get("spatial_refs") is not None:
            raise bad(f"{route} does not take spatial_refs (the model points or detects the "
                      "named object in the whole image); drop the field, or ask with "
                      "/v1/query, which does", "spatial_refs")
        f.take("spatial_refs", list)
        f.done()
        if stream and route != "segment":
            raise bad(f"{route} does not stream; send stream false", "stream")
        image = await self._image(md, url, "image_url", held)
        if route == "segment":
            return self._submit(lambda: md._segment(image, obj, refs, settings, False),
                                held), stream
        key = "objects" if route == "detect" else "points"
        return self._submit(lambda: md._locate(route, key, image, obj, settings, False),
                            held), stream

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
        body, res = await self._body(request, "chat")
        held = []
        try:
            c = parse_chat(body, md.engine.max_context)
            model = body.get("model")
            c["settings"] = self._with_variant(md, model if isinstance(model, str) else None,
                                               c["settings"], "chat/completions")
            await self._settings(md, c["settings"], None)
            cap = self.config.limits.max_text_chars
            if c["text_chars"] > cap:
                raise bad(f"chat/completions: the messages' text has {c['text_chars']} "
                          f"characters, more than the {cap}-character limit "
                          "(--max-text-chars); send a shorter conversation", "messages")
            messages = c["messages"]
            for n, k, url in c["images"]:
                # The decoded image replaces its URL part (copies: the body stays as sent).
                image = await self._image(md, url, "messages", held)
                messages = list(messages)
                msg = dict(messages[n])
                parts = list(msg["content"])
                parts[k] = {"type": "image", "image": image}
                msg["content"] = parts
                messages[n] = msg
            call = self._submit(lambda: md._chat(messages, c["reasoning"], c["stream"],
                                                 c["settings"], False, c["n"]), held)
        except BaseException:
            for r in held:
                r.release()
            raise
        finally:
            res.release()
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        variant = (c["settings"] or {}).get("variant")
        base = {"id": rid, "created": created, "model": self.config.model_name + (
            f"@{variant}" if variant else "")}
        if c["stream"]:
            return self._sse(request, call, self._chat_events(call, base, c["include_usage"]),
                             "chat")
        await self._finish(request, call)
        choices, done = [], 0
        for i, h in enumerate(call.handles):
            try:
                out = call.shape(h)
            except Exception as e:  # noqa: BLE001 - mapped to a status
                raise self._result_error(e) from None
            m = h.metrics()
            done += m["output_tokens"] or 0
            choice = {"index": i, "message": out["message"],
                      "finish_reason": openai_finish(m["finish_reason"])}
            if "logprobs" in out:
                choice["logprobs"] = {"content": out["logprobs"], "refusal": None}
            choices.append(choice)
        usage = _usage({**call.handles[0].metrics(), "output_tokens": done})
        return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                             "usage": usage})

    async def _chat_events(self, call, base: dict, include_usage: bool):
        """OpenAI chunks of every answer of the call (n > 1: each choice's chunks carry its
        index, interleaved as the answers' pieces arrive; they decode in one batch)."""
        chunk = {**base, "object": "chat.completion.chunk"}

        def delta(i, d, finish=None, logprobs=None):
            choice = {"index": i, "delta": d, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = {"content": logprobs, "refusal": None}
            return {**chunk, "choices": [choice]}

        async def one(i, h):
            yield delta(i, {"role": "assistant", "content": ""})
            async for ev in self._text_events(call, h):
                if "reasoning" in ev:
                    r = ev["reasoning"] or {}
                    d = {"reasoning": r.get("text", "")}
                    if r.get("grounding"):
                        d["reasoning_details"] = {"grounding": r["grounding"]}
                    yield delta(i, d)
                elif not ev["completed"]:
                    yield delta(i, {"content": ev["chunk"]}, logprobs=ev.get("logprobs"))
                elif ev.get("logprobs"):   # tokens whose text came with none of the pieces
                    yield delta(i, {"content": ""}, logprobs=ev["logprobs"])
            yield delta(i, {}, openai_finish(h.metrics()["finish_reason"]))

        async for ev in _merged([one(i, h) for i, h in enumerate(call.handles)]):
            yield ev
        if include_usage:
            done = sum(h.metrics()["output_tokens"] or 0 for h in call.handles)
            yield {**chunk, "choices": [],
                   "usage": _usage({**call.handles[0].metrics(), "output_tokens": done})}
        yield "[DONE]"

    def _with_variant(self, md, model: str | None, settings: dict | None,
                      route: str) -> dict | None:
        """The request's settings with the adapter its `model` field names, if it names
        one: "<model>@<adapter>" or a loaded adapter's name (any other name is this
        server's one model, as OpenAI clients send their own defaults)."""
        name = self.config.model_name
        if model is None or model == name:
            return settings
        if model.startswith(name + "@"):
            adapter = model[len(name) + 1:]
        elif model in md.engine.adapters:
            adapter = model
        else:
            return settings
        have = (settings or {}).get("variant")
        if have not in (None, "", adapter):
            raise bad(f"{route}: model {model!r} and settings variant {have!r} name different "
                      "adapters; send one", "model")
        return {**(settings or {}), "variant": adapter}

    def _model_card(self, md, adapter: str | None = None) -> dict:
        card = {"id": self.config.model_name, "object": "model", "created": 0,
                "owned_by": "photon_jax", "family": md.config.family,
                "max_context": md.engine.max_context}
        if adapter is not None:
            card.update(id=f"{self.config.model_name}@{adapter}", adapter=adapter,
                        parent=self.config.model_name)
        return card

    async def models(self, request: HTTPRequest) -> Response:
        """The model, then each loaded LoRA adapter as "<model>@<adapter>"."""
        md = self._model()
        return JSONResponse({"object": "list", "data": [self._model_card(md)] + [
            self._model_card(md, a) for a in md.adapters]})

    async def model(self, request: HTTPRequest) -> Response:
        """GET /v1/models/{id} (the OpenAI SDK's models.retrieve)."""
        md = self._model()
        mid = request.path_params["model_id"]
        name = self.config.model_name
        if mid == name:
            return JSONResponse(self._model_card(md))
        adapter = mid[len(name) + 1:] if mid.startswith(name + "@") else None
        if adapter in md.engine.adapters:
            return JSONResponse(self._model_card(md, adapter))
        raise ApiError(404, f"model {mid!r} is not served here; this server runs {name!r} "
                       f"and its adapters {md.adapters[:20]} (GET /v1/models)", "not_found",
                       "model")

    async def health(self, request: HTTPRequest) -> Response:
        failure = self.engine_failure
        if failure is not None:
            return JSONResponse({"status": "error", "error": failure}, 503)
        if self.stopping:
            return JSONResponse({"status": "stopping"}, 503)
        if self.md is not None and self.ready.is_set():
            return JSONResponse({"status": "ok", "model": self.config.model_name})
        if self.load_error is not None:
            return JSONResponse({"status": "error", "error": str(self.load_error)}, 503)
        return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "5"})

    async def prometheus(self, request: HTTPRequest) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


SHUTDOWN = ApiError(503, "the server is shutting down and cancelled this request; retry on "
                    "another instance", "server_error", headers={"Retry-After": "5"})


class _Stopped(Exception):
    """The server began its shutdown while a stream was waiting for its next event."""


async def _next_or_stop(it, stop: asyncio.Event, timeout: float | None):
    """The stream's next event, or _Stopped once `stop` is set, or asyncio.TimeoutError."""
    nxt = asyncio.ensure_future(it.__anext__())
    halt = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({nxt, halt}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
    if nxt in done and halt not in done:
        return nxt.result()
    nxt.cancel()   # (shutdown wins a tie: the event may be the cancellation's own end)
    with contextlib.suppress(BaseException):
        await nxt
    if halt in done:
        raise _Stopped
    raise asyncio.TimeoutError


def _usage(m: dict) -> dict:
    p, c = m["input_tokens"] or 0, m["output_tokens"] or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": m.get("cached_tokens") or 0}}


async def _merged(gens: list):
    """The items of several async generators as each arrives (one: itself).  An error in one
    ends the merge with that error; the others are closed."""
    if len(gens) == 1:
        async for x in gens[0]:
            yield x
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g):
        try:
            async for x in g:
                await queue.put((x, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((None, e))
        finally:
            await queue.put((done, None))

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            x, err = await queue.get()
            if err is not None:
                raise err
            if x is done:
                left -= 1
            else:
                yield x
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await _aclose(g)


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
               Route("/v1/models/{model_id:path}", wrap("models", server.model),
                     methods=["GET"]),
               Route("/health", server.health, methods=["GET"]),
               Route("/metrics", prometheus, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app


# -- command line ---------------------------------------------------------------------------
