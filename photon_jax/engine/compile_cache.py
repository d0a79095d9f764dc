"""JAX's persistent compilation cache, turned on by `Moondream.load` and `photon-caption`, so a
second run (or a second process) loads its compiled programs instead of compiling them.

Where: `JAX_COMPILATION_CACHE_DIR` (or `jax_compilation_cache_dir`) if the user set one;
else `$XDG_CACHE_HOME/photon_jax/xla` (default `~/.cache/photon_jax/xla`).  Every program is
cached, however fast it compiled (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` overrides),
since photon_jax compiles many small programs (one per shape bucket).  Switch it off with
`Moondream.load(..., compile_cache=False)` or `photon-caption --no-compile-cache`.

The cache is trusted code: do not point it at a folder others can write (JAX's own warning).
"""

from __future__ import annotations

import os

import jax

_enabled_here: str | None = None


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "photon_jax", "xla")


def enable(directory: str | None = None) -> str:
    """Turn the cache on (idempotent); returns the directory in use.  A directory the user
    configured for JAX wins over `directory` and the default."""
    global _enabled_here
    current = jax.config.jax_compilation_cache_dir
    if current:
        path = current
    else:
        path = os.path.abspath(directory or default_dir())
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _enabled_here = path
    return path


def directory() -> str | None:
    """The cache directory in use, or None if the persistent cache is off."""
    return jax.config.jax_compilation_cache_dir or None
