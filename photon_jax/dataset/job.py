"""A `photon-caption` run: every image of a dataset through one engine per device (or per
group of devices), into the outputs `files` names.

Owns: the engines' load, the window of requests kept in flight on each engine (images dealt
round-robin), the record of each finished image, progress, interrupts, the stop on an output
that cannot be written (a full disk: what was done and what was not, the file, the fix, exit
code 1), the failure summary and the exit code (`Summary`).  The inputs and outputs are
`files`'; the command line is `photon_jax.cli.caption`.

Image decoding and cropping run on the engine's worker threads while the device decodes; the
window (twice the batch size per engine) keeps prepared images queued so rows never wait.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import signal
import sys
import threading
import time

from .files import (DISK_ERRNOS, Item, Jsonl, OutputError, UsageError, check_collisions,
                    discover, is_done, is_utf8, record_path, remove_stale_temps, shown,
                    sidecar_path, write_atomic)

SHOW_FAILURES = 20   # the end-of-run summary lists this many failures (all go to the JSONL)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def outcome(handle, prepend: str = "", append: str = "") -> dict:
    """One finished request -> {"caption", "finish_reason", "output_tokens", "error"}: the
    shape of a JSONL record and of the Ray integration's columns; a caption gets the
    --prepend / --append text."""
    try:
        r = handle.result()
    except Exception as e:  # noqa: BLE001 - a failed image is data here, not a crash
        return failure(e)
    return {"caption": prepend + r["text"] + append, "finish_reason": r["finish_reason"],
            "output_tokens": r["output_tokens"], "error": None}


def failure(e: BaseException) -> dict:
    """-> the record of a failed image: {"caption": None, "finish_reason": None,
    "output_tokens": 0, "error": the message}."""
    return {"caption": None, "finish_reason": None, "output_tokens": 0,
            "error": str(e) or type(e).__name__}


def request_settings(args) -> dict:
    """-> the Moondream settings dict of the parsed command line."""
    s = {"max_tokens": args.max_tokens, "temperature": args.temperature,
         "top_p": args.top_p, "seed": args.seed}
    if args.repeat_stop:
        s["repeat_stop"] = args.repeat_stop
    if getattr(args, "variant", None):
        s["variant"] = args.variant
    return s


# -- the run ------------------------------------------------------------------------------

def device_groups(devices: list, tensor_parallel: int) -> list[list]:
    """Consecutive groups of `tensor_parallel` devices: one engine each (over a mesh when
    the group has more than one device)."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise UsageError(f"--tensor-parallel {tensor_parallel!r}: give a positive integer")
    if len(devices) % tensor_parallel:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: the {len(devices)} device(s) "
                         f"of --devices do not split into groups of {tensor_parallel}; "
                         "pass --devices all or a multiple of it")
    return [devices[i:i + tensor_parallel] for i in range(0, len(devices), tensor_parallel)]


def parse_devices(spec: str):
    """`--devices` ("all" or comma-separated indices) -> a list of local JAX devices."""
    import jax

    devs = jax.local_devices()
    if spec == "all":
        return devs
    try:
        idx = [int(x) for x in spec.split(",")]
    except ValueError:
        raise UsageError(f"--devices {spec!r}: give 'all' or device indices like 0 or 0,1")
    bad = [i for i in idx if not 0 <= i < len(devs)]
    if bad or len(set(idx)) != len(idx):
        raise UsageError(f"--devices {spec!r}: this machine has devices 0..{len(devs) - 1} "
                         f"({devs[0].platform}); each index once")
    return [devs[i] for i in idx]


def resolve_model(args, log) -> str:
    """--model (and --revision) -> a photon_jax checkpoint directory (`sources.resolve`: a
    Hugging Face snapshot or hub id is converted into the cache on first use).  A bad source
    is a UsageError with a one-line reason."""
    from .. import sources

    try:
        return sources.resolve(args.model, revision=getattr(args, "revision", None),
                               dtype=args.dtype, log=log)
    except (*sources.errors(), OSError) as e:
        raise UsageError(f"--model {args.model}: {sources.one_line(e)}") from None


@dataclasses.dataclass
class Summary:
    """What a run did: the numbers of its last log line, for scripts and benchmarks.
    Rates are over the captioning itself (first submission to last write, load excluded)."""
    captioned: int = 0
    failed: int = 0
    skipped: int = 0          # done before this run
    not_done: int = 0         # left by an interrupt, a device error or a failed write
    tokens: int = 0
    seconds: float = 0.0
    devices: int = 0
    exit_code: int = EXIT_OK
    load_seconds: float = 0.0         # Moondream.load (weights, engine, warm-up if asked)
    first_result_seconds: float | None = None   # from the first submission to the first write

    @property
    def images_per_s(self) -> float:
        return self.captioned / (self.seconds or 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.seconds or 1e-9)


