"""photon_jax: Moondream vision-language models in pure JAX."""

__version__ = "0.1.0"
