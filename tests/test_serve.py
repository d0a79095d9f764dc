"""`photon-serve` over loopback on the fixture model: the moondream client's calls and
OpenAI chat completions equal the in-process API, every bad input gets its 4xx JSON error
(and the server keeps answering), auth, backpressure, body limits, metrics, and a client
that goes away (or a timeout) cancels its request.  One server for the module, on
127.0.0.1 only; every wait is bounded."""

import base64
import io
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import moondream   # the published client: README's setup installs it (pip --no-deps)
import pytest
import uvicorn
from PIL import Image

from photon_jax import Moondream
from photon_jax.serve.app import create_app, ServeConfig

from helpers import FIXTURE_DIR, in_threads

LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
SQ = os.path.join(FIXTURE_DIR, "img_sq378.png")
KEY = "test-key-1234"
S = {"temperature": 0, "max_tokens": 10}
OBJ = {"max_objects": 3}
SLOW = {"temperature": 50, "top_p": 1, "max_tokens": 1000}   # rarely samples EOS


def data_uri(path: str) -> str:
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode()


def uri_bytes(uri: str) -> bytes:
    return base64.b64decode(uri.split(",", 1)[1])


class Live:
    """The module's server: its base URL, app state and model."""

    def __init__(self, md, tiny_ckpt):
        self.md = md
        self.app = create_app(md, ServeConfig(api_key=KEY, max_body_bytes=2 << 20,
                                              max_queue=64, request_timeout=60,
                                              model_name="tiny"))
        self.state = self.app.state.server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture(scope="module")
def live(tiny_ckpt):
    with Moondream.load(tiny_ckpt, max_batch_size=8) as md:
        srv = Live(md, tiny_ckpt)
        try:
            yield srv
        finally:
            srv.stop()


