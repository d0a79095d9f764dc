"""Incremental detokenisation with the reference's flush rules.

Text is released up to the last space, in full after a newline (which also resets the token
buffer, as the reference does) and in full after a CJK character.  The final string of a
non-streaming call is the concatenation of these pieces, exactly as the reference builds it.
"""

from __future__ import annotations


def is_cjk(cp: int) -> bool:
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x2F800 <= cp <= 0x2FA1F


class TextStreamer:
    def __init__(self, decode):
        self.decode = decode
        self.tokens: list[int] = []
        self.printed = 0

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if text.endswith("\n"):
            out = text[self.printed:]
            self.tokens, self.printed = [], 0
            return out
        if text and is_cjk(ord(text[-1])):
            out = text[self.printed:]
            self.printed += len(out)
            return out
        cut = text.rfind(" ", self.printed)
        if cut >= self.printed:
            out = text[self.printed:cut + 1]
            self.printed += len(out)
            return out
        return ""

    def pending(self) -> str:
        """Text decoded but not released yet (what `flush` would return now)."""
        return self.decode(self.tokens)[self.printed:] if self.tokens else ""

    def flush(self) -> str:
        if not self.tokens:
            return ""
        out = self.decode(self.tokens)[self.printed:]
        self.tokens, self.printed = [], 0
        return out
