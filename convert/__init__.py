"""Hugging Face Moondream checkpoints -> photon_jax checkpoint directories.

Installed as `photon_jax.convert` (setuptools maps this top-level folder into the package), so
`photon-convert` works from a wheel as well as from a checkout.
"""

from .convert import ConvertError, convert  # noqa: F401