def call(live, path, body=None, key=KEY, method=None, raw=None, headers=None, timeout=60):
    """-> (status, headers, parsed JSON or text)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["X-Moondream-Auth"] = key
    req = urllib.request.Request(live.url + path, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return status, hdrs, text


def sse(text: str) -> list:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def client(live):
    return moondream.vl(api_key=KEY, endpoint=live.url + "/v1")


# -- the moondream client ------------------------------------------------------------------

def test_moondream_client_equals_the_api(live, client):
    md = live.md
    img = Image.open(LAND)
    jpeg = uri_bytes(client.encode_image(img).image_url)   # what the client sends
    assert client.caption(img, "short", settings=S) == md.caption(jpeg, "short", settings=S)
    assert client.query(img, "What is this?", settings=S) == \
        md.query(jpeg, "What is this?", settings=S)
    refs = [[0.5, 0.5], [0.1, 0.1, 0.4, 0.3]]
    assert client.query(img, "Why?", reasoning=True, spatial_refs=refs, settings=S) == \
        md.query(jpeg, "Why?", reasoning=True, spatial_refs=refs, settings=S)
    assert client.query(None, "Hello?", settings=S) == md.query(None, "Hello?", settings=S)
    assert client.detect(img, "w42", settings=OBJ) == md.detect(jpeg, "w42", settings=OBJ)
    assert client.point(img, "w42", settings=OBJ) == md.point(jpeg, "w42", settings=OBJ)
    want = md.caption(jpeg, "normal", settings=S)["caption"]
    assert "".join(client.caption(img, stream=True, settings=S)["caption"]) == want
    want = md.query(jpeg, "What?", settings=S)["answer"]
    assert "".join(client.query(img, "What?", stream=True, settings=S)["answer"]) == want


def test_moondream_client_chat(live, client):
    img_uri = client.encode_image(Image.open(SQ)).image_url
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": img_uri}}]}]
    want = live.md.query(uri_bytes(img_uri), "What is this?", settings=S)["answer"]
    out = client.chat(msgs, settings=S, reasoning=False)
    assert out["message"]["content"] == want and out["finish_reason"] in ("stop", "length")
    assert "".join(client.chat(msgs, stream=True, settings=S, reasoning=False)["message"]) \
        == want
    # Without `reasoning`, the model's default (on, as kestrel's chat): the answer follows
    # the reasoning.
    want = live.md.query(uri_bytes(img_uri), "What is this?", reasoning=True, settings=S)
    out = client.chat(msgs, settings=S)
    assert out["message"]["content"] == want["answer"]
    assert out["message"]["reasoning"] == want["reasoning"]["text"]
    # A conversation: a system prompt and a follow-up turn.
    convo = [{"role": "system", "content": "Be brief."}] + msgs + [
        {"role": "assistant", "content": out["message"]["content"]},
        {"role": "user", "content": "And the colour?"}]
    again = client.chat(convo, settings=S, reasoning=False)
    assert again["message"]["content"] == live.md.chat(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                      {"type": "image", "image": uri_bytes(img_uri)}]},
         *convo[2:]], reasoning=False, settings=S)["message"]["content"]


# -- the same routes over plain HTTP (CI runs these without the client) --------------------

def test_routes_equal_the_api(live):
    md, uri = live.md, data_uri(LAND)
    png = uri_bytes(uri)
    st, _, out = call(live, "/v1/caption", {"image_url": uri, "length": "short", "settings": S})
    assert st == 200 and out == md.caption(png, "short", settings=S)
    st, _, out = call(live, "/v1/query", {"image_url": uri, "question": "Why?", "reasoning": True,
                                          "settings": S})
    assert st == 200 and out == md.query(png, "Why?", reasoning=True, settings=S)
    st, _, out = call(live, "/v1/detect", {"image_url": uri, "object": "w42", "settings": OBJ})
    assert st == 200 and out == md.detect(png, "w42", settings=OBJ)
    st, _, out = call(live, "/v1/point", {"image_url": uri, "object": "w42", "settings": OBJ})
    assert st == 200 and out == md.point(png, "w42", settings=OBJ)
    st, hdrs, text = call(live, "/v1/caption", {"image_url": uri, "stream": True, "settings": S})
    assert st == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = sse(text)
    assert all(not e["completed"] for e in events[:-1]) and events[-1]["completed"]
    assert "".join(e["chunk"] for e in events) == md.caption(png, settings=S)["caption"]
    assert events[-1]["usage"]["completion_tokens"] >= 1
    # A body over 1 MiB (noise PNG): parsed and decoded off the event loop, same answer.
    import numpy as np
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (600, 640, 3), np.uint8)).save(
        buf, "PNG")
    big = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert len(big) > 1 << 20
    st, _, out = call(live, "/v1/caption", {"image_url": big, "length": "short", "settings": S})
    assert st == 200 and out == md.caption(buf.getvalue(), "short", settings=S)
    # A streamed reasoning query: the reasoning first (the client skips it), then the answer.
    st, _, text = call(live, "/v1/query", {"image_url": uri, "question": "Why?",
                                           "reasoning": True, "stream": True, "settings": S})
    events = sse(text)
    want = md.query(png, "Why?", reasoning=True, settings=S)
    assert events[0] == {"reasoning": want["reasoning"], "completed": False}
    assert "".join(e.get("chunk", "") for e in events) == want["answer"]


def test_concurrent_requests_share_the_engine(live):
    md, uri = live.md, data_uri(SQ)
    want = md.caption(uri_bytes(uri), "short", settings=S)
    outs = in_threads(lambda: call(live, "/v1/caption", {"image_url": uri, "length": "short",
                                                         "settings": S})[2], 12, timeout=120)
    assert outs == [want] * 12


def test_chat_completions(live):
    md, uri = live.md, data_uri(SQ)
    want = md.query(uri_bytes(uri), "What is this?", settings=S, return_metrics=True)
    body = {"model": "anything", "max_completion_tokens": 10, "temperature": 0,
            "reasoning": False, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": uri}}]}]}
    st, _, out = call(live, "/v1/chat/completions", body, key=None,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert st == 200, out
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    ch = out["choices"][0]
    assert ch["message"] == {"role": "assistant", "content": want["answer"]}
    assert ch["finish_reason"] == ("length" if want["metrics"]["finish_reason"] == "length"
                                   else "stop")
    assert out["usage"]["prompt_tokens"] == want["metrics"]["input_tokens"]
    assert out["usage"]["completion_tokens"] == want["metrics"]["output_tokens"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == md.config.prefix_len
    # reasoning (the moondream client's chat passes it): the reasoning text and grounding.
    st, _, out = call(live, "/v1/chat/completions", {**body, "reasoning": True})
    want_r = md.query(uri_bytes(uri), "What is this?", reasoning=True, settings=S)
    msg = out["choices"][0]["message"]
    assert msg["content"] == want_r["answer"]
    assert msg["reasoning"] == want_r["reasoning"]["text"]
    g = want_r["reasoning"]["grounding"]   # kestrel's message: details only with grounding
    assert msg.get("reasoning_details") == ({"grounding": g} if g else None)
    # max_tokens (the older name) and a plain-string, text-only message.
    st, _, out = call(live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 10,
        "temperature": 0, "reasoning": False})
    assert out["choices"][0]["message"]["content"] == \
        md.query(None, "Hello?", settings=S)["answer"]
    # n answers (seeds seed + i), and a stop string.
    st, _, out = call(live, "/v1/chat/completions", {**body, "n": 3, "temperature": 1.0,
                                                     "seed": 7})
    assert st == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    for i, ch in enumerate(out["choices"]):
        assert ch["message"]["content"] == md.query(
            uri_bytes(uri), "What is this?",
            settings={**S, "temperature": 1.0, "seed": 7 + i})["answer"]
    full = want["answer"].split(" ")
    st, _, out = call(live, "/v1/chat/completions", {**body, "stop": [" " + full[1]]})
    assert out["choices"][0]["message"]["content"] == full[0]
    assert out["choices"][0]["finish_reason"] == "stop"
    # Two images: the first turn's and a later turn's (a block inside the prompt).
    land = data_uri(LAND)
    convo = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": land}},
                                          {"type": "text", "text": "w9"}]},
             {"role": "assistant", "content": "w41"},
             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                          {"type": "text", "text": "What is this?"}]}]
    st, _, out = call(live, "/v1/chat/completions", {**body, "messages": convo})
    assert st == 200, out
    assert out["choices"][0]["message"]["content"] == md.chat(
        [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
            {"type": "image", "image": uri_bytes(p["image_url"]["url"])}
            if p["type"] == "image_url" else p for p in m["content"]]} for m in convo],
        reasoning=False, settings=S)["message"]["content"]
    # Streaming: OpenAI chunks, then usage (asked for), then [DONE].
    st, _, text = call(live, "/v1/chat/completions",
                       {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse(text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert content == want["answer"]
    assert events[-3]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] >= 1
    # n = 3 streamed: each choice's chunks carry its index (interleaved as they arrive),
    # its text the answer of seed + i, each closed by its finish reason; usage counts all.
    st, _, text = call(live, "/v1/chat/completions",
                       {**body, "n": 3, "temperature": 1.0, "seed": 7, "stream": True,
                        "stream_options": {"include_usage": True}})
    events = sse(text)
    assert st == 200 and events[-1] == "[DONE]"
    per = {i: [] for i in range(3)}
    finishes = {}
    for e in events[:-2]:
        (ch,) = e["choices"]
        per[ch["index"]].append(ch["delta"].get("content", ""))
        if ch["finish_reason"] is not None:
            finishes[ch["index"]] = ch["finish_reason"]
    answers = [md.query(uri_bytes(uri), "What is this?",
                        settings={**S, "temperature": 1.0, "seed": 7 + i},
                        return_metrics=True) for i in range(3)]
    assert ["".join(per[i]) for i in range(3)] == [a["answer"] for a in answers]
    assert sorted(finishes) == [0, 1, 2]
    assert events[-2]["usage"]["completion_tokens"] == sum(
        a["metrics"]["output_tokens"] for a in answers)


def test_chat_completions_logprobs(live):
    """OpenAI's logprobs / top_logprobs: the answer tokens' entries, as the API gives them,
    in the choice (and, streamed, spread over the chunks in token order); Moondream's
    /v1/query streams them in its events."""
    md, uri = live.md, data_uri(SQ)
    body = {"max_completion_tokens": 8, "temperature": 0, "reasoning": False,
            "logprobs": True, "top_logprobs": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "What is this?"}]}]}
    want = md.query(uri_bytes(uri), "What is this?", settings={**S, "logprobs": 2})
    st, _, out = call(live, "/v1/chat/completions", body)
    assert st == 200, out
    ch = out["choices"][0]
    assert ch["message"]["content"] == want["answer"]
    assert ch["logprobs"] == {"content": want["logprobs"], "refusal": None}
    assert [len(e["top_logprobs"]) for e in want["logprobs"]] == [2] * len(want["logprobs"])
    st, _, text = call(live, "/v1/chat/completions", {**body, "stream": True})
    events = sse(text)[:-1]
    got = [e for ev in events for e in (ev["choices"][0].get("logprobs") or {}).get(
        "content", [])]
    assert got == want["logprobs"]
    # Without logprobs, no "logprobs" key (the response is as before).
    st, _, out = call(live, "/v1/chat/completions", {**body, "logprobs": None,
                                                     "top_logprobs": None})
    assert "logprobs" not in out["choices"][0]
    # Moondream's route: settings.logprobs, in the result and in the stream's events.
    q = {"image_url": uri, "question": "What is this?", "settings": {**S, "logprobs": 1}}
    st, _, out = call(live, "/v1/query", q)
    assert st == 200 and [e["id"] for e in out["logprobs"]] == \
        [e["id"] for e in want["logprobs"]]
    st, _, text = call(live, "/v1/query", {**q, "stream": True})
    assert [e["id"] for ev in sse(text) for e in ev.get("logprobs", [])] == \
        [e["id"] for e in want["logprobs"]]
    # Refused by name.
    for bad_body, param in (({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
                            ({"top_logprobs": 21}, "top_logprobs"),
                            ({"logprobs": "yes"}, "logprobs")):
        st, _, out = call(live, "/v1/chat/completions", {**body, **bad_body})
        assert st == 400 and out["error"]["param"] == param, out
    st, _, out = call(live, "/v1/detect", {"image_url": uri, "object": "w3",
                                          "settings": {"logprobs": 1}})
    assert st == 400 and "logprobs" in out["error"]["message"], out


def test_models_health_metrics(live):
    st, _, out = call(live, "/v1/models")
    assert st == 200 and out["data"][0]["id"] == "tiny" and out["object"] == "list"
    st, _, out = call(live, "/health", key=None)
    assert st == 200 and out["status"] == "ok"
    st, _, _ = call(live, "/metrics", key=None)
    assert st == 401
    st, hdrs, text = call(live, "/metrics")
    assert st == 200 and hdrs["content-type"].startswith("text/plain")
    for name in ("photon_requests_total{", "photon_prompt_tokens_total",
                 "photon_output_tokens_total", "photon_queue_depth", "photon_running_rows",
                 "photon_kv_pages_in_use", "photon_prefix_cache_hits",
                 "photon_time_to_first_token_seconds_bucket",
                 "photon_time_per_output_token_seconds_bucket"):
        assert name in text, name
    assert 'route="caption",status="200"' in text


def test_health_is_503_until_the_model_is_loaded():
    import asyncio

    from photon_jax.serve.app import Server
    gate, model = threading.Event(), object()
    srv = Server(lambda: gate.wait(30) and model, ServeConfig())
    assert asyncio.run(srv.health(None)).status_code == 503
    t = srv.start_loading()
    assert asyncio.run(srv.health(None)).status_code == 503
    gate.set()
    t.join(30)
    assert srv.md is model and asyncio.run(srv.health(None)).status_code == 200


# -- bad inputs: a 4xx JSON error each, and the server keeps serving -----------------------

def _bomb_png() -> bytes:
    """A tiny PNG whose header claims 20000 x 10000 pixels (above the API's limit): it must
    be refused from the header, before any decoding."""
    import struct
    import zlib
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, "PNG")
    png = bytearray(buf.getvalue())
    ihdr = png[12:29]   # type + data of the first chunk (IHDR)
    ihdr[4:12] = struct.pack(">II", 20000, 10000)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(png)


BAD = [
    ("malformed json", "/v1/caption", b"{not json", 400, "not valid JSON"),
    ("array body", "/v1/caption", [1, 2], 400, "JSON object"),
    ("missing image", "/v1/caption", {"length": "short"}, 400, "image_url"),
    ("image not str", "/v1/caption", {"image_url": 5}, 400, "image_url"),
    ("bad length", "/v1/caption", {"image_url": "IMG", "length": "huge"}, 400, "length"),
    ("stream not bool", "/v1/caption", {"image_url": "IMG", "stream": "yes"}, 400, "stream"),
    ("unknown field", "/v1/caption", {"image_url": "IMG", "lenght": "short"}, 400, "lenght"),
    ("unknown setting", "/v1/caption", {"image_url": "IMG", "settings": {"temprature": 0}},
     400, "temprature"),
    ("settings not dict", "/v1/caption", {"image_url": "IMG", "settings": [1]}, 400,
     "settings"),
    ("max_tokens over context", "/v1/caption",
     {"image_url": "IMG", "settings": {"max_tokens": 10 ** 6}}, 400, "context"),
    ("missing question", "/v1/query", {"image_url": "IMG"}, 400, "question"),
    ("empty question", "/v1/query", {"image_url": "IMG", "question": " "}, 400, "question"),
    ("missing object", "/v1/detect", {"image_url": "IMG"}, 400, "object"),
    ("detect stream", "/v1/detect", {"image_url": "IMG", "object": "x", "stream": True}, 400,
     "stream"),
    ("bad spatial refs", "/v1/query", {"image_url": "IMG", "question": "q",
                                       "spatial_refs": [[1, 2, 3]]}, 400, "spatial"),
    ("remote url", "/v1/caption", {"image_url": "http://example.com/a.png"}, 400,
     "allow-remote-images"),
    ("not a data uri", "/v1/caption", {"image_url": "/etc/passwd"}, 400, "data URI"),
    ("not an image uri", "/v1/caption", {"image_url": "data:text/plain;base64,aGk="}, 400,
     "not an image"),
    ("bad base64", "/v1/caption", {"image_url": "data:image/png;base64,@@@"}, 400, "base64"),
    ("undecodable image", "/v1/caption",
     {"image_url": "data:image/png;base64," + base64.b64encode(b"hello" * 50).decode()}, 400,
     "not an image"),
    ("decompression bomb", "/v1/caption", {"image_url": "BOMB"}, 400, "too large"),
    ("segment on md2", "/v1/segment", {"image_url": "IMG", "object": "x"}, 400,
     "Moondream 3"),
    ("unknown route", "/v1/nothing", {}, 404, "Not Found"),
    ("chat: ends with the assistant", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     400, "last message must be from the user"),
    ("chat: system only", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "a"}]}, 400, "last message"),
    ("chat: system later", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                   {"role": "user", "content": "c"}]}, 400, "system message must be the first"),
    ("chat: five images", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "IMG"}}] * 5
         + [{"type": "text", "text": "q"}]}]}, 400, "at most 4"),
    ("chat: response_format unknown", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}], "response_format": {"type": "xml"}},
     400, "response_format type"),
    ("chat: json_schema without schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "schema"),
    ("chat: json on a word-level tokenizer", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}],
      "response_format": {"type": "json_object"}}, 400, "byte-level tokenizer"),
    ("chat: three images past the context", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "IMG"}}] * 3
         + [{"type": "text", "text": "q"}]}]}, 400, "exceeds the context"),
    ("chat: tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("chat: no messages", "/v1/chat/completions", {"model": "x"}, 400, "messages"),
    ("chat: n=9", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}], "n": 9}, 400, "n must be an integer"),
    ("chat: more messages than context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": ""}] * 5000}, 400, "cannot fit"),
    ("query: a shape this tokenizer cannot hold", "/v1/query",
     {"question": "q", "settings": {"regex": "[a-z]+"}}, 400, "byte-level tokenizer"),
    ("query: a bad schema", "/v1/query",
     {"question": "q", "settings": {"json_schema": "{}"}}, 400, "JSON schema object"),
    ("chat: five stops", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}], "stop": ["a"] * 5}, 400, "stop"),
    ("chat: max tokens over context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "q"}], "max_tokens": 10 ** 6}, 400, "context"),
    ("chat: audio part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]}, 400, "unsupported content part"),
]


def test_bad_inputs_get_4xx_json_and_the_server_keeps_serving(live):
    img, bomb = data_uri(SQ), "data:image/png;base64," + base64.b64encode(_bomb_png()).decode()

    def fill(x):
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return {"IMG": img, "BOMB": bomb}.get(x, x) if isinstance(x, str) else x

    for name, path, body, status, words in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(fill(body)).encode()
        st, _, out = call(live, path, raw=raw)
        assert st == status, (name, st, out)
        assert isinstance(out, dict) and words in out["error"]["message"], (name, out)
        assert out["error"]["type"], name
    uri = data_uri(LAND)
    st, _, out = call(live, "/v1/caption", {"image_url": uri, "length": "short", "settings": S})
    assert st == 200 and out == live.md.caption(uri_bytes(uri), "short", settings=S)


def test_auth(live):
    body = {"image_url": data_uri(SQ), "length": "short", "settings": S}
    for key, hdrs in ((None, {}), ("wrong", {}), (None, {"Authorization": "Bearer nope"})):
        st, h, out = call(live, "/v1/caption", body, key=key, headers=hdrs)
        assert st == 401 and out["error"]["type"] == "authentication_error"
    st, _, _ = call(live, "/v1/caption", body, key=None,
                    headers={"Authorization": f"Bearer {KEY}"})
    assert st == 200


def _raw(live, head: bytes, body_chunks=(), timeout=20) -> bytes:
    """Send raw bytes on a loopback socket -> the response's bytes (until close/timeout)."""
    s = socket.create_connection(("127.0.0.1", live.port), timeout=timeout)
    try:
        s.sendall(head)
        for c in body_chunks:
            s.sendall(c)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < 20:
            got = s.recv(65536)
            if not got:
                break
            data += got
        return data
    finally:
        s.close()


def test_body_limit_refused_before_reading(live):
    # Content-Length says 50 MB and no body is sent: refused at once, from the header.
    head = (f"POST /v1/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Moondream-Auth: {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n").encode()
    out = _raw(live, head)
    assert out.startswith(b"HTTP/1.1 413") and b"--max-body-mb" in out
    # Chunked, no length: counted while streaming, refused once past the limit.
    head = (f"POST /v1/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Moondream-Auth: {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"x" * (1 << 20)
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    out = _raw(live, head, [frame] * 3)
    assert out.startswith(b"HTTP/1.1 413")


def _slow(live):
    """Slow the engine down (a burnt 20 ms per step) and record its handles."""
    eng, seen = live.md.engine, []
    real = eng.submit_many

    def spy(reqs):
        hs = real(reqs)
        seen.extend(hs)
        return hs

    eng.submit_many, eng.host_work_s = spy, 0.02

    def undo():
        del eng.submit_many
        eng.host_work_s = 0.0
    return seen, undo


def _until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _post_raw(live, body: dict) -> socket.socket:
    """A POST /v1/caption on a raw socket left open (the test closes it to walk away)."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Moondream-Auth: {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    s = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    s.sendall(head.encode() + data)
    return s


def test_disconnect_cancels_and_backpressure(live):
    seen, undo = _slow(live)
    state, eng = live.state, live.md.engine
    try:
        s = _post_raw(live, {"image_url": data_uri(SQ), "length": "long", "stream": True,
                             "settings": SLOW})
        got = b""
        while b'"chunk"' not in got:   # streaming now (the socket's timeout bounds this)
            piece = s.recv(65536)
            assert piece, "the stream ended early"
            got += piece
        # Backpressure: with room for one request only, the next one is refused.
        old = state.config.max_queue
        state.config.max_queue = 1 - eng.max_batch_size
        try:
            st, hdrs, out = call(live, "/v1/caption", {"image_url": data_uri(SQ)})
            assert st == 429 and hdrs["retry-after"] == "1"
            assert out["error"]["type"] == "rate_limit_error"
        finally:
            state.config.max_queue = old
        s.close()   # the client walks away mid-stream
        _until(lambda: seen and seen[0].done())
        assert seen[0].result()["finish_reason"] == "cancelled"
        _until(lambda: not eng.sched.running)
        # A non-streamed request whose client disconnects before the answer.
        s = _post_raw(live, {"image_url": data_uri(LAND), "length": "long", "settings": SLOW})
        _until(lambda: len(seen) == 2 and eng.sched.running)
        s.close()
        _until(lambda: seen[1].done())
        assert seen[1].result()["finish_reason"] == "cancelled"
        _until(lambda: not eng.sched.running)
        # The request timeout cancels too (504).
        state.config.request_timeout = 0.3
        try:
            st, _, out = call(live, "/v1/caption", {"image_url": data_uri(SQ),
                                                    "length": "long", "settings": SLOW})
            st2, _, text = call(live, "/v1/caption", {"image_url": data_uri(SQ), "stream": True,
                                                      "length": "long", "settings": SLOW})
        finally:
            state.config.request_timeout = 60
        assert st == 504 and out["error"]["type"] == "timeout"
        _until(lambda: seen[2].done())
        assert seen[2].result()["finish_reason"] == "cancelled"
        # A stream past the timeout ends with an error event; its request is cancelled.
        events = sse(text)
        assert st2 == 200 and events[-1]["completed"]
        assert events[-1]["error"]["type"] == "timeout"
        _until(lambda: seen[3].done())
        assert seen[3].result()["finish_reason"] == "cancelled"
    finally:
        undo()
    _until(lambda: not eng.sched.running)
    st, _, out = call(live, "/v1/caption", {"image_url": data_uri(SQ), "length": "short",
                                            "settings": S})
    assert st == 200 and out == live.md.caption(uri_bytes(data_uri(SQ)), "short", settings=S)


# -- the command line: start, serve, SIGTERM finishes in-flight requests, exit 0 -----------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_and_stops_gracefully_on_sigterm(tiny_ckpt, tmp_path):
    import signal
    import subprocess
    import sys

    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "photon_jax.cli.serve", "--model", tiny_ckpt,
                             "--port", str(port), "--batch-size", "4", "--no-warmup",
                             "--log-level", "warning", "--grace", "20"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "photon-serve did not become healthy"
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        # A stream in flight when SIGTERM arrives runs to its end; then the process exits 0.
        body = json.dumps({"image_url": data_uri(SQ), "stream": True, "settings": {
            "temperature": 50, "top_p": 1, "max_tokens": 300}}).encode()
        req = urllib.request.Request(base + "/v1/caption", data=body,
                                     headers={"Content-Type": "application/json"})
        events = []

        def read():
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(json.loads(line[6:]))

        t = threading.Thread(target=read)
        t.start()
        _until(lambda: events, 60)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert events[-1]["completed"] and events[-1]["finish_reason"] in ("stop", "length")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    # A model that cannot load stops the server with exit status 1.
    bad = subprocess.run([sys.executable, "-m", "photon_jax.cli.serve", "--model",
                          str(tmp_path / "missing"), "--port", str(_free_port()),
                          "--log-level", "critical"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "failed to load" in bad.stderr


def test_bench_serve_smoke(tiny_ckpt):
    """bench/serve.py end to end at a tiny size (its numbers are never asserted), on the
    fixture checkpoint: the session's compile cache already holds most of its programs."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # One image size and batch 1: the fewest programs to compile.
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "serve.py"), "--clients",
                        "3", "--requests", "6", "--max-tokens", "3", "--images", "1",
                        "--batch-size", "1", "--max-seconds", "60", "--model", tiny_ckpt],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")][0]
    assert row["bench"] == "serve" and row["requests"] == 6
    assert row["lost"] == row["duplicated"] == row["mismatched"] == row["errors"] == 0
    assert row["requests_per_s"] > 0 and row["inprocess_requests_per_s"] > 0


