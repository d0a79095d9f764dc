"""Bytes the GPU decode attention moves per decode step, before (JAX's Pallas
`paged_attention`, as photon_jax called it until issue 25) and after (`gpu_attention`).

Counted, not measured: from each kernel's grid, block shapes and per-program loop bounds at
the rows' real lengths (XLA's cost analysis cannot see inside a Triton call: the deviceless
H200 compile reports none, and a custom call's operands are the whole pool).  Per program:
the K/V pages its loop gathers (whole compute blocks), scales (8-bit pools), table entries
and queries read; its output blocks written (empty programs included, where the kernel
writes them); then the combine of the splits.  Against the attended K/V: every row's
positions 0..length-1, K and V, all layers.

    python bench/gpu_traffic.py                       # Moondream 2, bf16, batch 1/8/32
    python bench/gpu_traffic.py --kv-dtype float8_e4m3fn --positions 1024

One JSON line per (kernel, batch); the table in bench/README.md is these rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H200_SMS = 132


def old_kernel_blocks(m: int, page_size: int, max_positions: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) as `kvpool.kernel_blocks` chose them for JAX's
    kernel: the most splits (<= 16) that divide the table width m (set by max_context), then
    the largest power-of-2 block of <= 8 pages and `max_positions` positions dividing a
    partition."""
    k_splits = max(d for d in range(1, min(m, 16) + 1) if m % d == 0)
    part = m // k_splits
    cap = max(1, min(8, max_positions // page_size))
    per = 1
    while 2 * per <= cap and part % (2 * per) == 0:
        per *= 2
    return k_splits, per


def jax_kernel_traffic(lengths, *, kv_heads, group, head_dim, page_size, table_width,
                       kv_itemsize, q_itemsize, quantized=False, block_h=16) -> dict:
    """JAX's `paged_attention` (jax 0.10.2), vmapped over rows: grid (kv heads,
    cdiv(G, block_h), k_splits) per row; a program whose partition starts past the row's
    pages skips its loop (lax.cond) but still writes its [block_h, H] output (q's dtype) and
    [block_h] max and sum (float32); the others gather `per` pages per iteration,
    cdiv(pages in partition, per) iterations.  The queries are padded to block_h rows (an
    array written, then read by every split); the combine reads the G real rows."""
    lengths = np.asarray(lengths, np.int64)
    max_pos = (128 if kv_itemsize >= 4 and not quantized else 256) * 64 // head_dim
    k_splits, per = old_kernel_blocks(table_width, page_size, max_pos)
    part = table_width // k_splits
    hsplits = -(-group // block_h)
    rows = len(lengths)
    start = np.arange(k_splits)[None, :] * part                      # [1, S]
    end = np.minimum(-(-lengths // page_size)[:, None], start + part)  # [R, S]
    live = end > start
    pages_read = np.where(live, -(-(end - start) // per) * per, 0).sum()
    per_pos = 2 * (head_dim * kv_itemsize + (4 if quantized else 0))
    programs = rows * kv_heads * hsplits * k_splits
    qpad = rows * kv_heads * hsplits * block_h * head_dim * q_itemsize
    read = kv_heads * hsplits * pages_read * (page_size * per_pos + 4) \
        + programs * (block_h * head_dim * q_itemsize + 4)
    written = programs * (block_h * head_dim * q_itemsize + 2 * block_h * 4) + qpad
    return {"programs": int(programs), "empty": int((~live).sum() * kv_heads * hsplits),
            "kv_attended": int(lengths.sum() * kv_heads * per_pos), "read": int(read),
            "written": int(written),
            "combine_read": int(programs * group * (head_dim * q_itemsize + 8)),
            "combine_written": int(rows * kv_heads * group * head_dim * q_itemsize),
            "k_splits": k_splits, "pages_per_block": per}


def main() -> None:
    from photon_jax.kernels import gpu_attention as ga
    from photon_jax.model.config import moondream2

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--positions", type=int, default=1024, help="each row's attended length")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bfloat16",
                    choices=["bfloat16", "float8_e4m3fn", "int8"])
    args = ap.parse_args()
    cfg = moondream2()
    t = cfg.text
    group = t.n_heads // t.n_kv_heads
    quantized = args.kv_dtype != "bfloat16"
    kv_item = 1 if quantized else 2
    width = -(-t.max_context // args.page_size)
    for batch in args.batch:
        lengths = [args.positions] * batch
        common = dict(kv_heads=t.n_kv_heads, group=group, head_dim=t.head_dim,
                      page_size=args.page_size, table_width=width, kv_itemsize=kv_item,
                      quantized=quantized)
        before = jax_kernel_traffic(lengths, q_itemsize=2, **common)
        splits = ga.plan_splits(lengths, t.n_kv_heads, args.page_size, H200_SMS, group)
        after = ga.traffic(lengths, splits=splits, out_itemsize=2, **common)
        after["splits"] = splits
        for name, row in (("jax paged_attention", before), ("gpu_attention", after)):
            layers = {k: v * t.n_layers for k, v in row.items()
                      if k in ("programs", "empty", "kv_attended", "read", "written",
                               "combine_read", "combine_written")}
            print(json.dumps({
                "kind": "gpu_traffic", "kernel": name, "model": "md2", "batch": batch,
                "positions": args.positions, "kv_dtype": args.kv_dtype,
                "page_size": args.page_size, "table_width": width,
                **{k: v for k, v in row.items() if k in ("splits", "k_splits",
                                                          "pages_per_block")},
                **layers,
                "written_over_kv": round(layers["written"] / layers["kv_attended"], 4),
                "all_writes_over_kv": round((layers["written"] + layers["combine_written"])
                                            / layers["kv_attended"], 4),
                "counted": "from grid, block shapes and loop bounds (not measured)"}))


if __name__ == "__main__":
    main()
