"""Conversations as Moondream prompts: OpenAI-shaped messages checked, then rendered to token
ids the way kestrel 0.9.2 (Moondream's own engine) renders its `chat` skill.

Moondream has no trained chat format.  A conversation is a run of `query` blocks, one per
user turn (the turn's images first, then the query prefix and the turn's text), each
answered user turn followed by the answer opener and the assistant's text.  A leading
system message is folded into the first user turn's text as "system\\n\\nuser".  The last
message is a user turn and the prompt ends with the generation opener: the answer opener,
or the reasoning opener when reasoning is on.  The openers are kestrel's per family:
Moondream 2 `[3, 3]` / `[3, 4]` (the doubled answer id of its training), Moondream 3
`[3]` / `[4]`.  So a one-turn Moondream 2 chat is token for token the `query` prompt.

Owns: the message rules (roles system / user / assistant; system first only and without
images; images only in user turns; the last message a user turn with text or an image;
a message's text is its text parts joined with no separator, as kestrel joins them) and
the rendering.  The images themselves are the caller's (`Chat.images`, in order); where
each sits in the token sequence is `Chat.image_at`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

ROLES = ("system", "user", "assistant")

# The answer / reasoning openers of kestrel's query template, per family.
OPENERS = {"moondream2": ((3, 3), (3, 4)), "moondream3": ((3,), (4,))}


class ChatError(ValueError):
    """A conversation that cannot be rendered; the message names the message and the fix."""


@dataclass(frozen=True)
class Turn:
    role: str
    text: str
    images: tuple       # the caller's image objects, in content order (user turns only)


@dataclass(frozen=True)
class Chat:
    """A rendered conversation: `ids` after BOS (the engine adds BOS, or the image prefix
    that starts with it), the images in order and the token offset (after BOS) each one
    is placed at."""
    ids: list
    images: tuple
    image_at: tuple


def parse_messages(messages: Any, image_part: Callable[[dict, str], Any]) -> list[Turn]:
    """OpenAI-shaped messages -> turns.  `image_part(part, where)` turns an image content
    part into the caller's image object (or raises ChatError naming `where`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ChatError("messages must be a list of {\"role\", \"content\"} objects, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ChatError("messages is empty; send at least one user message")
    turns = []
    for n, m in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object with 'role' and 'content', got "
                            f"{type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}: role must be one of {list(ROLES)}, got {role!r}")
        if role == "system" and n != 0:
            raise ChatError(f"{where}: a system message must be the first message")
        texts, images = [], []
        content = m.get("content")
        if content is None:
            pass
        elif isinstance(content, str):
            texts.append(content)
        elif isinstance(content, (list, tuple)):
            for k, part in enumerate(content):
                pw = f"{where}.content[{k}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise ChatError(f"{pw}: a text part needs a string 'text'")
                    texts.append(part["text"])
                elif kind in ("image_url", "image"):
                    if role != "user":
                        raise ChatError(f"{pw}: images may only be in user messages (this is "
                                        f"a {role} message); move the image to a user turn")
                    images.append(image_part(part, pw))
                else:
                    raise ChatError(f"{pw}: unsupported content part {kind!r}; use "
                                    "{\"type\": \"text\"} and {\"type\": \"image_url\"} parts")
        else:
            raise ChatError(f"{where}: content must be a string or a list of parts, got "
                            f"{type(content).__name__}")
        turns.append(Turn(role, "".join(texts), tuple(images)))
    last = turns[-1]
    if last.role != "user":
        raise ChatError(f"messages[{len(turns) - 1}]: the last message must be from the user "
                        f"(got {last.role!r}); end with the question to answer")
    if not last.text and not last.images:
        raise ChatError(f"messages[{len(turns) - 1}]: the last user message has neither text "
                        "nor an image")
    return turns


def render(turns: list[Turn], *, family: str, query_prefix, encode: Callable,
           reasoning: bool) -> Chat:
    """Turns -> token ids after BOS, kestrel's layout (see the module docstring)."""
    answer, think = OPENERS[family]
    ids: list[int] = []
    images, image_at = [], []
    system = ""
    if turns and turns[0].role == "system":
        system, turns = turns[0].text, turns[1:]

    def text(s: str) -> list[int]:
        return list(encode(s)) if s else []

    i = 0
    while i < len(turns):
        t = turns[i]
        if t.role == "user":
            for img in t.images:
                image_at.append(len(ids))
                images.append(img)
            ids += list(query_prefix)
            body = t.text
            if system:
                body = f"{system}\n\n{body}" if body else system
                system = ""
            ids += text(body)
            if i + 1 < len(turns) and turns[i + 1].role == "assistant":
                ids += list(answer) + text(turns[i + 1].text)
                i += 2
                continue
        else:   # an assistant turn with no user turn before it: its answer alone
            ids += list(answer) + text(t.text)
        i += 1
    ids += list(think if reasoning else answer)
    return Chat(ids, tuple(images), tuple(image_at))