def test_remote_images_only_when_allowed(live, tmp_path):
    """--allow-remote-images fetches http(s) URLs (a loopback file server here, so with
    --allow-private-image-hosts too), capped at the body limit; without it they are refused
    (see BAD).  Every fetch failure gets the same message (tests/test_serve_abuse.py: the
    default refuses loopback)."""
    import functools
    import http.server
    import shutil

    from photon_jax.serve.fetch import RemoteImages

    shutil.copy(SQ, tmp_path / "sq.png")
    (tmp_path / "big.bin").write_bytes(b"\0" * (3 << 20))   # over the 2 MiB limit
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=files.serve_forever, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    live.state.config.allow_remote_images = True
    live.state.intake.fetcher = RemoteImages(allow_private=True)
    try:
        st, _, out = call(live, "/v1/caption", {"image_url": base + "/sq.png",
                                                "length": "short", "settings": S})
        with open(SQ, "rb") as f:
            assert st == 200 and out == live.md.caption(f.read(), "short", settings=S)
        st, _, out = call(live, "/v1/caption", {"image_url": base + "/big.bin"})
        assert st == 413 and "limit" in out["error"]["message"]
        st, _, out = call(live, "/v1/caption", {"image_url": base + "/missing.png"})
        assert st == 400 and "could not be fetched" in out["error"]["message"]
    finally:
        live.state.config.allow_remote_images = False
        live.state.intake.fetcher.close()
        live.state.intake.fetcher = None
        files.shutdown()
        t.join(10)