class Run:
    """One invocation: the engines, the window of requests in flight, the counters."""

    def __init__(self, args, todo: list[Item], sidecars: dict[str, str | None], jsonl):
        self.args, self.todo, self.sidecars, self.jsonl = args, todo, sidecars, jsonl
        self.settings = request_settings(args)
        self.stats = Summary()   # captioned, failed, tokens, seconds: counted as it goes
        self.failures: list[tuple[str, str]] = []

    def execute(self, models, log) -> None:
        args = self.args
        n = len(models)
        window = 2 * args.batch_size
        # Dealt round-robin: image i goes to engine i mod n, each engine with its own queue.
        queues = [collections.deque(self.todo[e::n]) for e in range(n)]
        busy = [0] * n
        inflight: dict = {}
        done: queue.SimpleQueue = queue.SimpleQueue()
        def refill(e: int) -> None:
            while queues[e] and busy[e] < window:
                it = queues[e].popleft()
                h = models[e].start(it.path, question=args.prompt, length=args.length,
                                    settings=self.settings)
                inflight[h] = (it, e)
                busy[e] += 1
                h.add_done_callback(done.put)

        from tqdm.auto import tqdm

        bar = tqdm(total=len(self.todo), unit="img", disable=args.quiet, dynamic_ncols=True,
                   file=sys.stderr)
        stop = _StopOnSignal(done)
        t0 = time.perf_counter()
        try:
            with stop:
                for e in range(n):
                    refill(e)
                while inflight and not stop.requested:
                    h = done.get()
                    if h is None:          # the signal's wake-up
                        continue
                    it, e = inflight.pop(h)
                    busy[e] -= 1
                    refill(e)
                    self.record(it, h, lambda m: bar.write(m, file=sys.stderr))
                    if self.stats.first_result_seconds is None:
                        self.stats.first_result_seconds = time.perf_counter() - t0
                    bar.update(1)
                    dt = time.perf_counter() - t0
                    bar.set_postfix_str(f"{self.stats.tokens / dt:.1f} tok/s, "
                                        f"{self.stats.failed} failed", refresh=False)
                if stop.requested and inflight:   # (none left: the run is complete)
                    # Stop submitting, cancel what runs, keep what already finished.  Each
                    # handle is waited on directly, whether or not it reached `done` yet.
                    # A second signal escapes at once (KeyboardInterrupt).
                    log("photon-caption: interrupted; finishing the writes of completed "
                        "images")
                    for h in inflight:
                        h.cancel()
                    for h, (it, _) in list(inflight.items()):
                        self.record(it, h, log)
                        del inflight[h]
                    raise KeyboardInterrupt
        except OutputError:
            # Nothing more can be written: what runs is cancelled (not waited for by the
            # engines' close) and left for the next run.
            for h in inflight:
                h.cancel()
            raise
        finally:
            bar.close()
            self.stats.seconds = time.perf_counter() - t0

    def record(self, it: Item, handle, log) -> None:
        out = outcome(handle, self.args.prepend, self.args.append)
        if out["finish_reason"] == "cancelled":   # interrupted: not done, nothing written
            return
        sidecar = self.sidecars[it.key]
        if out["error"] is None and sidecar is not None:
            try:
                write_atomic(sidecar, out["caption"])
            except OSError as e:
                if e.errno in DISK_ERRNOS:   # every later write would fail too: stop
                    raise OutputError(sidecar, e) from None
                out = {**out, "caption": None,
                       "error": f"cannot write {shown(sidecar)}: {e.strerror or e}"}
        # Keyed by the absolute path, so a resume from any working directory finds it.
        rec = {**record_path(it.key), **out}
        if self.args.prompt is not None:
            rec["prompt"] = self.args.prompt
        if self.jsonl is not None:
            self.jsonl.append(rec)   # OutputError stops the run; this image is not done
        if out["error"] is None:
            self.stats.captioned += 1
            self.stats.tokens += out["output_tokens"]
        else:
            self.stats.failed += 1
            self.failures.append((it.path, out["error"]))
            log(f"photon-caption: failed: {it.path}: {out['error']}")


