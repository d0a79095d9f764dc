"""`photon-serve` (also `python -m photon_jax.cli.serve`): the command line of the HTTP
server (`photon_jax.serve`): its flags, the checks made before the model loads, the model's
load on a background thread, and uvicorn's graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
import threading
import time

from ..serve.app import Server, ServeConfig, create_app
from ..serve.limits import MiB, ServerLimits, uvicorn_config
from .flags import add_engine_flags, engine_flag_error, engine_options

log = logging.getLogger("photon_jax.serve")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="photon-serve",
        description="Serve a Moondream model over HTTP: Moondream's cloud API (the moondream "
                    "client: md.vl(endpoint=\"http://127.0.0.1:2020/v1\")) and OpenAI chat "
                    "completions, all requests sharing one engine's batch.")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=2020)
    ap.add_argument("--api-key", default=None,
                    help="require this key (X-Moondream-Auth or Authorization: Bearer); "
                         "default: $PHOTON_API_KEY, else no key")
    ap.add_argument("--model-name", default=None,
                    help="the id /v1/models reports (default: the model folder's name)")
    ap.add_argument("--device", type=int, default=None, metavar="INDEX",
                    help="the accelerator to use (default: the first)")
    # Warm by default: /health reports ready once the common shapes are compiled.
    add_engine_flags(ap, warmup=True, tensor_parallel=None,
                     batch_help="rows decoded together",
                     workers_help="threads decoding and cropping images")
    lim = ServerLimits()
    g = ap.add_argument_group("limits (docs/serving.md, \"Limits\")")
    g.add_argument("--max-body-mb", type=float, default=20.0,
                   help="largest request body (413 above)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond the batch before 429 (Retry-After)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request is cancelled (504; 0 = none)")
    g.add_argument("--max-image-pixels", type=int, default=lim.max_image_pixels,
                   help="largest image (width x height), refused from its header before "
                        "decoding (default %(default)s)")
    g.add_argument("--max-text-chars", type=int, default=lim.max_text_chars,
                   help="longest question / object / message text (default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=lim.body_timeout,
                   help="seconds for a whole request body to arrive (408 after)")
    g.add_argument("--header-timeout", type=float, default=lim.header_timeout,
                   help="seconds for a request's headers to arrive (the connection is "
                        "closed after)")
    g.add_argument("--max-connections", type=int, default=lim.max_connections,
                   help="open connections and running requests before 503")
    g.add_argument("--max-body-buffer-mb", type=float, default=lim.body_budget / MiB,
                   help="memory for request bodies being read and parsed (each counts 3x "
                        "its size; 503 after --wait)")
    g.add_argument("--max-decode-mb", type=float, default=lim.decode_budget / MiB,
                   help="memory for images being decoded (estimated from their headers)")
    g.add_argument("--decode-threads", type=int, default=lim.decode_threads,
                   help="threads decoding request images (their own pool)")
    g.add_argument("--max-queued-images-mb", type=float, default=lim.queued_budget / MiB,
                   help="memory for the crops of admitted requests' images (503 above)")
    g.add_argument("--grace", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests; those still running "
                        "a second before it ends are cancelled and answered 503")
    t = ap.add_argument_group("callers")
    t.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names answered without an API key besides "
                        "this machine's own (\"*\": any; for a keyless server behind a "
                        "proxy that checks callers)")
    t.add_argument("--allow-local-without-key", action="store_true",
                   help="with --api-key: callers on this machine (loopback, no browser "
                        "Origin) need no key (Station-style clients such as moonlabel)")
    t.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs of public addresses (off: the server "
                        "would fetch any URL a client names)")
    t.add_argument("--allow-private-image-hosts", action="store_true",
                   help="with --allow-remote-images: also fetch from private, loopback and "
                        "link-local addresses (dangerous: clients can then reach this "
                        "machine's and its network's internal services)")
    ap.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug"])
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    # Refused before the model loads (exit status 2, argparse's usage error).
    if not 0 <= args.port < 65536:
        ap.error(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        ap.error(f"--max-queue must be >= 0, got {args.max_queue}")
    if (msg := engine_flag_error(args)) is not None:
        ap.error(msg)
    if not args.max_body_mb > 0:
        ap.error(f"--max-body-mb must be positive, got {args.max_body_mb}")
    for flag, v in (("--request-timeout", args.request_timeout), ("--grace", args.grace)):
        if not v >= 0:
            ap.error(f"{flag} must be >= 0 seconds, got {v}")
    for flag, v in (("--max-image-pixels", args.max_image_pixels),
                    ("--max-text-chars", args.max_text_chars),
                    ("--body-timeout", args.body_timeout),
                    ("--header-timeout", args.header_timeout),
                    ("--max-connections", args.max_connections),
                    ("--max-body-buffer-mb", args.max_body_buffer_mb),
                    ("--max-decode-mb", args.max_decode_mb),
                    ("--decode-threads", args.decode_threads),
                    ("--max-queued-images-mb", args.max_queued_images_mb)):
        if not v > 0:
            ap.error(f"{flag} must be positive, got {v}")
    if args.allow_private_image_hosts and not args.allow_remote_images:
        ap.error("--allow-private-image-hosts needs --allow-remote-images")
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key = args.api_key if args.api_key is not None else os.environ.get("PHOTON_API_KEY") or None
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    if not key and not _is_loopback(args.host):
        log.warning("binding %s without an API key: only requests whose Host is this "
                    "machine's name (or --allowed-hosts %s) are answered; set --api-key or "
                    "$PHOTON_API_KEY to serve other machines", args.host, ",".join(hosts))
    if args.allow_local_without_key and not key:
        ap.error("--allow-local-without-key needs an API key (--api-key or $PHOTON_API_KEY)")
    name = args.model_name or os.path.basename(os.path.normpath(args.model)) or args.model
    config = ServeConfig(api_key=key, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                         max_queue=args.max_queue,
                         request_timeout=args.request_timeout or None,
                         allow_remote_images=args.allow_remote_images, model_name=name,
                         allowed_hosts=hosts,
                         allow_local_without_key=args.allow_local_without_key,
                         allow_private_image_hosts=args.allow_private_image_hosts,
                         limits=ServerLimits(
                             max_image_pixels=args.max_image_pixels,
                             max_text_chars=args.max_text_chars,
                             body_timeout=args.body_timeout,
                             header_timeout=args.header_timeout,
                             max_connections=args.max_connections,
                             body_budget=int(args.max_body_buffer_mb * MiB),
                             decode_budget=int(args.max_decode_mb * MiB),
                             decode_threads=args.decode_threads,
                             queued_budget=int(args.max_queued_images_mb * MiB)))

    def load():
        from ..api import Moondream
        return Moondream.load(args.model, revision=args.revision, device=args.device,
                              tensor_parallel=args.tensor_parallel, **engine_options(args))

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.info("signal %d: no new connections; finishing in-flight requests (up "
                         "to --grace %s s)", sig, args.grace)
                # Requests still running shortly before the grace period ends are
                # cancelled and answered by us (JSON 503 / a final stream event), not cut
                # off by uvicorn's task cancellation (a plain-text 500, a stream with no end).
                asyncio.get_event_loop().call_later(
                    max(0.0, args.grace - min(1.0, args.grace / 4)), state.abort_all)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful stop (exit status 128 + sig);
            # a stop that finished its requests is a clean exit: status 0.
            self._captured_signals.clear()

    app = create_app(load, config)
    state = app.state.server
    server = GracefulServer(uvicorn_config(app, state.config.limits, host=args.host,
                                           port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.grace))

    watcher = threading.Thread(target=_watch, args=(state, server), daemon=True)
    watcher.start()
    server.run()
    if state.load_error is not None:
        print(f"photon-serve: the model failed to load: {state.load_error}", file=sys.stderr)
        return 1
    if state.engine_failure is not None:
        print(f"photon-serve: {state.engine_failure}; exiting so that a supervisor restarts "
              "the server", file=sys.stderr)
        return 1
    return 0


def _watch(state: Server, server) -> None:
    """Stop the server if the model fails to load (it could never serve), or if its engine
    dies later (every request would get 503: exit non-zero so that a supervisor restarts
    it; /health says 503 meanwhile)."""
    while not state.ready.wait(0.5):
        if state.load_error is not None:
            server.should_exit = True
            return
    while not server.should_exit:
        if state.engine_failure is not None:
            log.error("%s; stopping the server", state.engine_failure)
            server.should_exit = True
            return
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
