"""`photon_jax.serve.fetch`: the remote image fetcher behind --allow-remote-images.

Local HTTP servers on 127.0.0.1 (an address the default policy refuses; a request reaching it
is a failure) and 127.0.0.2 (Linux routes all of 127/8 to lo; the tests' policy allows only
this one address).  Every wait is bounded and every test takes a few seconds at most.
"""

import asyncio
import ipaddress
import shutil
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler

import pytest

from photon_jax.serve.fetch import FetchError, RemoteImages, private_allowed, public_only

ALLOWED, FORBIDDEN = "127.0.0.2", "127.0.0.1"
IMG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))


def only_allowed(ip) -> bool:
    return ip == ipaddress.ip_address(ALLOWED)


def run(coro, limit: float = 10.0):
    """One coroutine on a fresh loop, never longer than `limit` seconds."""
    return asyncio.run(asyncio.wait_for(coro, limit))


def timed(coro):
    """(result or exception, seconds) of one coroutine."""
    t0 = time.monotonic()
    try:
        out = run(coro)
    except Exception as e:   # noqa: BLE001 - the tests look at what came back
        out = e
    return out, time.monotonic() - t0


def wait_until(cond, limit: float) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# -- test servers ---------------------------------------------------------------------------

class Handler(BaseHTTPRequestHandler):
    """Routes by the path's first segment; each records (path, Host) on its server."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        srv = self.server.owner
        srv.hits.append((self.path, self.headers.get("Host")))
        path, _, query = self.path.partition("?")
        q = dict(urllib.parse.parse_qsl(query))
        route = path.strip("/").split("/")[0] or "missing"
        getattr(self, "r_" + route.replace("-", "_"), self.r_missing)(path, q)

    def _send(self, status: int, body: bytes = b"", ctype: str | None = "image/png",
              headers: dict | None = None):
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def r_missing(self, path, q):
        self._send(404, b"not here", "text/plain")

    def r_status(self, path, q):
        self._send(int(q["code"]), b"x", "text/plain")

    def r_img(self, path, q):
        ctype = q.get("type", "image/png")
        self._send(200, IMG, ctype or None)

    def r_redir(self, path, q):
        self._send(int(q.get("code", 302)), ctype=None, headers={"Location": q["to"]})

    def r_chain(self, path, q):
        n = int(path.split("/")[2])
        if n == 0:
            return self.r_img(path, {})
        self._send(307, ctype=None, headers={"Location": f"/chain/{n - 1}"})   # relative

    def r_nolen(self, path, q):
        # HTTP/1.0 without Content-Length: the body runs until the server closes.
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(b"x" * int(q["n"]))

    def r_chunked(self, path, q):
        n, out = int(q["n"]), [b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"]
        for i in range(0, n, 300):
            part = b"y" * min(300, n - i)
            out.append(b"%x\r\n%s\r\n" % (len(part), part))
        out.append(b"0\r\n\r\n")
        self.wfile.write(b"".join(out))

    def r_bigcl(self, path, q):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(10**9))
        self.end_headers()
        self.server.owner.stop.wait(3)   # and send nothing: a reader would wait

    def r_hang(self, path, q):
        self.server.owner.stop.wait(3)   # never answer

    def r_trickle(self, path, q):
        # A byte every 0.5 s: of the body (after honest headers) or of the status line.
        if q.get("where") == "head":
            data = b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\n\r\n" + IMG
        else:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.flush()
            data = b"z" * 1000
        try:
            for i in range(12):
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                if self.server.owner.stop.wait(0.5):
                    return
        except OSError:
            pass   # the client gave up: that is the point


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    # Not http.server.HTTPServer: its server_bind does a reverse DNS lookup (getfqdn).
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True


class Server:
    def __init__(self, host: str, tls: ssl.SSLContext | None = None):
        self.host, self.hits, self.stop = host, [], threading.Event()
        self.httpd = _TCPServer((host, 0), Handler)
        self.httpd.owner = self
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str | None = None, scheme: str = "http") -> str:
        return f"{scheme}://{host or self.host}:{self.port}{path}"

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(2)


@pytest.fixture(scope="module")
def servers():
    allowed, forbidden = Server(ALLOWED), Server(FORBIDDEN)
    yield allowed, forbidden
    allowed.close()
    forbidden.close()


@pytest.fixture
def allowed(servers):
    servers[0].hits.clear()
    return servers[0]


@pytest.fixture
def forbidden(servers):
    servers[1].hits.clear()
    return servers[1]


@pytest.fixture
def fetcher():
    f = RemoteImages(allow_address=only_allowed)
    yield f
    f.close()


@pytest.fixture
def default_fetcher():
    f = RemoteImages()
    yield f
    f.close()


def closed_port(host: str) -> int:
    """A port on `host` with nothing listening (bound, then released)."""
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def mapped_resolver(table: dict, calls: list):
    """A resolve hook: host -> a list of IPs (or an exception to raise), calls recorded."""
    def resolve(host, port):
        calls.append(host)
        ips = table[host]
        if isinstance(ips, BaseException):
            raise ips
        if callable(ips):
            ips = ips()
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port)) for ip in ips]
    return resolve


# -- the address policies -------------------------------------------------------------------

@pytest.mark.parametrize("ip", [
    "127.0.0.1", "127.0.0.2", "::1", "0.0.0.0", "::", "169.254.169.254", "fe80::1",
    "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1", "224.0.0.1", "ff02::1",
    "255.255.255.255", "240.0.0.1", "192.0.2.1", "fc00::1", "fd00:ec2::254", "fec0::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::127.0.0.1", "64:ff9b::7f00:1",
    "64:ff9b::a00:1", "64:ff9b:1::1", "2002:7f00:1::1", "2002:a00:1::1",
    "2001:0:4136:e378:8000:63bf:80ff:fffe", "2001:db8::1"])
def test_public_only_refuses(ip):
    assert not public_only(ipaddress.ip_address(ip))


@pytest.mark.parametrize("ip", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111",
                                "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_only_allows(ip):
    assert public_only(ipaddress.ip_address(ip))


@pytest.mark.parametrize("ip,ok", [
    ("127.0.0.1", True), ("::1", True), ("10.0.0.1", True), ("192.168.1.1", True),
    ("fd12::1", True), ("8.8.8.8", True), ("169.254.169.254", False), ("fe80::1", False),
    ("::ffff:169.254.169.254", False), ("fd00:ec2::254", False), ("100.100.100.200", False),
    ("0.0.0.0", False), ("::", False), ("224.0.0.1", False)])
def test_private_allowed_still_refuses_metadata(ip, ok):
    assert private_allowed(ipaddress.ip_address(ip)) is ok


def test_policy_options_conflict():
    with pytest.raises(ValueError):
        RemoteImages(allow_address=only_allowed, allow_private=True)


# -- refusals before any connection ---------------------------------------------------------

@pytest.mark.parametrize("host", [
    "127.0.0.1", "[::1]", "169.254.169.254", "10.1.2.3", "192.168.1.1", "[::ffff:127.0.0.1]",
    "0.0.0.0", "localhost", "127.1", "2130706433", "[::]", "100.64.0.1"])
def test_default_policy_refuses_local_addresses(default_fetcher, forbidden, host):
    out, dt = timed(default_fetcher.fetch(forbidden.url("/img", host), 10_000, 2.0))
    assert isinstance(out, FetchError), out
    assert out.message == default_fetcher.failure(2.0).message and not out.too_large
    assert dt < 1.0   # refused on the addresses, not after a connection attempt
    assert forbidden.hits == []


@pytest.mark.parametrize("url", [
    "file:///etc/passwd", "ftp://127.0.0.2/x.png", "gopher://127.0.0.2:70/_x",
    "javascript:alert(1)", "data:image/png;base64,AAAA", "//127.0.0.2/x.png", "x.png", "",
    "http://user:pass@{a}/img", "http://user@{a}/img", "http://@{a}/img", "http:///img",
    "http://{a}:99999/img", "http://{a}/i mg", "http:\\\\{a}/img", "http://{a}/img\r\nX: y"])
def test_refuses_bad_urls(fetcher, allowed, url):
    url = url.replace("{a}", f"{ALLOWED}:{allowed.port}")
    out, dt = timed(fetcher.fetch(url, 10_000, 2.0))
    assert isinstance(out, FetchError), out
    assert out.message == fetcher.failure(2.0).message
    assert dt < 1.0 and allowed.hits == []


# -- fetching -------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["image/png", "image/jpeg; charset=binary",
                                   "application/octet-stream", ""])
def test_fetches_image_from_allowed_address(fetcher, allowed, ctype):
    q = urllib.parse.urlencode({"type": ctype})
    assert run(fetcher.fetch(allowed.url(f"/img?{q}"), 10_000, 2.0)) == IMG
    assert allowed.hits == [(f"/img?{q}", f"{ALLOWED}:{allowed.port}")]
    assert wait_until(lambda: fetcher.in_flight == 0, 1.0)


def test_non_image_content_type_refused(fetcher, allowed):
    with pytest.raises(FetchError) as e:
        run(fetcher.fetch(allowed.url("/img?type=text/html"), 10_000, 2.0))
    assert e.value.message == fetcher.failure(2.0).message


def test_connects_to_the_validated_address_once_per_hop(allowed):
    # DNS rebinding: the first answer is checked and used; a later answer (127.0.0.1) is
    # never looked at within that hop, and the Host header keeps the URL's own name.
    calls = []
    answers = iter([[ALLOWED], [FORBIDDEN]])
    f = RemoteImages(allow_address=only_allowed,
                     resolve=mapped_resolver({"img.test": lambda: next(answers)}, calls))
    try:
        assert run(f.fetch(allowed.url("/img", "img.test"), 10_000, 2.0)) == IMG
        assert calls == ["img.test"]
        assert allowed.hits == [("/img", f"img.test:{allowed.port}")]
        # The next hop resolves again, gets 127.0.0.1 and is refused.
        calls.clear()
        answers = iter([[ALLOWED], [FORBIDDEN]])
        with pytest.raises(FetchError):
            run(f.fetch(allowed.url("/chain/1", "img.test"), 10_000, 2.0))
        assert calls == ["img.test", "img.test"]
    finally:
        f.close()


def test_name_with_one_refused_address_is_refused(allowed):
    calls = []
    f = RemoteImages(allow_address=only_allowed,
                     resolve=mapped_resolver({"img.test": [ALLOWED, FORBIDDEN]}, calls))
    try:
        with pytest.raises(FetchError):
            run(f.fetch(allowed.url("/img", "img.test"), 10_000, 2.0))
        assert calls == ["img.test"] and allowed.hits == []
    finally:
        f.close()


@pytest.mark.parametrize("to", [
    "http://127.0.0.1:{f}/img", "http://[::ffff:127.0.0.1]:{f}/img", "http://localhost:{f}/img",
    "file:///etc/passwd", "gopher://127.0.0.2:{a}/_x", "http://u:p@127.0.0.2:{a}/img"])
@pytest.mark.parametrize("code", [302, 308])
def test_redirect_to_refused_target_is_refused(fetcher, allowed, forbidden, to, code):
    to = to.format(f=forbidden.port, a=allowed.port)
    q = urllib.parse.urlencode({"to": to, "code": code})
    with pytest.raises(FetchError) as e:
        run(fetcher.fetch(allowed.url(f"/redir?{q}"), 10_000, 2.0))
    assert e.value.message == fetcher.failure(2.0).message
    assert forbidden.hits == [] and len(allowed.hits) == 1


def test_redirect_to_allowed_target_is_followed(fetcher, allowed):
    for code in (301, 302, 303, 307, 308):
        q = urllib.parse.urlencode({"to": allowed.url("/img"), "code": code})
        assert run(fetcher.fetch(allowed.url(f"/redir?{q}"), 10_000, 2.0)) == IMG


def test_redirect_chain_limit(fetcher, allowed):
    assert run(fetcher.fetch(allowed.url("/chain/5"), 10_000, 2.0)) == IMG
    assert [p for p, _ in allowed.hits] == [f"/chain/{n}" for n in range(5, -1, -1)]
    allowed.hits.clear()
    with pytest.raises(FetchError):
        run(fetcher.fetch(allowed.url("/chain/6"), 10_000, 2.0))
    assert len(allowed.hits) == 6   # the 7th hop is never requested


# -- one message for every failure ----------------------------------------------------------

def test_failures_read_the_same(allowed, forbidden):
    calls = []
    resolve = mapped_resolver({ALLOWED: [ALLOWED], FORBIDDEN: [FORBIDDEN],
                               "nxdomain.test": socket.gaierror(socket.EAI_NONAME, "no")},
                              calls)
    f = RemoteImages(allow_address=only_allowed, resolve=resolve)
    deadline = 0.6
    urls = {
        "nothing listening": f"http://{ALLOWED}:{closed_port(ALLOWED)}/img",
        "timeout": allowed.url("/hang"),
        "404": allowed.url("/missing"),
        "500": allowed.url("/status?code=500"),
        "204": allowed.url("/status?code=204"),
        "refused address": forbidden.url("/img"),
        "dns failure": allowed.url("/img", "nxdomain.test"),
        "not an image": allowed.url("/img?type=text/html"),
        "scheme": "ftp://127.0.0.2/img",
    }
    try:
        msgs = {}
        for what, url in urls.items():
            out, dt = timed(f.fetch(url, 10_000, deadline))
            assert isinstance(out, FetchError), (what, out)
            assert dt < deadline + 0.4, (what, dt)
            msgs[what] = out.message
    finally:
        f.close()
    assert len(set(msgs.values())) == 1, msgs
    assert msgs["404"] == f.failure(deadline).message
    assert forbidden.hits == []


# -- deadline, size, threads ----------------------------------------------------------------

@pytest.mark.parametrize("where", ["body", "head"])
def test_trickle_is_cut_off_at_the_deadline(fetcher, allowed, where):
    out, dt = timed(fetcher.fetch(allowed.url(f"/trickle?where={where}"), 10_000, 1.5))
    assert isinstance(out, FetchError) and not out.too_large, out
    assert 1.4 <= dt < 2.0, dt
    assert wait_until(lambda: fetcher.in_flight == 0, 0.5)


def test_content_length_over_limit_refused_without_reading(fetcher, allowed):
    out, dt = timed(fetcher.fetch(allowed.url("/bigcl"), 1000, 3.0))
    assert isinstance(out, FetchError) and out.too_large, out
    assert "1000-byte limit" in out.message and str(10**9) in out.message
    assert dt < 1.0   # the body (never sent) was not waited for


@pytest.mark.parametrize("route", ["nolen", "chunked"])
def test_body_over_limit_refused(fetcher, allowed, route):
    assert run(fetcher.fetch(allowed.url(f"/{route}?n=1000"), 1000, 2.0)) == \
        (b"x" if route == "nolen" else b"y") * 1000
    with pytest.raises(FetchError) as e:
        run(fetcher.fetch(allowed.url(f"/{route}?n=1001"), 1000, 2.0))
    assert e.value.too_large and "1000-byte limit" in e.value.message


def test_slow_fetches_do_not_use_the_default_executor(allowed):
    f = RemoteImages(max_workers=4, allow_address=only_allowed)

    async def main():
        loop = asyncio.get_running_loop()
        slow = [asyncio.create_task(f.fetch(allowed.url("/hang"), 10_000, 1.0))
                for _ in range(8)]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        name = await asyncio.wait_for(
            loop.run_in_executor(None, lambda: threading.current_thread().name), 0.5)
        prompt = time.monotonic() - t0
        busy = f.in_flight
        fetch_threads = [t for t in threading.enumerate() if t.name.startswith("photon-fetch")]
        outs = await asyncio.gather(*slow, return_exceptions=True)
        return name, prompt, busy, fetch_threads, outs

    t0 = time.monotonic()
    try:
        name, prompt, busy, fetch_threads, outs = run(main())
    finally:
        f.close()
    assert not name.startswith("photon-fetch") and prompt < 0.3
    assert busy == 4 and len(fetch_threads) == 4   # the pool is bounded
    assert all(isinstance(o, FetchError) for o in outs), outs
    # The 4 queued fetches were not given a fresh second each: one deadline from the call.
    assert time.monotonic() - t0 < 1.0 + 0.6


def test_cancelled_fetch_frees_its_thread(fetcher, allowed):
    async def main():
        task = asyncio.create_task(fetcher.fetch(allowed.url("/hang"), 10_000, 5.0))
        await asyncio.sleep(0.3)
        assert fetcher.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert wait_until(lambda: fetcher.in_flight == 0, fetcher.step_s + 0.4)


def test_close_fails_running_and_queued_fetches(allowed):
    f = RemoteImages(max_workers=1, allow_address=only_allowed)

    async def main():
        tasks = [asyncio.create_task(f.fetch(allowed.url("/hang"), 10_000, 5.0))
                 for _ in range(2)]
        await asyncio.sleep(0.3)
        f.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    out, dt = timed(main())
    assert all(isinstance(o, FetchError) for o in out), out
    assert dt < 0.3 + f.step_s + 0.4
    with pytest.raises(RuntimeError):
        run(f.fetch(allowed.url("/img"), 10_000, 1.0))


# -- https ----------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_https_uses_sni_and_checks_the_certificate_name(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=img.test", "-addext",
                    "subjectAltName=DNS:img.test"], check=True, capture_output=True,
                   timeout=20)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    seen = []
    server_ctx.sni_callback = lambda sock, name, ctx: seen.append(name)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    srv = Server(ALLOWED, tls=server_ctx)
    calls = []
    f = RemoteImages(allow_address=only_allowed, ssl_context=client_ctx,
                     resolve=mapped_resolver({"img.test": [ALLOWED],
                                              "other.test": [ALLOWED]}, calls))
    try:
        assert run(f.fetch(srv.url("/img", "img.test", "https"), 10_000, 2.0)) == IMG
        assert seen == ["img.test"] and srv.hits == [("/img", f"img.test:{srv.port}")]
        # Same address, another name: the certificate does not match it.
        with pytest.raises(FetchError) as e:
            run(f.fetch(srv.url("/img", "other.test", "https"), 10_000, 2.0))
        assert e.value.message == f.failure(2.0).message
        assert len(srv.hits) == 1
    finally:
        f.close()
        srv.close()
