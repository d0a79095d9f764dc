"""The dtype policy, in one place.

Weights and activations live in the config's dtype (bf16 on accelerators, float32 allowed
everywhere).  Norm statistics, softmax, logits, sampling and the region values are computed in
float32.  Matmuls in float32 mode ask for full precision: on GPU and TPU the default
precision would silently use TF32 / bf16 passes and break parity with the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32

_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}


def canonical(name) -> str:
    """'bf16' | 'bfloat16' | jnp.bfloat16 | np.dtype -> 'bfloat16' (or 'float32')."""
    if name is None:
        raise ValueError("dtype must not be None here")
    if not isinstance(name, str):
        name = np.dtype(name).name
    name = _ALIASES.get(name.lower(), name.lower())
    if name not in _NAMES:
        raise ValueError(f"unsupported dtype {name!r}; use 'bfloat16' or 'float32'")
    return name


def jnp_dtype(name) -> jnp.dtype:
    return jnp.dtype(_NAMES[canonical(name)])


def matmul_precision(dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
