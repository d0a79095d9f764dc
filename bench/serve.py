"""What does serving over HTTP cost against the in-process batch?  N concurrent clients on
loopback (threads of a separate process, so that they do not share the server's GIL) send
streamed /v1/query requests to `photon-serve`'s app (uvicorn in this process, one engine);
the same requests also run as one in-process list call (`Moondream.query` on a list, the
same batch size).  One JSON line per measurement:

  {"bench": "serve", "config", "clients", "requests", "batch", "max_tokens", "seconds",
   "requests_per_s", "tokens_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s",
   "ttft_p99_s", "inprocess_requests_per_s", "ratio", "lost", "duplicated", "mismatched",
   "errors"}

ratio = served requests/s over in-process requests/s.  Checks: every request got exactly one
complete answer (`lost`, `duplicated`) and each answer equals the one the request gets alone,
run sequentially in process (`mismatched`).  Every question is distinct, so a mix-up shows.
A random-weights checkpoint of --config is written to a temporary folder with noise JPEGs of
mixed sizes (bench/caption.py's); everything runs once untimed first (compilation, and the
image-prefix cache filled for both sides alike).  Bounded: --max-seconds stops the clients
taking new requests (those not sent are reported as "not_sent", not lost).

  python bench/serve.py                                   # 64 clients, 128 requests, small_v27
  python bench/serve.py --clients 4 --requests 8 --max-tokens 4 --images 2   # smoke
  python bench/serve.py --model out/tiny            # a converted checkpoint instead
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import socket
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, env_info, reexec_with_allocator_env  # noqa: E402


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_server(md):
    """uvicorn on a free 127.0.0.1 port in a thread, serving `md` -> (server, thread, url)."""
    import uvicorn

    from photon_jax.serve.app import create_app, ServeConfig

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(md, ServeConfig(max_queue=100_000, request_timeout=600))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=4096))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return server, t, f"http://127.0.0.1:{sock.getsockname()[1]}", sock


def client(url, jobs: queue.Queue, out: list, deadline: float):
    """Take request indices until the queue is empty or the deadline passed; stream each."""
    while time.monotonic() < deadline:
        try:
            i, body = jobs.get_nowait()
        except queue.Empty:
            return
        req = urllib.request.Request(url + "/v1/query", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        first, pieces, completed, err = None, [], 0, None
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if not line.startswith(b"data: "):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        err = ev["error"]["message"]
                    if ev.get("chunk"):
                        if first is None:
                            first = time.perf_counter() - t0
                        pieces.append(ev["chunk"])
                    if ev.get("completed"):
                        completed += 1
                        tokens = ev.get("usage", {}).get("completion_tokens", 0)
        except Exception as e:  # noqa: BLE001 - counted as an error
            err = repr(e)
            tokens = 0
        out.append({"i": i, "answer": "".join(pieces), "completed": completed, "error": err,
                    "latency": time.perf_counter() - t0, "ttft": first, "tokens": tokens})


def client_process(url: str, jobs_file: str, clients: int, max_seconds: float) -> int:
    """(A child process.)  The clients, away from the server's interpreter: their JSON and
    socket work would otherwise take the server's GIL (the served rate would then measure
    this benchmark's clients).  Jobs come as JSON lines [i, body]; results go to stdout."""
    jobs: queue.Queue = queue.Queue()
    with open(jobs_file) as f:
        for line in f:
            i, body = json.loads(line)
            jobs.put((i, body.encode()))
    out: list = []
    deadline = time.monotonic() + max_seconds
    threads = [threading.Thread(target=client, args=(url, jobs, out, deadline))
               for _ in range(min(clients, jobs.qsize()))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + 600)
    print(json.dumps({"out": out, "seconds": time.perf_counter() - t0,
                      "not_sent": jobs.qsize()}), flush=True)
    return 0


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--client-process"]:
        url, jobs_file, clients, max_seconds = sys.argv[2:6]
        return client_process(url, jobs_file, int(clients), float(max_seconds))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # small_v27 by default (bench/caption.py's model): on the tiny model a step is so short
    # that 2 cores shared by XLA, the server and the clients measure mostly the host.
    ap.add_argument("--config", default="small_v27", choices=sorted(CONFIGS))
    ap.add_argument("--model", default=None, metavar="CKPT",
                    help="serve this checkpoint instead of random weights of --config")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="clients stop taking new requests after this long")
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)
    import caption as cap   # the dataset bench's checkpoint and image writers

    from photon_jax import Moondream

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.model or cap.write_checkpoint(args.config, os.path.join(tmp, "ckpt"))
        folder = os.path.join(tmp, "images")
        os.makedirs(folder)
        cap.write_images(folder, args.images)
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
        n = args.requests
        imgs = [files[i % len(files)] for i in range(n)]
        qs = [f"w{100 + i} w{200 + i % 97}?" for i in range(n)]
        s = {"temperature": 0, "max_tokens": args.max_tokens}
        uris = {}
        for f in files:
            with open(f, "rb") as fh:
                uris[f] = "data:image/jpeg;base64," + base64.b64encode(fh.read()).decode()
        with Moondream.load(ckpt, max_batch_size=args.batch_size) as md:
            md.query(imgs, qs, settings=s)                                   # compile, cache
            sequential = [md.query(img, q, settings=s)["answer"] for img, q in zip(imgs, qs)]
            t0 = time.perf_counter()
            batch = md.query(imgs, qs, settings=s)
            inproc = n / (time.perf_counter() - t0)
            assert [b["answer"] for b in batch] == sequential, "in-process batch != sequential"

            server, thread, url, sock = start_server(md)
            try:
                def run_clients(count):
                    jobs_file = os.path.join(tmp, "jobs.jsonl")
                    with open(jobs_file, "w") as f:
                        for i in range(count):
                            f.write(json.dumps([i, json.dumps(
                                {"image_url": uris[imgs[i]], "question": qs[i],
                                 "stream": True, "settings": s})]) + "\n")
                    import subprocess
                    r = subprocess.run([sys.executable, os.path.abspath(__file__),
                                        "--client-process", url, jobs_file, str(args.clients),
                                        str(args.max_seconds)], capture_output=True, text=True,
                                       timeout=args.max_seconds + 900)
                    if r.returncode != 0:
                        raise RuntimeError(f"the client process failed:\n{r.stderr[-2000:]}")
                    res = json.loads(r.stdout.strip().splitlines()[-1])
                    return res["out"], res["seconds"], res["not_sent"]

                run_clients(min(n, args.clients))          # untimed: the server's first calls
                out, dt, not_sent = run_clients(n)
            finally:
                server.should_exit = True
                thread.join(30)
                sock.close()
    seen: dict = {}
    for r in out:
        seen.setdefault(r["i"], []).append(r)
    sent = n - not_sent
    ok = [r for r in out if r["completed"] == 1 and r["error"] is None]
    lost = sum(1 for i in range(sent) if not any(r["completed"] for r in seen.get(i, [])))
    duplicated = sum(1 for rs in seen.values() if len(rs) > 1 or
                     any(r["completed"] > 1 for r in rs))
    mismatched = sum(1 for r in ok if r["answer"] != sequential[r["i"]])
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    rps = len(ok) / dt
    print(json.dumps({
        "bench": "serve", "config": args.model or args.config, "clients": args.clients, "requests": sent,
        "not_sent": not_sent, "batch": args.batch_size, "max_tokens": args.max_tokens,
        "seconds": round(dt, 3), "requests_per_s": round(rps, 2),
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / dt, 1),
        "latency_p50_s": round(percentile(lat, 0.5), 4) if lat else None,
        "latency_p99_s": round(percentile(lat, 0.99), 4) if lat else None,
        "ttft_p50_s": round(percentile(ttft, 0.5), 4) if ttft else None,
        "ttft_p99_s": round(percentile(ttft, 0.99), 4) if ttft else None,
        "inprocess_requests_per_s": round(inproc, 2), "ratio": round(rps / inproc, 3),
        "lost": lost, "duplicated": duplicated, "mismatched": mismatched,
        "errors": sum(1 for r in out if r["error"] is not None), **env_info()}), flush=True)
    return 0 if lost == duplicated == mismatched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
