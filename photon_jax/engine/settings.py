"""Request settings: defaults (the reference's), validation and clear errors."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

DEFAULT_TEMPERATURE = 0.5
DEFAULT_TOP_P = 0.3
DEFAULT_MAX_TOKENS = 768
DEFAULT_MAX_OBJECTS = 50
DEFAULT_SEED = 0

KNOWN = ("temperature", "top_p", "max_tokens", "max_objects", "seed", "repeat_stop")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_objects: int = DEFAULT_MAX_OBJECTS
    seed: int = DEFAULT_SEED
    # Off by default: end a text generation once its tail is one n-gram (n <= 16) repeated
    # this many times in a row (finish_reason "repeat"); for captions that loop.
    repeat_stop: int | None = None


def _int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, (int,)) and not (
        isinstance(v, float) and v.is_integer()
    ):
        raise SettingsError(f"settings[{name!r}] must be an integer, got {v!r}")
    v = int(v)
    if v < lo:
        raise SettingsError(f"settings[{name!r}] must be >= {lo}, got {v}")
    return v


def parse(settings: dict | None) -> Settings:
    """Validate a user's settings dict; unknown keys are errors (a typo would otherwise be
    silently ignored), except the reference's `variant` (a hosted LoRA id), which is ignored
    with a warning."""
    if settings is None:
        return Settings()
    if isinstance(settings, Settings):
        return settings
    if not isinstance(settings, dict):
        raise SettingsError(f"settings must be a dict, got {type(settings).__name__}")
    s = dict(settings)
    if "variant" in s:
        s.pop("variant")
        warnings.warn("settings['variant'] (hosted LoRA variants) is not supported and is "
                      "ignored", stacklevel=3)
    unknown = sorted(set(s) - set(KNOWN))
    if unknown:
        raise SettingsError(f"unknown settings key(s) {unknown}; known keys: {list(KNOWN)}")
    out = {}
    if "temperature" in s:
        t = s["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SettingsError(f"settings['temperature'] must be a number >= 0, got {t!r}")
        out["temperature"] = float(t)
    if "top_p" in s:
        p = s["top_p"]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise SettingsError(f"settings['top_p'] must be in (0, 1], got {p!r}")
        out["top_p"] = float(p)
    if "max_tokens" in s:
        out["max_tokens"] = _int("max_tokens", s["max_tokens"], 1)
    if "max_objects" in s:
        out["max_objects"] = _int("max_objects", s["max_objects"], 1)
    if s.get("repeat_stop") not in (None, False, 0):
        out["repeat_stop"] = _int("repeat_stop", s["repeat_stop"], 2)
    if "seed" in s:
        out["seed"] = _int("seed", s["seed"], 0) % (2**31)
    return Settings(**out)
