"""How should a decode step read the KV cache on this backend?  The attention of one decode
step (every layer: write the new position, attend) for each formulation, one JSON line per
(formulation, page size, batch):

  dense_scan    the old layout: one dense cache [L, rows, S, K, H], a scan over layers that
                gathers each row's first S positions (S = the batch's longest row, rounded
                up to 256) and attends: rows pay for the longest row, the gather copies
  paged_gather  per-layer page pools; each row's pages gathered into a contiguous buffer
                (materialised), then the ordinary attention: each row reads its own pages
  paged_sweep   the XLA fallback on CPU: every page of the arenas in use scored against
                its owner row's query in one batched matmul each for K and V, reading the
                pool in place; per-page partials combined in each row's page order
  paged_sweep_mul  the same sweep as elementwise multiply + reduce instead of matmuls
  paged_kernel  what photon_jax runs on CPU when a C++ compiler is present: our kernel
                (`photon_jax/kernels/cpukernel.py`) walks each row's page table to its length, one
                online-softmax pass per (row, kv head); XLA's cost analysis cannot see into
                it, so its bytes are XLA's plus what the kernel reads and writes

Keys: ms (median of --reps timed calls), bytes_accessed (XLA's cost analysis of the compiled
program), attended_kv_bytes (what the rows attend, K and V, every layer) and their ratio.
The config is `inflight.py`'s "small" (4 layers, 8 kv heads of 64); every row decodes
position --position.

    python bench/kv.py                       # batches 1 8 32, page sizes 16 32 64 128
    python bench/kv.py --batch 32 --pages 64 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, env_info, median, reexec_with_allocator_env, row_tables  # noqa: E402


def formulations(cfg, batch: int, position: int, page: int):
    """{name: (jitted fn, args)} of one decode step's attention over every layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from photon_jax.engine import kvpool, stepmeta as M
    from photon_jax.engine.pages import pages_for
    from photon_jax.model.layers import attention

    t = cfg.text
    L, K, H = t.n_layers, t.n_kv_heads, t.head_dim
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, t.n_heads, H)), jnp.float32)
    new = jnp.asarray(rng.normal(size=(batch, K, H)), jnp.float32)
    pos = np.full(batch, position, np.int32)
    out = {}

    # dense_scan: the layout photon_jax had before the pool.
    S = -(-(position + 1) // 256) * 256
    dense = jnp.zeros((L, batch + 1, t.max_context, K, H), jnp.float32)
    rows = jnp.arange(1, batch + 1, dtype=jnp.int32)

    def dense_scan(kc, vc, q, new, rows, pos):
        def body(carry, li):
            kc, vc, acc = carry

            def put(r, c):   # slice updates, as the pool's writes (a scatter would be
                kc, vc = c   # charged the whole cache by the cost analysis)
                at = (li, rows[r], pos[r], 0, 0)
                x = new[r][None, None, None]
                return (jax.lax.dynamic_update_slice(kc, x, at),
                        jax.lax.dynamic_update_slice(vc, x, at))
            kc, vc = jax.lax.fori_loop(0, batch, put, (kc, vc))
            mask = (jnp.arange(S)[None, None] <= pos[:, None, None])
            a = attention(q[:, None], kc[li, rows, :S], vc[li, rows, :S], mask)
            return (kc, vc, acc + a[:, 0]), None
        (kc, vc, acc), _ = jax.lax.scan(body, (kc, vc, jnp.zeros((batch, t.n_heads * H))),
                                        jnp.arange(L))
        return kc, vc, acc

    out["dense_scan"] = (jax.jit(dense_scan, donate_argnums=(0, 1)),
                         [dense, dense + 0, q, new, rows, jnp.asarray(pos)])

    # The pool: every row's pages for positions 0..position, arenas as the engine's CPU plan.
    n_row = pages_for(position + 1, page)
    tables = row_tables(batch, position + 1, page)
    arenas = M.Arenas.geometric(batch * n_row + 1, pages_for(t.max_context, page))
    meta, pages, n = M.pack_decode(list(range(1, batch + 1)), list(pos), tables, batch,
                                   pages_for(t.max_context, page), page, arenas)
    def pool():
        return [tuple(jnp.zeros((K, s, page, H), jnp.float32) for s in arenas.sizes[:n])
                for _ in range(L)]

    pg, off = jnp.asarray(meta[M.M_PAGE]), jnp.asarray(meta[M.M_OFF])
    table = jnp.asarray(meta[M.M_TABLE:].T)
    owner, count = jnp.asarray(pages[0]), jnp.asarray(pages[1])

    def paged(attend):
        def step(kp, vp, q, new):
            acc = 0.0
            kp, vp = list(kp), list(vp)
            for li in range(L):
                kp[li], vp[li] = kvpool.write_rows(kp[li], vp[li], pg, off, new, new)
                acc = acc + attend(kp[li], vp[li], q)
            return kp, vp, acc
        return jax.jit(step, donate_argnums=(0, 1))

    def gather(ka, va, q):
        m = table.shape[1]
        mask = jnp.arange(m * page)[None, None] <= jnp.asarray(pos)[:, None, None]
        return kvpool.prefill_attend(ka, va, q[:, None], table, mask)[:, 0].reshape(batch, -1)

    def sweep(ka, va, q):
        return kvpool.decode_attend(ka, va, q, owner, count, table)

    def sweep_mul(ka, va, q):
        qq = q.reshape(batch, K, -1, H)
        parts = []
        for kt, vt, (st, size) in zip(ka, va, kvpool._spans(ka)):
            qz = jnp.concatenate([qq, jnp.zeros_like(qq[:1])])[owner[st:st + size]]
            s = (qz.transpose(1, 0, 2, 3)[:, :, :, None, :] * kt[:, :, None]).sum(-1) * H ** -0.5
            valid = jnp.arange(page)[None, None, None] < count[st:st + size][None, :, None, None]
            s = jnp.where(valid, s, -jnp.inf)
            mx = s.max(-1)
            e = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0)[..., None]), 0)
            o = (e[..., None] * vt[:, :, None]).sum(3)
            parts.append((mx, e.sum(-1), o))
        mx, lsum, o = (jnp.concatenate(x, 1) for x in zip(*parts))
        return kvpool.combine_partials(mx, lsum, o, table).reshape(batch, -1)

    for name, fn in (("paged_gather", gather), ("paged_sweep", sweep),
                     ("paged_sweep_mul", sweep_mul)):
        out[name] = (paged(fn), [pool(), pool(), q, new])

    # paged_kernel: the CPU kernel (photon_jax/kernels/cpukernel.py) over one arena holding every
    # page, as the engine lays the pool out for it; it walks each row's table to its length.
    from photon_jax.kernels import cpukernel
    if jax.default_backend() == "cpu" and cpukernel.load():
        length = jnp.asarray(pos + 1)
        one = M.Arenas((arenas.n_pages,))
        meta1, _, _ = M.pack_decode(list(range(1, batch + 1)), list(pos), tables, batch,
                                    pages_for(t.max_context, page), page, one)
        pg1, off1 = jnp.asarray(meta1[M.M_PAGE]), jnp.asarray(meta1[M.M_OFF])
        table1 = jnp.asarray(meta1[M.M_TABLE:].T)

        def kernel_step(kp, vp, q, new):
            acc = 0.0
            kp, vp = list(kp), list(vp)
            for li in range(L):
                kp[li], vp[li] = kvpool.write_rows(kp[li], vp[li], pg1, off1, new, new)
                acc = acc + cpukernel.attend(kp[li][0], vp[li][0], q, table1, length)
            return kp, vp, acc

        def pool1():
            return [(jnp.zeros((K, arenas.n_pages, page, H), jnp.float32),) for _ in range(L)]

        out["paged_kernel"] = (jax.jit(kernel_step, donate_argnums=(0, 1)),
                               [pool1(), pool1(), q, new])
    return out


