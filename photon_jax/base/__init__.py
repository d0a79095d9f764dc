"""Layer 0, base: what every other layer may use and which uses nothing of ours.

- `dtypes`: the dtype policy (compute dtypes, float32 statistics, matmul precision).
- `compat`: the one door to JAX's private and experimental APIs, each checked.

May import: nothing of photon_jax.
"""
