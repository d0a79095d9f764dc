"""Published clients nobody here wrote, against `photon-serve` on the fixture model: the
`moondream` Node client (npm 0.2.0), moonlabel (PyPI 0.1.5, a labelling tool on the
`moondream` Python client) and the OpenAI Python SDK; what each puts on the wire (a
recording server, so a client upgrade that changes it shows here first); and
`photon_jax.serve.compat.normalize`, which maps their spellings to the server's.

Where the clients come from: the Node client is installed by npm on first use into
tests/.clients/node (gitignored; about 5 s with registry access) from tests/clients/
package.json, and driven by tests/clients/moondream_node.mjs; without node and npm its tests
skip.  moonlabel is installed by README's setup (`pip install --no-deps`: it needs only
moondream, pillow and tqdm for a Station endpoint), openai by the dev extra.  Servers listen
on 127.0.0.1 only; every wait is bounded."""

import base64
import copy
import http.server
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import types
import urllib.error
import urllib.request
from urllib.parse import unquote

import pytest
import uvicorn
from PIL import Image

from photon_jax import Moondream
from photon_jax.serve.app import ServeConfig, create_app
from photon_jax.serve.compat import SETTINGS_ALIASES, normalize

from helpers import FIXTURE_DIR, HERE, LORA_DIR

LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
SQ = os.path.join(FIXTURE_DIR, "img_sq378.png")
KEY = "client-key-5678"
S = {"temperature": 0, "max_tokens": 10}
VARIANT = "moondream3-preview/ft-abc@2"   # an adapter id, loaded by `servers` under this name

NODE_PACKAGE = os.path.join(HERE, "clients", "package.json")
NODE_SCRIPT = os.path.join(HERE, "clients", "moondream_node.mjs")
NODE_DIR = os.path.join(HERE, ".clients", "node")


def jpeg_of(image_url: str) -> bytes:
    return base64.b64decode(image_url.split(",", 1)[1])