def run(args, engine_options: dict) -> Summary:
    """Caption every input of the parsed command line (`photon_jax.cli.caption`'s flags) on
    engines loaded with `engine_options` (`Moondream.load`'s keywords; the model, devices
    and tensor parallelism come from `args`) -> the run's Summary (counts, times, images/s).
    Raises UsageError for bad arguments or inputs before loading a model."""
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.no_sidecar and not args.jsonl:
        raise UsageError("--no-sidecar needs --jsonl FILE, or nothing would be written")
    if args.no_sidecar and args.output_dir:
        raise UsageError("--output-dir places sidecars; it cannot go with --no-sidecar")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty; give a question, or drop it to caption")
    for flag, text in (("--prompt", args.prompt), ("--prepend", args.prepend),
                       ("--append", args.append)):
        if text is not None and not is_utf8(text):   # it would go into every output
            raise UsageError(f"{flag} is not valid UTF-8 (a byte of another encoding on the "
                             "command line); give it as UTF-8 text")
    items = discover(args.inputs, args.recursive, warn=log)
    if not items:
        raise UsageError("no images found in the inputs")
    sidecars = {it.key: None if args.no_sidecar else sidecar_path(it, args.output_dir)
                for it in items}
    if not args.no_sidecar:
        check_collisions(items, [sidecars[it.key] for it in items])

    jsonl = Jsonl(args.jsonl) if args.jsonl else None
    try:
        outputs = [] if args.no_sidecar else [sidecars[it.key] for it in items]
        if n := remove_stale_temps(outputs + ([args.jsonl] if jsonl else [])):
            log(f"photon-caption: removed {n} temporary file(s) left by an interrupted run")
        recorded = jsonl.load(warn=log) if jsonl else set()
        if args.overwrite and jsonl:
            jsonl.drop({it.key for it in items})
    except OutputError as e:
        log(f"photon-caption: 0 captioned, {len(items)} not done; stopped before "
            f"captioning: {e}; {e.advice}")
        return Summary(not_done=len(items), exit_code=EXIT_FAILED)
    if args.overwrite:
        todo = items
    else:
        todo = [it for it in items if not is_done(it, sidecars[it.key], jsonl, recorded)]
        redo = sum(1 for it in todo if sidecars[it.key] and os.path.exists(sidecars[it.key]))
        if redo:
            log(f"photon-caption: {redo} image(s) have a sidecar but no JSONL record (an "
                "interrupted write, or a new --jsonl); captioning them again")
    skipped = len(items) - len(todo)
    if not todo:
        log(f"photon-caption: all {len(items)} images are done (use --overwrite to redo)")
        return Summary(skipped=skipped)

    from ..api import EngineError, Moondream, make_mesh

    model_dir = resolve_model(args, log)
    devices = parse_devices(args.devices)
    groups = device_groups(devices, args.tensor_parallel)
    t_load, load_s = time.perf_counter(), 0.0
    models = []
    interrupted, fatal = False, None
    r = Run(args, todo, sidecars, jsonl)
    try:
        for g in groups:
            where = ({"device": g[0]} if len(g) == 1 else
                     {"mesh": make_mesh(len(g), devices=g)})
            models.append(Moondream.load(model_dir, **where, **engine_options))
        load_s = time.perf_counter() - t_load
        log(f"photon-caption: {len(todo)} image(s) to do, {skipped} already done; model "
            f"loaded on {len(devices)} device(s) in {load_s:.1f} s"
            + (f" ({len(groups)} engine(s) of {args.tensor_parallel} devices)"
               if args.tensor_parallel > 1 else ""))
        r.execute(models, log)
    except KeyboardInterrupt:
        interrupted = True
    except EngineError as e:   # a device failure: every request in flight failed with it
        fatal = e
    except OutputError as e:   # a full disk: nothing more can be written
        fatal = e
    finally:
        for m in models:
            m.close()
        if jsonl:
            try:
                jsonl.close()
            except OutputError as e:   # its flush to disk failed: the records may be lost
                fatal = fatal or e
    out = dataclasses.replace(
        r.stats, skipped=skipped, not_done=len(todo) - r.stats.captioned - r.stats.failed,
        devices=len(devices), load_seconds=load_s,
        exit_code=EXIT_INTERRUPTED if interrupted else
        EXIT_FAILED if r.failures or fatal is not None else EXIT_OK)
    if r.failures:
        log(f"photon-caption: {len(r.failures)} failed image(s):")
        for path, err in r.failures[:SHOW_FAILURES]:
            log(f"  {path}: {err}")
        if len(r.failures) > SHOW_FAILURES:
            more = "in the JSONL" if jsonl else "above"
            log(f"  ... {len(r.failures) - SHOW_FAILURES} more ({more})")
    log(f"photon-caption: {out.captioned} captioned, {out.failed} failed, {out.skipped} "
        f"skipped (done before), {out.not_done} not done; {out.images_per_s:.2f} images/s, "
        f"{out.tokens_per_s:.1f} tokens/s over {out.seconds:.1f} s on {out.devices} "
        "device(s)")
    if isinstance(fatal, OutputError):
        log(f"photon-caption: stopped: {fatal}; {fatal.advice}")
    elif fatal is not None:
        log(f"photon-caption: stopped: {fatal}; re-run to finish the remaining images")
    return out


class _StopOnSignal:
    """While captioning, Ctrl-C and SIGTERM only raise a flag and wake the loop (a None on
    its queue), so the loop stops between two whole pieces of bookkeeping.  Raising
    KeyboardInterrupt wherever the signal lands could drop a finished handle taken off the
    queue, or one started but not yet given its callback, and the drain would wait for it
    forever.  A second signal raises at once.  Off the main thread (no signals there) it
    does nothing."""

    def __init__(self, wake: queue.SimpleQueue):
        self.wake, self.requested, self.old = wake, False, {}

    def _handle(self, _signum, _frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.wake.put(None)   # SimpleQueue.put may be called from a signal handler

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, h in self.old.items():
            signal.signal(sig, h)
        return False
