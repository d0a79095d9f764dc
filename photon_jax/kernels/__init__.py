"""Layer 1, kernels: hand-written device kernels over the paged KV pool's arrays, and the
CPU's skinny dense products.  They know array shapes, never a model config.

- `cpukernel`: the C++ paged attention and dense products (`csrc/`), built on first use and
  called through the XLA FFI;
- `gpu_attention`: our Pallas (Triton) decode attention and its split plan;
- `tpu_attention`: our Pallas (Mosaic) decode attention and the TPU pool layout it reads.

May import: `base`.
"""
