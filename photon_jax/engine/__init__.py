"""Layer 3, engine: serving the model to many requests at once.

- device side: `step` (the one place that calls `jax.jit`: every device program),
  `kvpool` (the paged KV pool: layout, writes, the attention that reads it in place),
  `stepmeta` (the per-step metadata the host uploads), `memory` (what fits), `hostsync`
  (no hidden host syncs), `compile_cache`;
- host side: `core` (`Engine`: the pipelined runner), `scheduler`, `inflight` (the two-slot
  state machine), `pages` (page allocator, prefix cache), `request` (`Request`, `Handle`),
  `settings`, `skills` and `constraints` (per-request state machines and what they ban),
  `streaming` (detokenising), `frontend` (images to prefixes, `EncodedImage`);
- `reference`: one request at a time, the reference's control flow: the oracle the tests
  and benchmarks hold the engine to.

May import: `model`, `kernels`, `base`.
"""
