"""`photon-caption` (also `python -m photon_jax.cli.caption`): caption, or ask one question about,
every image of a dataset, into sidecar `.txt` files and/or one JSONL file.

Owns: finding the images (directories, globs, list files), where each output goes (a sidecar
next to the image or under `--output-dir`, mirroring the input tree), what counts as done on
a re-run, crash-safe writes, the window of requests kept in flight on each engine (one engine
per device, images dealt round-robin), progress, the failure summary and the exit code.

Crash safety: a sidecar is written to a temporary file and renamed over (so it exists whole
or not at all); the JSONL record is then appended with one `write` of one line.  A kill can
only tear the last JSONL line; the next run cuts it off before appending.  An image whose
sidecar exists but whose JSONL record was lost that way is captioned again, so the two
outputs always agree and every image has exactly one successful JSONL record.

Image decoding and cropping run on the engine's worker threads while the device decodes; the
window (twice the batch size per engine) keeps prepared images queued so rows never wait.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import queue
import signal
import sys
import threading
import time

IMAGE_EXTS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .apng .webp .bmp .dib .gif .tif .tiff .ppm .pgm .pbm .pnm "
    ".tga .ico .avif".split())
LIST_EXTS = frozenset((".txt", ".lst", ".list"))
SHOW_FAILURES = 20   # the end-of-run summary lists this many failures (all go to the JSONL)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad command line or inputs: reported before any model is loaded (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One input image: where it was found, its resume key, and the input root."""
    path: str   # as found (relative inputs stay relative); the JSONL's "path"
    key: str    # absolute, normalised: the identity used to resume
    root: str   # the input it came from; --output-dir mirrors paths relative to it


# -- inputs -------------------------------------------------------------------------------

