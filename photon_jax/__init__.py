"""photon_jax: Moondream vision-language models in pure JAX."""

__version__ = "0.1.0"

from .api import Moondream  # noqa: E402
from .frontend import EncodedImage  # noqa: E402

__all__ = ["Moondream", "EncodedImage"]