def test_segment_route_shapes_for_moondream3():
    """/v1/segment's answer and stream shapes, on a stand-in for a Moondream 3 model whose
    requests finish with a fixed result (the real segment skill is tested in
    test_md3_engine; a Moondream 3 compile here would double this file's time)."""
    import types

    from photon_jax.api import _Call
    from photon_jax.engine.request import Handle, Request
    from photon_jax.engine.scheduler import Outbox

    result = {"path": "M 0.1 0.2 L 0.3 0.4 Z", "ids": [5], "finish_reason": "stop",
              "output_tokens": 7, "bbox": {"x_min": 0.1, "y_min": 0.2, "x_max": 0.3,
                                           "y_max": 0.4}}
    seen = []

    class MD3:
        can_segment = True
        config = types.SimpleNamespace(family="moondream3")
        engine = types.SimpleNamespace(max_context=2048, max_batch_size=4)

        def _image_costs(self, raw, max_pixels):   # (decode bytes, crop bytes)
            return 1 << 20, 1 << 20

        def _prepare_image(self, raw, max_pixels, reduce):
            return raw   # the stand-in's skills take the bytes

        def _segment(self, image, obj, refs, settings, metrics):
            seen.append((image[:8], obj, refs, settings))
            h = Handle(types.SimpleNamespace(alive=True, failure=None, wake=lambda: None),
                       Request("segment", [1]))
            out = Outbox()   # the one writer of handles, as the engine's scheduler
            out.result(h, dict(result))
            out.flush()
            return _Call([h], False, False, None,
                         lambda h: {"path": h.result()["path"], "bbox": h.result()["bbox"]})

    app = create_app(MD3(), ServeConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        _until(lambda: server.started)
        live = types.SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}")
        body = {"image_url": data_uri(SQ), "object": "w42", "spatial_refs": [[0.5, 0.5]]}
        st, _, out = call(live, "/v1/segment", body, key=None)
        assert st == 200 and out == {"path": result["path"], "bbox": result["bbox"]}
        assert seen[0] == (b"\x89PNG\r\n\x1a\n", "w42", [[0.5, 0.5]], None)
        st, _, text = call(live, "/v1/segment", {**body, "stream": True}, key=None)
        assert sse(text) == [
            {"type": "bbox", "bbox": result["bbox"], "completed": False},
            {"type": "path_delta", "chunk": result["path"], "completed": False},
            {"type": "final", "path": result["path"], "bbox": result["bbox"],
             "completed": True}]
        try:
            import moondream
        except ImportError:
            return
        vl = moondream.vl(endpoint=live.url + "/v1")
        img = Image.open(SQ)
        assert vl.segment(img, "w42") == {"path": result["path"], "bbox": result["bbox"]}
        events = list(vl.segment(img, "w42", stream=True))
        assert events[0] == {"bbox": result["bbox"]} and events[-1]["completed"]
        assert events[-1]["path"] == result["path"]
    finally:
        server.should_exit = True
        t.join(30)
        sock.close()
