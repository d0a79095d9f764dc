"""`photon-convert HF_DIR OUT_DIR` (also `python -m photon_jax.cli.convert` or
`python -m photon_jax.convert`): the command-line front of `photon_jax.convert`."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="photon-convert",
        description="Convert a Hugging Face Moondream 2 or 3 snapshot (model.safetensors or a sharded "
        "index, config.json, tokenizer.json) into a photon_jax checkpoint directory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("hf_dir", help="the downloaded HF snapshot directory")
    ap.add_argument("out_dir", help="where to write the photon_jax checkpoint")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="storage dtype of the converted weights")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json to bundle (default: HF_DIR/tokenizer.json); for the "
                    "2025-06-21 revision it comes from the moondream/starmie-v1 repo")
    ap.add_argument("--weights", default=None, choices=["int8", "fp8", "int4"],
                    help="quantize the text model's linear layers, experts and LM head (int8 "
                    "and fp8: a scale per output channel; int4: scale and zero point per group "
                    "of 128 inputs, head int8); the vision encoder stays in --dtype. Weights a "
                    "checkpoint publishes quantized (Moondream 3.1 FP8 experts, Moondream 2 "
                    "4-bit) are kept as published either way")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty OUT_DIR")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..convert import ConvertError, convert

    try:
        convert(args.hf_dir, args.out_dir, dtype=args.dtype, tokenizer=args.tokenizer,
                weights=args.weights,
                overwrite=args.overwrite, log=lambda s: print(s, file=sys.stderr))
    except ConvertError as e:
        print(f"photon-convert: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unwritable output, disk full, ...: a message, not a traceback
        print(f"photon-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
