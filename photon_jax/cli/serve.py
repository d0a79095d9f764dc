"""`photon-serve` (also `python -m photon_jax.cli.serve`): the command line of the HTTP
server (`photon_jax.serve`): its flags, the checks made before the model loads, the model's
load on a background thread, and uvicorn's graceful stop."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading

from ..serve.app import Server, ServeConfig, create_app
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
    ap.add_argument("--max-body-mb", type=float, default=20.0,
                    help="largest request body (413 above)")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="requests waiting beyond the batch before 429 (Retry-After)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds before a request is cancelled (504; 0 = none)")
    ap.add_argument("--allow-remote-images", action="store_true",
                    help="fetch http(s) image URLs (off: the server would fetch any URL a "
                         "client names)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds SIGTERM waits for in-flight requests before cancelling them")
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
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key = args.api_key if args.api_key is not None else os.environ.get("PHOTON_API_KEY") or None
    if not key and not _is_loopback(args.host):
        log.warning("binding %s without an API key: anyone who can reach this address can "
                    "use the model; set --api-key or $PHOTON_API_KEY", args.host)
    name = args.model_name or os.path.basename(os.path.normpath(args.model)) or args.model
    config = ServeConfig(api_key=key, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                         max_queue=args.max_queue,
                         request_timeout=args.request_timeout or None,
                         allow_remote_images=args.allow_remote_images, model_name=name)

    def load():
        from ..api import Moondream
        return Moondream.load(args.model, revision=args.revision, device=args.device,
                              tensor_parallel=args.tensor_parallel, **engine_options(args))

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.info("signal %d: no new connections; finishing in-flight requests (up "
                         "to --grace %s s)", sig, args.grace)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful stop (exit status 128 + sig);
            # a stop that finished its requests is a clean exit: status 0.
            self._captured_signals.clear()

    app = create_app(load, config)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=args.grace))
    state = app.state.server

    watcher = threading.Thread(target=_watch_load, args=(state, server), daemon=True)
    watcher.start()
    server.run()
    if state.load_error is not None:
        print(f"photon-serve: the model failed to load: {state.load_error}", file=sys.stderr)
        return 1
    return 0


def _watch_load(state: Server, server) -> None:
    """Stop the server if the model fails to load (it could never serve)."""
    while not state.ready.wait(0.5):
        if state.load_error is not None:
            server.should_exit = True
            return


if __name__ == "__main__":
    sys.exit(main())
