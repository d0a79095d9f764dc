"""photon_jax: Moondream vision-language models in pure JAX."""

import os as _os

__version__ = "0.1.0"

# `photon_jax.convert` is the top-level `convert/` folder, which an installed package maps in
# (pyproject's package-dir).  Run from a source checkout instead (`python -m pytest`,
# `PYTHONPATH=. python bench/...`, a GPU machine that cannot pip install), the package finds
# it here.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "convert"))
        and _os.path.isfile(_os.path.join(_checkout, "convert", "__init__.py"))):
    __path__.append(_checkout)

from .api import Moondream  # noqa: E402
from .frontend import EncodedImage  # noqa: E402

__all__ = ["Moondream", "EncodedImage"]
