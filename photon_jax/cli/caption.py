"""`photon-caption` (also `python -m photon_jax.cli.caption`): caption, or ask one question
about, every image of a dataset, into sidecar `.txt` files and/or one JSONL file.

The command line only: its flags (the engine's from `flags`), the checks of their values,
SIGTERM as Ctrl-C, and the exit code.  The run itself is `photon_jax.dataset`'s: `job` (the
engines, the window in flight, the summary) over `files` (inputs, outputs, resume).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..dataset import job
from ..dataset.files import UsageError
from .flags import add_engine_flags, engine_flag_error, engine_options


def build_parser() -> argparse.ArgumentParser:
    """-> photon-caption's argument parser."""
    ap = argparse.ArgumentParser(
        prog="photon-caption",
        description="Caption (or ask one question about) every image of a dataset with a "
                    "Moondream model (a photon-convert directory, a Hugging Face snapshot or "
                    "a hub id).  Re-running skips "
                    "images already done, so an interrupted run is finished by running it "
                    "again.  Exit code: 0 all done, 1 some images failed (or a device error, "
                    "or an output that cannot be written, such as on a full disk, stopped "
                    "the run), 2 bad arguments or model, 130 interrupted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="directories, globs (quoted; ** recurses), image files, or list "
                         "files (.txt/.lst/.list: one path per line, relative to the list)")
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
    ap.add_argument("--variant", default=None, metavar="NAME",
                    help="caption with this LoRA adapter (one loaded with --adapter "
                         "NAME=PATH, or a variant id found in the reference's md_variants "
                         "cache folder)")
    ap.add_argument("--prepend", default="", help="text put before every caption")
    ap.add_argument("--append", default="", help="text put after every caption")
    ap.add_argument("--no-sidecar", action="store_true",
                    help="write no .txt files (needs --jsonl; resume then reads the JSONL)")
    ap.add_argument("--output-dir", default=None,
                    help="put sidecars here, mirroring each input's tree, instead of next to "
                         "the images")
    ap.add_argument("--jsonl", default=None, metavar="FILE",
                    help="append one JSON line per image: path (absolute; with path_b64, "
                         "its exact bytes, when the name is not UTF-8), caption (null on "
                         "failure), finish_reason, output_tokens, error")
    ap.add_argument("--overwrite", action="store_true",
                    help="redo images already done (their old JSONL records are removed)")
    ap.add_argument("--devices", default="0",
                    help="'all' (one engine per local device, images dealt round-robin) or "
                         "device indices such as 0 or 0,1; with --tensor-parallel K, one "
                         "engine per group of K devices")
    add_engine_flags(ap, warmup=False, tensor_parallel=1,
                     batch_help="requests decoded together on each device",
                     workers_help="threads decoding and cropping images, per device")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return ap


def run(args: argparse.Namespace) -> job.Summary:
    """Caption every input of the parsed command line -> the run's `Summary` (counts,
    times, images/s).  Raises `UsageError` for bad arguments or inputs before loading a
    model."""
    if (msg := engine_flag_error(args)) is not None:
        raise UsageError(msg)
    if args.variant and args.max_adapters == 0:
        raise UsageError("--variant needs adapter slots; drop --max-adapters 0")
    return job.run(args, engine_options(args))


def main(argv=None) -> int:
    """photon-caption's entry point -> the exit code (0 done, 1 some images failed or the run
    stopped on a device error or a failed write, 2 bad usage or model, 130 interrupted)."""
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
        return job.EXIT_USAGE
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