def is_image_name(name: str) -> bool:
    """-> True for a file name with an image extension (IMAGE_EXTS, any case)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def discover(inputs: list[str], recursive: bool = False, warn=print) -> list[Item]:
    """Expand inputs into images, in a stable order, each once.  A directory gives its image
    files (hidden ones skipped: `._x.jpg` resource forks are not images), a glob the image
    files it matches (`**` crosses directories), a file with an image extension itself, and
    a `.txt`/`.lst`/`.list` file its lines (one path each, relative to the list's folder;
    blank lines and `#` comments skipped; missing files fail one by one later)."""
    items: list[Item] = []
    seen: set[str] = set()

    def add(path: str, root: str) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            items.append(Item(path, key, root))

    for arg in inputs:
        before = len(items)
        if os.path.isdir(arg):
            for path in _scan(arg, recursive):
                add(path, arg)
        elif any(c in arg for c in "*?["):
            root = _glob_root(arg)
            for path in sorted(glob.glob(arg, recursive=True)):
                if os.path.isfile(path) and is_image_name(path):
                    add(path, root)
        elif os.path.isfile(arg):
            ext = os.path.splitext(arg)[1].lower()
            if ext in IMAGE_EXTS:
                add(arg, os.path.dirname(arg) or ".")
            elif ext in LIST_EXTS:
                base = os.path.dirname(arg) or "."
                for path in _read_list(arg):
                    add(os.path.join(base, path), base)
            else:
                raise UsageError(
                    f"input {arg!r} is neither an image ({', '.join(sorted(IMAGE_EXTS))}) nor "
                    "a list file (.txt/.lst/.list with one image path per line)")
        else:
            raise UsageError(f"input {arg!r} does not exist; give directories, globs (quote "
                             "them), image files or list files")
        if len(items) == before:
            warn(f"photon-caption: input {arg!r} has no images")
    return items


def _scan(folder: str, recursive: bool):
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        for name in sorted(filenames):
            if not name.startswith(".") and is_image_name(name):
                yield os.path.join(dirpath, name)


def _glob_root(pattern: str) -> str:
    """The folder part of a glob before its first wildcard."""
    parts = pattern.split(os.sep)
    fixed = []
    for p in parts[:-1]:
        if any(c in p for c in "*?["):
            break
        fixed.append(p)
    return os.sep.join(fixed) or ("/" if pattern.startswith(os.sep) else ".")


def _read_list(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [s.strip() for s in f if s.strip() and not s.lstrip().startswith("#")]


def sidecar_path(item: Item, output_dir: str | None, ext: str = ".txt") -> str:
    """`photo.jpg` -> `photo.txt` beside it, or under output_dir at the image's path relative
    to its input (an image outside that input goes to the top of output_dir)."""
    stem = os.path.splitext(item.path)[0]
    if output_dir is None:
        return stem + ext
    rel = os.path.relpath(os.path.splitext(item.key)[0], os.path.abspath(item.root))
    if rel.startswith(os.pardir):
        rel = os.path.basename(stem)
    return os.path.join(output_dir, rel + ext)


def check_collisions(items: list[Item], sidecars: list[str]) -> None:
    """Raise UsageError if two images would write the same sidecar file."""
    owner: dict[str, str] = {}
    clashes = []
    for it, sc in zip(items, sidecars):
        k = os.path.abspath(sc)
        if k in owner:
            clashes.append(f"{owner[k]!r} and {it.path!r} -> {sc!r}")
        owner.setdefault(k, it.path)
    if clashes:
        raise UsageError(
            f"{len(clashes)} pair(s) of images would share a sidecar (same name, other "
            f"extension), e.g. {clashes[0]}; rename them, or use --no-sidecar with --jsonl")


# -- outputs ------------------------------------------------------------------------------

def write_atomic(path: str, text: str) -> None:
    """The file holds the old content or the new, never a part: write a temporary file in
    the same folder, flush it to disk, rename it over."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".photon-tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Jsonl:
    """The JSONL output: read back for resume (torn last line repaired), appended one line
    per image with a single `write` (O_APPEND), so a kill tears at most that line."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def load(self, warn=print) -> set[str]:
        """The images (absolute paths) with a successful record.  Cuts off a torn last line
        (no newline at the end) so the next append starts on a line of its own."""
        ok: set[str] = set()
        if not os.path.exists(self.path):
            return ok
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            warn(f"photon-caption: {self.path}: dropping a torn last line "
                 f"({len(data) - end} bytes) left by an interrupted run")
            os.truncate(self.path, end)
        for n, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if rec.get("error") is None:
                    ok.add(os.path.abspath(rec["path"]))
            except (ValueError, KeyError, TypeError):
                warn(f"photon-caption: {self.path}:{n}: not a record, ignored")
        return ok

    def drop(self, keys: set[str]) -> None:
        """Remove the records of these images (for --overwrite), by rewriting atomically."""
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            keep = [ln for ln in f if not _record_of(ln, keys)]
        write_atomic(self.path, "".join(keep))

    def append(self, record: dict) -> None:
        if self.fd is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self.fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None


def _record_of(line: str, keys: set[str]) -> bool:
    try:
        return os.path.abspath(json.loads(line)["path"]) in keys
    except (ValueError, KeyError, TypeError):
        return False


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
    not_done: int = 0         # left by an interrupt or a device error
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
                out = {**out, "caption": None, "error": f"cannot write {sidecar!r}: {e}"}
        rec = {"path": it.path, **out}
        if self.args.prompt is not None:
            rec["prompt"] = self.args.prompt
        if self.jsonl is not None:
            self.jsonl.append(rec)
        if out["error"] is None:
            self.stats.captioned += 1
            self.stats.tokens += out["output_tokens"]
        else:
            self.stats.failed += 1
            self.failures.append((it.path, out["error"]))
            log(f"photon-caption: failed: {it.path}: {out['error']}")


def run(args) -> Summary:
    """Caption every input of the parsed command line -> the run's Summary (counts, times,
    images/s).  Raises UsageError for bad arguments or inputs before loading a model."""
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    for flag in ("kv_cache_tokens", "max_context"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.no_sidecar and not args.jsonl:
        raise UsageError("--no-sidecar needs --jsonl FILE, or nothing would be written")
    if args.no_sidecar and args.output_dir:
        raise UsageError("--output-dir places sidecars; it cannot go with --no-sidecar")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty; give a question, or drop it to caption")
    items = discover(args.inputs, args.recursive, warn=log)
    if not items:
        raise UsageError("no images found in the inputs")
    sidecars = {it.key: None if args.no_sidecar else sidecar_path(it, args.output_dir)
                for it in items}
    if not args.no_sidecar:
        check_collisions(items, [sidecars[it.key] for it in items])

    jsonl = Jsonl(args.jsonl) if args.jsonl else None
    recorded = jsonl.load(warn=log) if jsonl else set()
    if args.overwrite:
        todo = items
        if jsonl:
            jsonl.drop({it.key for it in items})
    else:
        todo = [it for it in items if not _done(it, sidecars[it.key], jsonl, recorded)]
        redo = sum(1 for it in todo if sidecars[it.key] and os.path.exists(sidecars[it.key]))
        if redo:
            log(f"photon-caption: {redo} image(s) have a sidecar but no JSONL record (an "
                "interrupted write, or a new --jsonl); captioning them again")
    skipped = len(items) - len(todo)
    if not todo:
        log(f"photon-caption: all {len(items)} images are done (use --overwrite to redo)")
        return Summary(skipped=skipped)

    from ..model import sharding
    from ..api import Moondream
    from ..engine.request import EngineError

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
                     {"mesh": sharding.make_mesh(len(g), devices=g)})
            models.append(Moondream.load(model_dir, dtype=args.dtype, **where,
                                         max_batch_size=args.batch_size,
                                         max_context=args.max_context,
                                         kv_cache_tokens=args.kv_cache_tokens,
                                         prefix_cache=not args.no_prefix_cache,
                                         compile_cache=not args.no_compile_cache,
                                         warmup=args.warmup, workers=args.workers,
                                         kv_dtype=args.kv_dtype))
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
    finally:
        for m in models:
            m.close()
        if jsonl:
            jsonl.close()
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
    if fatal is not None:
        log(f"photon-caption: stopped: {fatal}; re-run to finish the remaining images")
    return out


def _done(it: Item, sidecar: str | None, jsonl, recorded: set[str]) -> bool:
    ok = it.key in recorded
    if sidecar is None:
        return ok
    return os.path.exists(sidecar) and (jsonl is None or ok)


def build_parser() -> argparse.ArgumentParser:
    """-> photon-caption's argument parser."""
    ap = argparse.ArgumentParser(
        prog="photon-caption",
        description="Caption (or ask one question about) every image of a dataset with a "
                    "Moondream model (a photon-convert directory, a Hugging Face snapshot or "
                    "a hub id).  Re-running skips "
                    "images already done, so an interrupted run is finished by running it "
                    "again.  Exit code: 0 all done, 1 some images failed (or a device error "
                    "stopped the run), 2 bad arguments or model, "
                    "130 interrupted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="directories, globs (quoted; ** recurses), image files, or list "
                         "files (.txt/.lst/.list: one path per line, relative to the list)")
    ap.add_argument("--model", required=True, metavar="MODEL",
                    help="a checkpoint directory written by photon-convert, a Hugging Face "
                         "snapshot directory, or a hub id such as vikhyatk/moondream2 (a "
                         "snapshot is converted once into $PHOTON_JAX_CACHE, default "
                         "~/.cache/photon_jax/checkpoints)")
    ap.add_argument("--revision", default=None,
                    help="with a hub id: the branch, tag or commit, e.g. 2025-06-21")
    ap.add_argument("--recursive", "-r", action="store_true",
                    help="descend into subdirectories of directory inputs")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--length", default="normal", choices=["short", "normal", "long"],
                      help="caption length")
    mode.add_argument("--prompt", default=None,
                      help="ask this question about each image instead of captioning "
                           "(query mode; the JSONL records gain 'prompt')")
    ap.add_argument("--max-tokens", type=int, default=768, help="tokens per image at most")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy: the same caption on every run")
    ap.add_argument("--top-p", type=float, default=0.3, help="nucleus size when temperature > 0")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    ap.add_argument("--repeat-stop", type=int, default=None, metavar="K",
                    help="end a caption whose tail repeats one phrase K times (off if unset)")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="requests decoded together on each device")
    ap.add_argument("--prepend", default="", help="text put before every caption")
    ap.add_argument("--append", default="", help="text put after every caption")
    ap.add_argument("--no-sidecar", action="store_true",
                    help="write no .txt files (needs --jsonl; resume then reads the JSONL)")
    ap.add_argument("--output-dir", default=None,
                    help="put sidecars here, mirroring each input's tree, instead of next to "
                         "the images")
    ap.add_argument("--jsonl", default=None, metavar="FILE",
                    help="append one JSON line per image: path, caption (null on failure), "
                         "finish_reason, output_tokens, error")
    ap.add_argument("--overwrite", action="store_true",
                    help="redo images already done (their old JSONL records are removed)")
    ap.add_argument("--devices", default="0",
                    help="'all' (one engine per local device, images dealt round-robin) or "
                         "device indices such as 0 or 0,1")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="K",
                    help="split one model over K devices (tensor parallel: weights by "
                         "columns, the KV cache by heads; same captions as one device); with "
                         "--devices all, one engine per group of K devices")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="compute dtype (default: the checkpoint's on an accelerator, float32 "
                         "on CPU, where XLA runs bfloat16 slower)")
    ap.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                    help="positions of the paged KV pool shared by every request (default: "
                         "most of the free device memory on an accelerator; room for "
                         "--batch-size full-context sequences on CPU)")
    ap.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                    help="store the KV cache as 8-bit codes with per-position scales: about "
                         "half a bfloat16 cache's bytes, so ~1.9x the tokens in the same "
                         "memory, at a small cost in fidelity (default: the model's dtype)")
    ap.add_argument("--max-context", type=int, default=None, metavar="N",
                    help="the longest sequence (image + prompt + caption) a request may "
                         "reach (default: the model's); it reserves no memory")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not use JAX's persistent compilation cache (default: on, in "
                         "$JAX_COMPILATION_CACHE_DIR or ~/.cache/photon_jax/xla)")
    ap.add_argument("--warmup", action="store_true",
                    help="compile every decode shape, the sampling variants, the common "
                         "prefill shapes and common photo layouts before the first image "
                         "(steady speed from the start; with a warm compile cache it is "
                         "cheap)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="do not keep image prefixes for reuse (only helps when images repeat, "
                         "e.g. several --prompt runs over the same folder)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads decoding and cropping images, per device")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return ap


def main(argv=None) -> int:
    """photon-caption's entry point -> the exit code (0 done, 1 some images failed, 2 bad
    usage or model, 130 interrupted)."""
    args = build_parser().parse_intermixed_args(argv)
    # SIGTERM (a plain `kill`, a scheduler's preemption) stops like Ctrl-C: completed images
    # are written, the run says what is left.
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run(args).exit_code
    except UsageError as e:
        print(f"photon-caption: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt


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


if __name__ == "__main__":
    sys.exit(main())
