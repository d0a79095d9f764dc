"""The flags that load a model and size its engine, defined once for every command that
runs one (`photon-caption`, `photon-serve`): their names, help and checks, and the
`Moondream.load` keywords they become.  The defaults that differ between the commands are
arguments of `add_engine_flags`; the device flags differ in kind (`--devices` deals images
over many engines, `--device` picks the server's one) and stay with each command."""

from __future__ import annotations

import argparse
import os


def add_engine_flags(ap: argparse.ArgumentParser, *, warmup: bool,
                     tensor_parallel: int | None, batch_help: str,
                     workers_help: str) -> None:
    """Add the model and engine flags to `ap`.  `warmup`: whether compiling before the
    first request is the default (`--warmup` / `--no-warmup` either way);
    `tensor_parallel`: --tensor-parallel's default."""
    g = ap.add_argument_group("model and engine")
    g.add_argument("--model", required=True, metavar="MODEL",
                   help="a checkpoint directory written by photon-convert, a Hugging Face "
                        "snapshot directory, or a hub id such as vikhyatk/moondream2 (a "
                        "snapshot is converted once into $PHOTON_JAX_CACHE, default "
                        "~/.cache/photon_jax/checkpoints)")
    g.add_argument("--revision", default=None,
                   help="with a hub id: the branch, tag or commit, e.g. 2025-06-21")
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="compute dtype (default: the checkpoint's on an accelerator, float32 "
                        "on CPU, where XLA runs bfloat16 slower)")
    g.add_argument("--batch-size", type=int, default=32, help=batch_help)
    g.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="the longest sequence (image + prompt + answer) a request may reach "
                        "(default: the model's); it reserves no memory")
    g.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                   help="positions of the paged KV pool shared by every request (default: "
                        "most of the free device memory on an accelerator; room for "
                        "--batch-size full-context sequences on CPU)")
    g.add_argument("--kv-dtype", default=None, choices=["int8", "float8_e4m3fn"],
                   help="store the KV cache as 8-bit codes with per-position scales: about "
                        "half a bfloat16 cache's bytes, so ~1.9x the tokens in the same "
                        "memory, at a small cost in fidelity (default: the model's dtype)")
    g.add_argument("--weights", default=None, choices=["int8", "fp8", "int4"],
                   help="hold the text model's linear layers, experts and LM head quantized "
                        "(int8/fp8: a scale per output channel, ~1/2 of bfloat16's bytes; "
                        "int4: groups of 128, head int8), quantized as the model loads; the "
                        "freed memory goes to the KV cache (default: the checkpoint's own "
                        "weights; a checkpoint converted with photon-convert --weights is "
                        "already quantized)")
    g.add_argument("--tensor-parallel", type=int, default=tensor_parallel, metavar="K",
                   help="split one model over K devices (tensor parallel: weights by "
                        "columns, the KV cache by heads; the same answers as one device)")
    g.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help=workers_help)
    g.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep image prefixes for reuse (helps when images repeat: several "
                        "questions about one image)")
    g.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="use JAX's persistent compilation cache ($JAX_COMPILATION_CACHE_DIR "
                        "or ~/.cache/photon_jax/xla)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=warmup,
                   help="compile every decode shape, the sampling variants and the common "
                        "prefill shapes before the first request (steady speed from the "
                        "start; cheap with a warm compile cache)")
    g.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="load a LoRA adapter (a finetune variant's final.pt, or a "
                        ".safetensors file with its names) under NAME; repeat for more.  "
                        "Requests select one with the variant setting")
    g.add_argument("--max-adapters", type=int, default=None, metavar="N",
                   help="adapter slots on the device: adapters in use at one time (default: "
                        "4, made when the first adapter is loaded: until then the programs "
                        "have no adapter products; 0: none, a variant is refused)")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="the largest adapter rank the slots hold (default 16)")


def engine_flag_error(args: argparse.Namespace) -> str | None:
    """The first engine flag whose value cannot work, as a message naming it; None if all
    can."""
    for flag, v in (("--batch-size", args.batch_size), ("--workers", args.workers),
                    ("--tensor-parallel", args.tensor_parallel),
                    ("--kv-cache-tokens", args.kv_cache_tokens),
                    ("--max-context", args.max_context),
                    ("--max-lora-rank", args.max_lora_rank)):
        if v is not None and v < 1:
            return f"{flag} must be >= 1, got {v}"
    if args.max_adapters is not None and args.max_adapters < 0:
        return f"--max-adapters must be >= 0, got {args.max_adapters}"
    for a in args.adapter:
        name, eq, path = a.partition("=")
        if not eq or not name or not path:
            return f"--adapter {a!r}: give NAME=PATH"
    return None


def adapter_paths(args: argparse.Namespace) -> dict | None:
    """--adapter NAME=PATH flags as `Moondream.load`'s `adapters` (None: none given)."""
    return dict(a.partition("=")[::2] for a in args.adapter) or None


def engine_options(args: argparse.Namespace) -> dict:
    """The `Moondream.load` keywords the engine flags give (the model, its revision and the
    devices are each command's)."""
    return dict(dtype=args.dtype, max_batch_size=args.batch_size,
                max_context=args.max_context, kv_cache_tokens=args.kv_cache_tokens,
                kv_dtype=args.kv_dtype, weights=args.weights, prefix_cache=args.prefix_cache,
                compile_cache=args.compile_cache, warmup=args.warmup, workers=args.workers,
                adapters=adapter_paths(args), max_adapters=args.max_adapters,
                max_lora_rank=args.max_lora_rank)
