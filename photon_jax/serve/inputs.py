"""`photon-serve`'s request parsing: what a JSON body may hold, and what it becomes.

Owns: `ApiError` (a refused request: status, message, type; its JSON response), `Fields`
(typed field access that refuses unknown fields), the server's settings bound (max_tokens
within the context) and OpenAI chat requests mapped to one `query` (`parse_chat`).  Bodies
and images are the intake's (`intake`).
Everything here is pure: no model, no event loop.  Every message names the input and the
fix.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..api import MAX_TOP_LOGPROBS


class ApiError(Exception):
    """A request refused with `status` and a JSON body naming the input and the fix."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param}},
                            status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 for the client's input `param`."""
    return ApiError(400, message, param=param)


# -- request fields -------------------------------------------------------------------------

class Fields:
    """A JSON body's fields, taken one at a time with their types checked; `done()` refuses
    whatever is left (a typo is an error, not a silently ignored field)."""

    def __init__(self, body: dict, route: str):
        self.body, self.route, self.left = body, route, set(body)

    def take(self, name: str, types, default=None, required: bool = False, what: str = ""):
        self.left.discard(name)
        if name not in self.body or self.body[name] is None:
            if required:
                raise bad(f"{self.route}: field {name!r} is required ({what})", name)
            return default
        v = self.body[name]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
            raise bad(f"{self.route}: field {name!r} must be {what}, got "
                       f"{type(v).__name__} {_short(v)}", name)
        return v

    def done(self) -> None:
        if self.left:
            raise bad(f"{self.route}: unknown field(s) {sorted(self.left)}; this route takes "
                       f"{sorted(set(self.body) - self.left)} and the documented optional "
                       "fields (docs/serving.md)", sorted(self.left)[0])


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _short(v, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def check_settings(settings, max_context: int, param: str = "settings") -> dict | None:
    """A settings dict as the API takes it, plus the server's own bound: max_tokens no more
    than the context (the API would cap it silently)."""
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise bad(f"{param} must be an object such as {{\"max_tokens\": 256}}, got "
                   f"{type(settings).__name__}", param)
    mt = settings.get("max_tokens")
    if isinstance(mt, (int, float)) and not isinstance(mt, bool) and mt > max_context:
        raise bad(f"{param}.max_tokens={mt} is more than the model's context of "
                   f"{max_context} tokens (image and prompt included); ask for fewer", param)
    return settings


# -- chat completions -----------------------------------------------------------------------

# OpenAI fields that change what the model should do: refused with their name, not ignored.
_CHAT_UNSUPPORTED = {
    "tools": "tools / function calling", "tool_choice": "tools / function calling",
    "functions": "function calling", "function_call": "function calling",
    "logit_bias": "logit_bias", "audio": "audio output", "prediction": "predicted outputs",
}


MAX_N = 8   # answers per chat request (each is a row of the batch)
MAX_CHAT_IMAGES = 4   # images per conversation (decoded before anything runs)


def _response_format(rf) -> dict:
    """OpenAI's response_format -> the settings that hold the answer to it."""
    if rf is None:
        return {}
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad("chat/completions: response_format json_schema needs "
                       "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
        return {"json_schema": schema}
    raise bad("chat/completions: response_format type must be \"text\", \"json_object\" or "
               f"\"json_schema\", got {_short(kind)}", "response_format")


def parse_chat(body: dict, max_context: int) -> dict:
    """An OpenAI chat request -> {"messages" (as sent), "images" [(message index, part
    index, URL)], "text_chars", "settings", "stream", "include_usage", "reasoning" (None:
    the model's default)}.  The conversation's own rules (roles, order, where images may
    be) are the API's (`Moondream.chat`); this checks the body's shape, the fields OpenAI
    has and Moondream has not, and the image count before any image is decoded."""
    for k, what in _CHAT_UNSUPPORTED.items():
        if body.get(k) not in (None, False, [], {}):
            raise bad(f"chat/completions: {what} ({k!r}) is not supported by this server", k)
    for k in ("presence_penalty", "frequency_penalty"):
        if body.get(k) not in (None, 0, 0.0):
            raise bad(f"chat/completions: {k!r} is not supported (leave it 0 or unset)", k)
    answers = body.get("n", 1)
    if answers is None:
        answers = 1
    if isinstance(answers, bool) or not isinstance(answers, int) or not 1 <= answers <= MAX_N:
        raise bad(f"chat/completions: n must be an integer from 1 to {MAX_N}, got "
                   f"{_short(answers)}", "n")
    if body.get("modalities") not in (None, ["text"]):
        raise bad("chat/completions: only text output (modalities [\"text\"]) is supported",
                   "modalities")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("chat/completions: 'messages' must be a non-empty list of {role, content}",
                   "messages")
    if len(msgs) > max_context:   # every turn renders at least one token
        raise bad(f"chat/completions: {len(msgs)} messages cannot fit the model's context of "
                   f"{max_context} tokens; send a shorter conversation", "messages")
    images, chars = [], 0
    for n, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise bad(f"chat/completions: messages[{n}] must be an object with 'role' and "
                       f"'content', got {_short(msg)}", "messages")
        content = msg.get("content")
        parts = content if isinstance(content, list) else [content]
        for k, part in enumerate(parts):
            if isinstance(part, str):
                chars += len(part)
            elif isinstance(part, dict) and part.get("type") == "text" and \
                    isinstance(part.get("text"), str):
                chars += len(part["text"])
            elif isinstance(part, dict) and part.get("type") == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                if not isinstance(url, str):
                    raise bad(f"chat/completions: messages[{n}].content[{k}]: an image_url "
                               "part needs {\"image_url\": {\"url\": \"data:image/...;base64,...\"}}",
                               "messages")
                images.append((n, k, url))
    if len(images) > MAX_CHAT_IMAGES:
        raise bad(f"chat/completions: {len(images)} images given; this server takes at most "
                  f"{MAX_CHAT_IMAGES} per conversation (each is decoded, and takes "
                  "729 positions of the context): send fewer", "messages")
    settings = _response_format(body.get("response_format"))
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    for src, key in ((mt, "max_tokens"), (body.get("temperature"), "temperature"),
                     (body.get("top_p"), "top_p"), (body.get("seed"), "seed"),
                     (body.get("stop"), "stop")):
        if src is not None:
            settings[key] = src
    check_settings(settings, max_context, "max_completion_tokens")
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"chat/completions: 'logprobs' must be true or false, got {_short(lp)}",
                  "logprobs")
    if top is not None:
        if not lp:
            raise bad("chat/completions: 'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"chat/completions: 'top_logprobs' must be an integer from 0 to "
                      f"{MAX_TOP_LOGPROBS}, got {_short(top)}", "top_logprobs")
    if lp:
        settings["logprobs"] = top or 0
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("chat/completions: 'stream' must be true or false", "stream")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise bad("chat/completions: 'stream_options' must be an object", "stream_options")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, bool):
        raise bad("chat/completions: 'reasoning' must be true or false", "reasoning")
    return {"messages": msgs, "images": images, "text_chars": chars, "n": answers,
            "settings": settings or None, "stream": stream, "reasoning": reasoning,
            "include_usage": bool(so.get("include_usage"))}


def openai_finish(reason: str | None) -> str:
    """The engine's finish reason in OpenAI's words."""
    return "length" if reason == "length" else "stop"
