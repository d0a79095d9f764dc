"""photon_jax: Moondream vision-language models in pure JAX.

The package is layered, each layer a folder importing only the layers below it
(docs/architecture.md, "The layers"; tests/test_layout.py holds it): `base`, `kernels`,
`model`, `engine`, then the faces at this level (`api`, `aio`, `functional`, `sources`),
then the applications over them (`serve`, `dataset`) and the command lines (`cli`).
`photon_jax.Moondream` is the entry point."""

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

from .api import EncodedImage, Moondream  # noqa: E402

__all__ = ["Moondream", "EncodedImage"]
