"""Request settings: defaults (the reference's), validation and clear errors."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

DEFAULT_TEMPERATURE = 0.5
DEFAULT_TOP_P = 0.3
DEFAULT_MAX_TOKENS = 768
DEFAULT_MAX_OBJECTS = 50
DEFAULT_SEED = 0

SHAPES = ("json_schema", "regex", "choices")
KNOWN = ("temperature", "top_p", "max_tokens", "max_objects", "seed", "repeat_stop",
         "stop", "variant", "logprobs") + SHAPES
MAX_STOPS = 4   # OpenAI's bound
MAX_TOP_LOGPROBS = 20   # alternatives per token (OpenAI's bound; the sampler's static width)
MAX_STOP_CHARS = 256   # each: the stream's hold-back check is quadratic in it
# A shape's spec as canonical JSON: llguidance bounds the grammar it builds (500k symbols),
# but compiling one that large takes ~0.2 s and its per-token masks up to ~25 ms a row
# (measured: a 100-branch anyOf of 30-property objects); this keeps both well below.
MAX_SHAPE_BYTES = 64 << 10


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
    # The answer held to a shape (engine/grammar.py): (kind, the spec as canonical JSON),
    # kind one of SHAPES; None = free text.
    shape: tuple | None = None
    # Stop strings: a text answer ends before the first one (finish reason "stop").
    stop: tuple = ()
    # The LoRA adapter (a finetune "variant") the answer is generated under; None: the base.
    variant: str | None = None
    # Log-probabilities of the answer's tokens: None = off; k = each token's own and the k
    # most likely ids at its position (k <= MAX_TOP_LOGPROBS).  From the model's logits as
    # they are, before temperature, top-p and shapes (vLLM's default, "raw" logprobs).
    logprobs: int | None = None


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
    silently ignored).  `variant` names a LoRA adapter; whether it is loaded is the
    engine's to say (None or "" = the base model, as the reference's None)."""
    if settings is None:
        return Settings()
    if isinstance(settings, Settings):
        return settings
    if not isinstance(settings, dict):
        raise SettingsError(f"settings must be a dict, got {type(settings).__name__}")
    s = dict(settings)
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
    shape = _shape(s)
    if shape is not None:
        out["shape"] = shape
    if s.get("stop") is not None:
        out["stop"] = _stops(s["stop"])
    v = s.get("variant")
    if v not in (None, ""):
        if not isinstance(v, str) or len(v) > 256:
            raise SettingsError(f"settings['variant'] must be an adapter name (a string of at "
                                f"most 256 characters), got {str(v)[:80]!r}")
        out["variant"] = v
    lp = s.get("logprobs")
    if lp is not None and lp is not False:   # (0 == False: 0 alternatives is "on")
        if lp is True:
            lp = 0
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise SettingsError(
                f"settings['logprobs'] must be true (each answer token's log-probability) "
                f"or an integer 0 to {MAX_TOP_LOGPROBS} (also that many most likely "
                f"alternatives per token), got {str(lp)[:80]!r}")
        out["logprobs"] = lp
    return Settings(**out)


def _stops(v) -> tuple:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)) or not 1 <= len(stops) <= MAX_STOPS or not all(
            isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops):
        raise SettingsError(f"settings['stop'] must be a string of 1 to {MAX_STOP_CHARS} "
                            f"characters or a list of 1 to {MAX_STOPS} of them, got "
                            f"{str(v)[:80]!r}")
    return tuple(stops)


def _shape(s: dict) -> tuple | None:
    """The output shape among the settings (at most one), its spec checked for type; the
    grammar itself is compiled when the request is submitted (engine/grammar.py)."""
    given = [k for k in SHAPES if s.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise SettingsError(f"settings {given}: give at most one output shape (json_schema, "
                            "regex or choices)")
    kind = given[0]
    v = s[kind]
    if kind == "json_schema" and not isinstance(v, dict):
        raise SettingsError("settings['json_schema'] must be a JSON schema object (a dict), "
                            f"got {type(v).__name__}")
    if kind == "regex" and (not isinstance(v, str) or not v):
        raise SettingsError(f"settings['regex'] must be a non-empty string, got {v!r}")
    if kind == "choices" and (not isinstance(v, (list, tuple)) or not v or not all(
            isinstance(c, str) and c for c in v)):
        raise SettingsError("settings['choices'] must be a non-empty list of non-empty "
                            f"strings, got {v!r}")
    try:
        spec = json.dumps(list(v) if kind == "choices" else v, sort_keys=True,
                          separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"settings[{kind!r}] is not plain JSON: {e}") from None
    except RecursionError:
        raise SettingsError(f"settings[{kind!r}] is nested too deeply") from None
    if len(spec) > MAX_SHAPE_BYTES:
        raise SettingsError(f"settings[{kind!r}] is {len(spec)} bytes as JSON, more than "
                            f"{MAX_SHAPE_BYTES}; send a smaller shape")
    return kind, spec
