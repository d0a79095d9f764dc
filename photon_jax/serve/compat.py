"""`photon-serve`'s compatibility with published clients: their spellings of a request body
mapped to the server's own, before the body is parsed.

Owns: `normalize(body, route)` -> (the body in the server's spellings, warnings).  It knows
what the clients send that the server spells differently or does not use (tests/
test_clients.py drives the clients themselves):

- the `moondream` Node client (npm, 0.2.0) types its settings camelCase (`SamplingSettings`
  in dist/src/types.d.ts: `maxTokens`) and puts the object on the wire as the caller wrote
  it (`segment` copies `request.settings` into the body); the server's settings keys are
  snake_case (`max_tokens`, `max_objects`, `top_p`, `repeat_stop`);
- the Node client sends `variant` (a fine-tune adapter id) as a top-level field whenever
  the caller gives one; the reference and this server take it in the settings, so it moves
  there (the engine refuses an adapter it has not loaded, by name).

Everything else is left as it came: an unknown field or a bad value is the parser's to refuse
(`inputs.Fields`, the engine's settings check), with its own message.  Pure: no I/O, and the
caller's dict is not modified.
"""

from __future__ import annotations

# camelCase -> the server's key, for every settings key (engine/settings.py's KNOWN) whose
# two spellings differ; a test holds this table to KNOWN so that a new key gets its alias.
SETTINGS_ALIASES = {
    "maxTokens": "max_tokens",
    "maxObjects": "max_objects",
    "topP": "top_p",
    "repeatStop": "repeat_stop",
    "jsonSchema": "json_schema",
}


def normalize(body: dict, route: str) -> tuple[dict, list[str]]:
    """A request body as a client sent it -> (the body in the server's spellings, warnings
    for what was dropped).  `route` names the request in messages ("caption", "segment"...).

    Raises ValueError when a setting is given in both spellings with different values: which
    one the client meant is not ours to guess."""
    if not isinstance(body, dict):
        return body, []   # not an object: the server's body check says so
    out = dict(body)
    warnings = []
    # Settings are the only place a client puts camelCase keys (the Node client spells its
    # own top-level fields snake_case on the wire: image_url, spatial_refs).
    if isinstance(out.get("settings"), dict):
        out["settings"] = _settings(out["settings"], route)
    if "variant" in out:
        # The Node client sends a finetune's id as a top-level `variant` (the reference
        # takes it in settings); a null or empty one asks for the base model.
        variant = out.pop("variant")
        if variant not in (None, ""):
            settings = out.get("settings")
            if settings is None:
                settings = {}
            if isinstance(settings, dict):
                if settings.get("variant") not in (None, "", variant):
                    raise ValueError(f"{route}: variant {variant!r} and settings.variant "
                                     f"{settings['variant']!r} differ; send one")
                out["settings"] = {**settings, "variant": variant}
    return out, warnings


def _settings(settings: dict, route: str) -> dict:
    """The settings object with camelCase keys renamed, in the caller's order."""
    out = {}
    for key, value in settings.items():
        canon = SETTINGS_ALIASES.get(key)
        if canon is None:
            if key not in out:    # not already filled from its camelCase twin
                out[key] = value
            continue
        other = settings.get(canon)
        # null is "not given", as the server's field parsing reads it: the other spelling
        # wins without a conflict.
        if value is not None and other is not None and other != value:
            raise ValueError(
                f"{route}: settings gives both {key!r} ({value!r}) and {canon!r} ({other!r}); "
                f"send one of them ({canon!r} is this server's spelling)")
        out[canon] = value if other is None else other
    return out