def _until(cond, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- servers -------------------------------------------------------------------------------

class Live:
    """`create_app(md, ...)` under uvicorn on a loopback port: `url`, `stop()`."""

    def __init__(self, md, **config):
        self.md = md
        self.app = create_app(md, ServeConfig(**{"request_timeout": 120, **config}))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        _until(lambda: self.server.started)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture(scope="module")
def servers(tiny_ckpt):
    """One model behind two servers: `keyed` (requires KEY) and `open` (no key, as a
    Moondream Station is)."""
    with Moondream.load(tiny_ckpt, max_batch_size=8, max_lora_rank=4,
                        adapters={VARIANT: os.path.join(LORA_DIR, "ft-alpha@100",
                                                        "final.pt")}) as md:
        keyed = Live(md, api_key=KEY, model_name="tiny")
        open_ = Live(md, model_name="tiny")
        try:
            yield types.SimpleNamespace(md=md, keyed=keyed, open=open_)
        finally:
            keyed.stop()
            open_.stop()


BOX = {"x_min": 0.1, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4}
CANNED = {
    "/v1/caption": {"caption": "a cat"},
    "/v1/query": {"answer": "yes"},
    "/v1/detect": {"objects": [BOX]},
    "/v1/point": {"points": [{"x": 0.5, "y": 0.5}]},
    "/v1/segment": {"path": "M 0 0 Z", "bbox": BOX},
    "/v1/chat/completions": {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "yes"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
}


class Recorder:
    """A loopback HTTP server that records every request (method, path as sent, headers
    with lower-case names, JSON body) and answers each route with a canned response of the
    shape the route returns (server-sent events when the body asks to stream)."""

    def __init__(self):
        self.requests = []
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                rec.requests.append(("GET", self.path, self._headers(), None))
                mid = unquote(self.path[len("/v1/models/"):])
                self._send("application/json", json.dumps(
                    {"id": mid, "object": "model", "created": 0, "owned_by": "recorder"}))

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.loads(raw)
                rec.requests.append(("POST", self.path, self._headers(), body))
                if not body.get("stream"):
                    return self._send("application/json", json.dumps(CANNED[self.path]))
                if self.path == "/v1/chat/completions":
                    c = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                    events = [{**c, "choices": [{"index": 0, "delta": {"content": t},
                                                 "finish_reason": None}]} for t in ("ye", "s")]
                    events = [json.dumps(e) for e in events] + ["[DONE]"]
                else:
                    events = [json.dumps({"chunk": t, "completed": False}) for t in ("a", " cat")]
                    events.append(json.dumps({"chunk": "", "completed": True}))
                self._send("text/event-stream", "".join(f"data: {e}\n\n" for e in events))

            def _headers(self):
                return {k.lower(): v for k, v in self.headers.items()}

            def _send(self, kind, text):
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.thread.join(10)
        self.httpd.server_close()


@pytest.fixture
def recorder():
    r = Recorder()
    try:
        yield r
    finally:
        r.stop()


# -- the moondream Node client -------------------------------------------------------------

@pytest.fixture(scope="module")
def node_client():
    """The folder npm installed tests/clients/package.json into (once; again when the
    package.json changes).  Installed beside the final folder and renamed into place, so a
    concurrent run never sees half an install."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (the moondream Node client's tests)")
    with open(NODE_PACKAGE) as f:
        want = f.read()
    stamp = os.path.join(NODE_DIR, "package.json")

    def installed():
        if not (os.path.exists(os.path.join(NODE_DIR, "node_modules", "moondream"))
                and os.path.exists(stamp)):
            return False
        with open(stamp) as f:
            return f.read() == want

    if installed():
        return NODE_DIR
    os.makedirs(os.path.dirname(NODE_DIR), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="node-install-", dir=os.path.dirname(NODE_DIR))
    try:
        shutil.copy(NODE_PACKAGE, tmp)
        # --ignore-scripts: the pinned sharp ships its binaries as npm packages; no install
        # script has anything to do (and none reaches outside the registry).
        r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts"],
                           cwd=tmp, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, "npm install failed:\n" + (r.stdout + r.stderr)[-3000:]
        if os.path.exists(NODE_DIR) and not installed():
            shutil.rmtree(NODE_DIR)
        try:
            os.rename(tmp, NODE_DIR)
        except OSError:
            assert installed(), f"{NODE_DIR} is there but holds no install of {NODE_PACKAGE}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return NODE_DIR


def run_node(node_dir: str, url: str, calls: list, api_key=None, image: str = SQ) -> dict:
    """tests/clients/moondream_node.mjs with one plan: {"imageUrl", "results"}."""
    plan = {"endpoint": url + "/v1", "apiKey": api_key, "image": image, "calls": calls}
    r = subprocess.run(["node", NODE_SCRIPT, node_dir], input=json.dumps(plan),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def values(out: dict) -> list:
    """The calls' values, every call having succeeded."""
    bad = [(i, r["error"]) for i, r in enumerate(out["results"]) if not r["ok"]]
    assert not bad, f"Node client calls failed (index, error): {bad}"
    return [r["value"] for r in out["results"]]


def test_node_client_wire_format(node_client, recorder):
    """What moondream 0.2.0 (dist/src/moondream.js) sends: snake_case top-level fields,
    `variant` when given, `settings` only on segment and then as the caller spelled them
    (camelCase, types.d.ts's SamplingSettings); caption/query/detect/point drop settings.
    Headers: Content-Type application/json, X-Moondream-Auth (empty without a key)."""
    img = {"image": True}
    calls = [
        {"method": "caption", "request": {**img, "length": "short", "variant": VARIANT,
                                          "settings": {"maxTokens": 5}}},
        {"method": "caption", "request": {**img, "stream": True}},
        {"method": "query", "request": {**img, "question": "Q?", "reasoning": True,
                                        "variant": VARIANT, "settings": {"maxTokens": 5}}},
        {"method": "query", "request": {"question": "Hi?"}},
        {"method": "detect", "request": {**img, "object": "cat", "variant": VARIANT,
                                         "settings": {"maxObjects": 2}}},
        {"method": "point", "request": {**img, "object": "cat"}},
        {"method": "segment", "request": {**img, "object": "cat", "spatialRefs": [[0.5, 0.5]],
                                          "settings": {"maxTokens": 5, "topP": 0.9},
                                          "variant": VARIANT}},
    ]
    out = run_node(node_client, recorder.url, calls, api_key=KEY)
    u = out["imageUrl"]
    assert u.startswith("data:image/jpeg;base64,")
    assert values(out) == [
        # (A stream yields every event's chunk, the final event's "" included.)
        {"caption": "a cat"}, {"caption": ["a", " cat", ""]}, {"answer": "yes"},
        {"answer": "yes"},
        {"objects": [BOX]}, {"points": [{"x": 0.5, "y": 0.5}]},
        {"path": "M 0 0 Z", "bbox": BOX}]
    assert [(m, p, b) for m, p, _, b in recorder.requests] == [
        ("POST", "/v1/caption", {"image_url": u, "length": "short", "variant": VARIANT}),
        ("POST", "/v1/caption", {"image_url": u, "stream": True}),
        ("POST", "/v1/query", {"question": "Q?", "image_url": u, "reasoning": True,
                               "variant": VARIANT}),
        ("POST", "/v1/query", {"question": "Hi?"}),
        ("POST", "/v1/detect", {"image_url": u, "object": "cat", "variant": VARIANT}),
        ("POST", "/v1/point", {"image_url": u, "object": "cat"}),
        ("POST", "/v1/segment", {"image_url": u, "object": "cat", "stream": False,
                                 "spatial_refs": [[0.5, 0.5]],
                                 "settings": {"maxTokens": 5, "topP": 0.9},
                                 "variant": VARIANT})]
    for _, _, h, _ in recorder.requests:
        assert h["content-type"] == "application/json"
        assert h["x-moondream-auth"] == KEY
        assert h["user-agent"] == "moondream-node/0.2.0"
    recorder.requests.clear()
    run_node(node_client, recorder.url, calls[:1])
    assert recorder.requests[0][2]["x-moondream-auth"] == ""   # no key: sent, empty


def test_node_client_equals_the_api(node_client, servers):
    """Each call's answer is the in-process API's on the JPEG the client made of the image
    (the client sends no settings on these routes: the defaults, seeded, on both sides)."""
    md = servers.md
    img = {"image": True}
    calls = [
        {"method": "caption", "request": {**img, "length": "short"}},
        {"method": "caption", "request": {**img, "stream": True}},
        {"method": "query", "request": {**img, "question": "What is this?"}},
        {"method": "query", "request": {"question": "Hello?"}},
        {"method": "query", "request": {**img, "question": "Why?", "reasoning": True}},
        {"method": "query", "request": {**img, "question": "What?", "stream": True}},
        {"method": "detect", "request": {**img, "object": "w42"}},
        {"method": "point", "request": {**img, "object": "w42"}},
    ]
    out = run_node(node_client, servers.keyed.url, calls, api_key=KEY, image=LAND)
    jpeg = jpeg_of(out["imageUrl"])
    got = values(out)
    assert got[0] == md.caption(jpeg, "short")
    assert "".join(got[1]["caption"]) == md.caption(jpeg)["caption"]
    assert got[2] == md.query(jpeg, "What is this?")
    assert got[3] == md.query(None, "Hello?")
    assert got[4] == md.query(jpeg, "Why?", reasoning=True)
    assert "".join(got[5]["answer"]) == md.query(jpeg, "What?")["answer"]
    assert got[6] == md.detect(jpeg, "w42") and got[6]["objects"]
    assert got[7] == md.point(jpeg, "w42") and got[7]["points"]


def test_node_client_variant_and_camel_case_settings(node_client, servers):
    """The same calls with a `variant` (a LoRA adapter the server loaded under that id) and
    camelCase settings (which the client itself drops on these routes) answer as the API
    with that variant."""
    md = servers.md
    extra = {"image": True, "variant": VARIANT, "settings": {"maxTokens": 10, "maxObjects": 3}}
    calls = [
        {"method": "caption", "request": {**extra, "length": "short"}},
        {"method": "caption", "request": {**extra, "stream": True}},
        {"method": "query", "request": {**extra, "question": "What is this?"}},
        {"method": "detect", "request": {**extra, "object": "w42"}},
        {"method": "point", "request": {**extra, "object": "w42"}},
    ]
    out = run_node(node_client, servers.keyed.url, calls, api_key=KEY)
    jpeg = jpeg_of(out["imageUrl"])
    got = values(out)
    v = {"variant": VARIANT}
    assert got[0] == md.caption(jpeg, "short", settings=v)
    assert "".join(got[1]["caption"]) == md.caption(jpeg, settings=v)["caption"]
    assert got[2] == md.query(jpeg, "What is this?", settings=v)
    assert got[3] == md.detect(jpeg, "w42", settings=v)
    assert got[4] == md.point(jpeg, "w42", settings=v)
    # ... and the adapter made a difference
    assert got[0] != md.caption(jpeg, "short") or got[2] != md.query(jpeg, "What is this?")


def test_node_client_auth(node_client, servers):
    """A keyed server refuses the Node client without its key (the client sends an empty
    X-Moondream-Auth) or with a wrong one; a server without a key answers it."""
    call = [{"method": "caption", "request": {"image": True, "length": "short"}}]
    for key in (None, "wrong-key"):
        r = run_node(node_client, servers.keyed.url, call, api_key=key)["results"][0]
        assert not r["ok"] and r["error"] == "HTTP error! status: 401"
    got = values(run_node(node_client, servers.open.url, call))
    assert got[0]["caption"]


def test_node_client_segment_settings(node_client, servers):
    """segment is where the Node client sends its settings, camelCase as typed: they reach
    the model as the server's keys (the engine refuses any other), with the top-level
    `variant` among them.  The fixture model is a Moondream 2, so it stands in for a Moondream 3
    here: every attribute the server uses is the real model's, and `_segment` runs a short
    caption under the settings it was given, its text as the path (the segment skill itself
    is test_md3_engine's; compiling a Moondream 3 here would double this file's time)."""
    seen = []

    class Segmenting:
        can_segment = True

        def __init__(self, md):
            self.md = md

        def __getattr__(self, name):
            return getattr(self.md, name)

        def _segment(self, image, obj, refs, settings, metrics):
            seen.append((obj, refs, settings))
            call = self.md._caption(image, "short", False, settings, metrics)
            call.shape = lambda h: {"path": h.result()["text"], "bbox": BOX}
            return call

    srv = Live(Segmenting(servers.md))
    try:
        req = {"image": True, "object": "w42", "spatialRefs": [[0.5, 0.5]],
               "settings": {"maxTokens": 7, "topP": 0.9, "temperature": 0},
               "variant": VARIANT}
        out = run_node(node_client, srv.url, [
            {"method": "segment", "request": req},
            {"method": "segment", "request": {**req, "stream": True}}])
        got = values(out)
        canonical = {"max_tokens": 7, "top_p": 0.9, "temperature": 0, "variant": VARIANT}
        assert seen == [("w42", [[0.5, 0.5]], canonical)] * 2
        path = servers.md.caption(jpeg_of(out["imageUrl"]), "short", settings=canonical)
        assert got[0] == {"path": path["caption"], "bbox": BOX}
        assert got[1]["stream"][0] == {"bbox": BOX}
        assert got[1]["stream"][-1] == {"path": path["caption"], "bbox": BOX, "completed": True}
    finally:
        srv.stop()


def test_camel_case_settings_over_http(servers):
    """The Node client's spelling of settings on the routes it drops them from, sent by
    hand: the same answer as the server's spelling; both spellings with different values
    are a 400 that names both."""
    md = servers.md
    with open(SQ, "rb") as f:
        png = f.read()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()

    def post(body):
        req = urllib.request.Request(servers.open.url + "/v1/caption",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    st, out = post({"image_url": uri, "length": "short",
                    "settings": {"maxTokens": 10, "temperature": 0}})
    assert (st, out) == (200, md.caption(png, "short", settings=S))
    st, out = post({"image_url": uri, "settings": {"maxTokens": 10, "max_tokens": 12}})
    assert st == 400
    assert "maxTokens" in out["error"]["message"] and "max_tokens" in out["error"]["message"]


# -- moonlabel (the moondream Python client) -----------------------------------------------

def moonlabel_detect(url: str, images_dir, out_dir, objects) -> None:
    """moonlabel's public entry point, a YOLO dataset labelled by a Station endpoint (no API
    key: moonlabel has no way to send one there)."""
    moonlabel = pytest.importorskip("moonlabel")
    moonlabel.create_dataset(images_dir, export_format="yolo", output_dir=out_dir,
                             objects=objects, station_endpoint=url + "/v1",
                             show_progress=False)


def test_moonlabel_wire_format(recorder, tmp_path):
    """moonlabel -> moondream 2.6.1's CloudVL.detect: {image_url, object} only (the Python
    client never sends `variant`), Content-Type application/json, no X-Moondream-Auth."""
    (tmp_path / "in").mkdir()
    shutil.copy(SQ, tmp_path / "in" / "sq.png")
    moonlabel_detect(recorder.url, tmp_path / "in", tmp_path / "out", ["cat"])
    [(method, path, headers, body)] = recorder.requests
    assert (method, path, sorted(body)) == ("POST", "/v1/detect", ["image_url", "object"])
    assert body["object"] == "cat" and body["image_url"].startswith("data:image/jpeg;base64,")
    assert headers["content-type"] == "application/json"
    assert headers["user-agent"].startswith("moondream-python/")
    assert "x-moondream-auth" not in headers and "authorization" not in headers
    # The canned box, as moonlabel writes it: class x_center y_center width height.
    labels = (tmp_path / "out" / "labels" / "sq.txt").read_text().split()
    assert labels == ["0", "0.200000", "0.300000", "0.200000", "0.200000"]


def test_moonlabel_labels_a_dataset_without_a_key(servers, tmp_path):
    """moonlabel against the keyless server: one detect per image and object, and its YOLO
    labels are the API's boxes on the JPEG the moondream client sends; a keyed server
    refuses it (401)."""
    moondream = pytest.importorskip("moondream")

    (tmp_path / "in").mkdir()
    names = {"land.png": LAND, "sq.png": SQ}
    for name, path in names.items():
        shutil.copy(path, tmp_path / "in" / name)
    moonlabel_detect(servers.open.url, tmp_path / "in", tmp_path / "out", ["w42"])
    encoder = moondream.vl(endpoint="http://unused/v1")
    for name, path in names.items():
        img = Image.open(path)
        jpeg = jpeg_of(encoder.encode_image(img).image_url)
        boxes = servers.md.detect(jpeg, "w42")["objects"]
        rows = [list(map(float, line.split()))
                for line in (tmp_path / "out" / "labels" / name.replace(".png", ".txt"))
                .read_text().splitlines()]
        assert boxes and len(rows) == len(boxes), name
        for row, b in zip(rows, boxes):
            want = [0, (b["x_min"] + b["x_max"]) / 2, (b["y_min"] + b["y_max"]) / 2,
                    b["x_max"] - b["x_min"], b["y_max"] - b["y_min"]]
            assert row == pytest.approx(want, abs=2e-6), name
    with pytest.raises(urllib.error.HTTPError) as e:
        moonlabel_detect(servers.keyed.url, tmp_path / "in", tmp_path / "out2", ["w42"])
    assert e.value.code == 401


# -- the OpenAI Python SDK -----------------------------------------------------------------

def test_openai_wire_format(recorder):
    """The SDK's chat request: Content-Type application/json and "Authorization: Bearer";
    models.retrieve(id): GET /v1/models/{id}, a "/" in the id sent as %2F (openai 3.60's
    path_template) or as it is (1.45's f"/models/{model}"): either way the server's decoded
    path holds the id's two segments."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=recorder.url + "/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi?"}], max_completion_tokens=5)
    assert out.choices[0].message.content == "yes"
    m = client.models.retrieve("vikhyatk/moondream2")
    assert (m.id, m.object) == ("vikhyatk/moondream2", "model")
    (_, p1, h1, b1), (m2, p2, h2, _) = recorder.requests
    assert p1 == "/v1/chat/completions" and h1["content-type"] == "application/json"
    assert h1["authorization"] == f"Bearer {KEY}"
    assert b1 == {"model": "m", "messages": [{"role": "user", "content": "Hi?"}],
                  "max_completion_tokens": 5}
    assert m2 == "GET" and p2 in ("/v1/models/vikhyatk%2Fmoondream2",
                                   "/v1/models/vikhyatk/moondream2")
    assert h2["authorization"] == f"Bearer {KEY}"


def test_openai_chat_completions(servers):
    """chat.completions.create, plain and streamed, answers as the API's query with
    reasoning (chat's default, as kestrel's)."""
    openai = pytest.importorskip("openai")
    md = servers.md
    with open(SQ, "rb") as f:
        png = f.read()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    client = openai.OpenAI(base_url=servers.keyed.url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": uri}}]}]
    want = md.query(png, "What is this?", reasoning=True, settings=S)["answer"]
    out = client.chat.completions.create(model="tiny", messages=messages,
                                         max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.model == "tiny"
    assert out.choices[0].message.content == want
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                            max_completion_tokens=10, temperature=0,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens >= 1
    # A conversation as SDK users send it: a system prompt, a follow-up, JSON mode refused
    # by name on this word-level test tokenizer, and reasoning off through extra_body.
    convo = [{"role": "system", "content": "Be brief."}, *messages,
             {"role": "assistant", "content": want}, {"role": "user", "content": "Why?"}]
    out = client.chat.completions.create(model="tiny", messages=convo, temperature=0,
                                         max_completion_tokens=10,
                                         extra_body={"reasoning": False})
    assert out.choices[0].message.content == md.chat(
        [convo[0], {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image", "image": png}]}, *convo[2:]],
        reasoning=False, settings=S)["message"]["content"]
    with pytest.raises(openai.BadRequestError, match="byte-level tokenizer"):
        client.chat.completions.create(model="tiny", messages=convo,
                                       response_format={"type": "json_object"})
    # logprobs / top_logprobs, as the SDK parses them (its own types), plain and streamed.
    scored = md.query(png, "What is this?", reasoning=True, settings={**S, "logprobs": 2})
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                         max_completion_tokens=10, logprobs=True,
                                         top_logprobs=2)
    got = out.choices[0].logprobs.content
    assert [(t.token, t.bytes, t.logprob) for t in got] == \
        [(e["token"], e["bytes"], e["logprob"]) for e in scored["logprobs"]]
    assert [[a.token for a in t.top_logprobs] for t in got] == \
        [[a["token"] for a in e["top_logprobs"]] for e in scored["logprobs"]]
    chunks = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                            max_completion_tokens=10, logprobs=True,
                                            top_logprobs=2, stream=True)
    assert [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == [t.logprob for t in got]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=servers.keyed.url + "/v1", api_key="wrong",
                      max_retries=0).chat.completions.create(model="tiny", messages=messages)


def test_openai_models(servers):
    """models.list and models.retrieve(id): the served model as the SDK's `Model`; an id
    this server does not run is the SDK's NotFoundError."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=servers.keyed.url + "/v1", api_key=KEY, max_retries=0)
    # the model, then its loaded LoRA adapter as "<model>@<adapter>"
    assert [m.id for m in client.models.list()] == ["tiny", f"tiny@{VARIANT}"]
    m = client.models.retrieve("tiny")
    assert (m.id, m.object) == ("tiny", "model")
    assert isinstance(m.created, int) and isinstance(m.owned_by, str)
    assert client.models.retrieve(f"tiny@{VARIANT}").id == f"tiny@{VARIANT}"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny@not-loaded")


def test_openai_model_field_selects_a_loaded_adapter(servers):
    """model="<model>@<adapter>" (or the adapter's own name) answers as the API with that
    variant; an adapter the server has not loaded is a 400 naming it."""
    openai = pytest.importorskip("openai")
    md = servers.md
    client = openai.OpenAI(base_url=servers.keyed.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "w100 w200"}]
    want = md.chat(msgs, reasoning=False, settings={**S, "variant": VARIANT})
    base = md.chat(msgs, reasoning=False, settings=S)
    assert want["message"]["content"] != base["message"]["content"]
    for name in (f"tiny@{VARIANT}", VARIANT):
        out = client.chat.completions.create(model=name, messages=msgs, temperature=0,
                                             max_completion_tokens=10,
                                             extra_body={"reasoning": False})
        assert out.choices[0].message.content == want["message"]["content"]
        assert out.model == f"tiny@{VARIANT}"
    out = client.chat.completions.create(model="gpt-4o", messages=msgs, temperature=0,
                                         max_completion_tokens=10,
                                         extra_body={"reasoning": False})
    assert out.choices[0].message.content == base["message"]["content"]
    with pytest.raises(openai.BadRequestError, match="not-loaded"):
        client.chat.completions.create(model="tiny@not-loaded", messages=msgs)


def test_openai_retrieves_a_model_id_with_a_slash(servers):
    """--model-name may be a hub id ("vikhyatk/moondream2"): the SDK sends its "/" as %2F,
    which the server receives decoded, as two path segments."""
    openai = pytest.importorskip("openai")
    srv = Live(servers.md, model_name="vikhyatk/moondream2")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve("vikhyatk/moondream2").id == "vikhyatk/moondream2"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("vikhyatk/other")
    finally:
        srv.stop()


# -- compat.normalize ----------------------------------------------------------------------

def test_normalize_maps_camel_case_settings():
    body = {"image_url": "data:...", "object": "cat", "stream": False,
            "settings": {"maxTokens": 5, "temperature": 0, "maxObjects": 2, "topP": 0.9,
                         "repeatStop": 3, "seed": 1}}
    before = copy.deepcopy(body)
    out, warnings = normalize(body, "segment")
    assert out == {"image_url": "data:...", "object": "cat", "stream": False,
                   "settings": {"max_tokens": 5, "temperature": 0, "max_objects": 2,
                                "top_p": 0.9, "repeat_stop": 3, "seed": 1}}
    assert warnings == [] and body == before   # the caller's dict is left alone
    assert list(out["settings"]) == ["max_tokens", "temperature", "max_objects", "top_p",
                                     "repeat_stop", "seed"]   # the caller's order


def test_normalize_both_spellings():
    """The same value twice is one setting; different values are refused naming both
    spellings; null counts as not given (as the server's field parsing reads it)."""
    for s in ({"maxTokens": 5, "max_tokens": 5}, {"max_tokens": 5, "maxTokens": 5},
              {"maxTokens": None, "max_tokens": 5}, {"max_tokens": None, "maxTokens": 5}):
        assert normalize({"settings": s}, "caption")[0] == {"settings": {"max_tokens": 5}}, s
    with pytest.raises(ValueError) as e:
        normalize({"settings": {"topP": 0.5, "top_p": 0.9}}, "query")
    msg = str(e.value)
    assert "'topP'" in msg and "'top_p'" in msg and "0.5" in msg and "0.9" in msg
    assert msg.startswith("query:")


def test_normalize_moves_variant_into_the_settings():
    body = {"image_url": "data:...", "question": "Q?", "variant": VARIANT}
    out, warnings = normalize(body, "query")
    assert out == {"image_url": "data:...", "question": "Q?",
                   "settings": {"variant": VARIANT}} and "variant" in body and not warnings
    out, _ = normalize({**body, "settings": {"maxTokens": 3}}, "query")
    assert out["settings"] == {"max_tokens": 3, "variant": VARIANT}
    for empty in (None, ""):
        assert normalize({"variant": empty}, "caption") == ({}, [])
    with pytest.raises(ValueError, match="differ"):
        normalize({**body, "settings": {"variant": "other"}}, "query")


def test_normalize_leaves_everything_else():
    """Unknown fields, top-level camelCase, settings that are not an object and bodies
    that are not objects go through unchanged: the server's parser refuses them with its
    own message.  Chat bodies (no `settings`) pass as they are."""
    body = {"image_url": "data:...", "maxTokens": 5, "spatialRefs": [[0.5, 0.5]],
            "settings": {"unknownKey": 1, "max_tokens": 3}, "model": "m"}
    assert normalize(body, "point") == (body, [])
    for settings in ("fast", [1], None, 3):
        assert normalize({"settings": settings}, "caption") == ({"settings": settings}, [])
    assert normalize([1, 2], "caption") == ([1, 2], [])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi?"}],
            "max_tokens": 5, "top_p": 0.9, "stream": True}
    assert normalize(chat, "chat") == (chat, [])


def test_settings_aliases_cover_every_setting():
    """Every settings key the engine knows whose camelCase differs has its alias (a new key
    gets one), and every alias names a known key."""
    from photon_jax.engine.settings import KNOWN

    def camel(k):
        head, *rest = k.split("_")
        return head + "".join(p.title() for p in rest)

    assert SETTINGS_ALIASES == {camel(k): k for k in KNOWN if camel(k) != k}