def measure(cfg, name, fn, args, reps: int) -> dict:
    import jax

    comp = fn.lower(*args).compile()
    ca = comp.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    ts = []
    for k in range(reps + 1):
        t0 = time.perf_counter()
        outs = fn(*args)
        jax.block_until_ready(outs)
        if k:
            ts.append(time.perf_counter() - t0)
        args = [outs[0], outs[1], *args[2:]]
    return {"ms": round(1e3 * median(ts), 3), "bytes_accessed": int(ca["bytes accessed"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--position", type=int, default=760)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    reexec_with_allocator_env(__file__)
    from photon_jax.kernels import cpukernel

    cfg = CONFIGS[args.config]().with_dtype("float32")
    t = cfg.text
    for batch in args.batch:
        kv = 2 * t.n_layers * batch * (args.position + 1) * t.n_kv_heads * t.head_dim * 4
        for page in args.pages:
            for name, (fn, fargs) in formulations(cfg, batch, args.position, page).items():
                if name == "dense_scan" and page != args.pages[0]:
                    continue   # no pages: measured once per batch
                r = measure(cfg, name, fn, fargs, args.reps)
                if name == "dense_scan":
                    # XLA's cost analysis counts a loop body once: scale by the layer count.
                    r["bytes_accessed"] *= t.n_layers
                if name == "paged_kernel":
                    # A custom call is opaque to XLA's cost analysis.
                    r["xla_bytes_accessed"] = r["bytes_accessed"]
                    r["bytes_accessed"] = r["xla_bytes_accessed"] + cpukernel.bytes_accessed(
                        kv, t.n_layers, batch, t.n_heads, t.head_dim)
                print(json.dumps({"kind": "kv", "config": args.config, "formulation": name,
                                  "page_size": None if name == "dense_scan" else page,
                                  "batch": batch, "position": args.position, **r,
                                  "attended_kv_bytes": kv,
                                  "bytes_over_attended": round(r["bytes_accessed"] / kv, 3),
                                  **env_info()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
