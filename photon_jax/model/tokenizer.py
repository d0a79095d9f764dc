"""The tokenizer: a local `tokenizer.json` (HF `tokenizers`), checked to be the right one, and
the prompt templates as token ids.

Moondream 2 (2025-06-21) and Moondream 3 use the "starmie" tokenizer of the separate HF repo
`moondream/starmie-v1`: id 0 is `<|endoftext|>` (BOS = EOS) and ids 1-9 are special tokens.
Older Moondream 2 revisions used a GPT-2 BPE, which would silently produce garbage prompts with
the new templates, so it is refused by name.
"""

from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from .config import KIND_COORD, KIND_SIZE, TokenizerConfig

STARMIE_HINT = (
    "Moondream 2 (revision 2025-06-21) needs the 'starmie' tokenizer: download "
    "tokenizer.json from the Hugging Face repo moondream/starmie-v1 and pass it with "
    "--tokenizer PATH"
)


def _byte_alphabet() -> dict:
    """Byte-level BPE's alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, and the other 68 bytes (controls, space, soft hyphen...) for the code points
    from 256 up, in byte order (the GPT-2 convention the `tokenizers` ByteLevel uses)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    out, extra = {chr(b): b for b in keep}, 256
    for b in range(256):
        if b not in keep:
            out[chr(extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_alphabet()


class TokenizerError(ValueError):
    pass


def check_tokenizer(tok: Tokenizer, path: str = "tokenizer.json") -> None:
    """Raise TokenizerError unless `tok` is a starmie-style tokenizer."""
    first = tok.id_to_token(0)
    if tok.token_to_id("<|endoftext|>") == 50256 or first == "!":
        raise TokenizerError(
            f"{path} is the older GPT-2 tokenizer of Moondream 2 revisions before 2025-06; "
            + STARMIE_HINT
        )
    if first != "<|endoftext|>":
        raise TokenizerError(
            f"{path}: id 0 is {first!r}, expected '<|endoftext|>'. " + STARMIE_HINT
        )
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    missing = [i for i in range(1, 10) if i not in special]
    if missing:
        raise TokenizerError(
            f"{path}: ids {missing} are not special tokens, expected ids 1-9 to be Moondream's "
            "special tokens. " + STARMIE_HINT
        )


def load_tokenizer(path: str) -> Tokenizer:
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer file not found: {path}. " + STARMIE_HINT)
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from None
    check_tokenizer(tok, path)
    return tok


def spatial_refs_prompt(refs, cfg: TokenizerConfig):
    """Spatial refs -> (prompt ids, region values), as the reference encodes them: a point
    (x, y) is two coord tokens; a box (x_min, y_min, x_max, y_max) is its centre as two coord
    tokens and its (width, height) as a size token.  Values must be finite, in [0, 1]."""
    if not isinstance(refs, (list, tuple)) or not refs:
        raise ValueError("spatial_refs must be a non-empty list of points [x, y] or boxes "
                         "[x_min, y_min, x_max, y_max]")
    ids, values = [], []
    for n, ref in enumerate(refs):
        ok = isinstance(ref, (list, tuple)) and len(ref) in (2, 4) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
            for v in ref)
        if not ok:
            raise ValueError(f"spatial_refs[{n}] = {ref!r}: expected [x, y] or [x_min, y_min, "
                             "x_max, y_max] with values in [0, 1] (normalised coordinates)")
        if len(ref) == 2:
            ids += [cfg.coord_id, cfg.coord_id]
            values += [(float(ref[0]), 0.0), (float(ref[1]), 0.0)]
        else:
            x0, y0, x1, y1 = map(float, ref)
            ids += [cfg.coord_id, cfg.coord_id, cfg.size_id]
            values += [((x0 + x1) / 2, 0.0), ((y0 + y1) / 2, 0.0), (x1 - x0, y1 - y0)]
    return ids, values


def region_inputs(ids: list[int], region, tok_cfg: TokenizerConfig):
    """Per prompt position: kind (token / coord / size) and value, for spatial refs (the
    reference replaces the embeddings of the prompt's coord and size tokens)."""
    kinds = np.zeros(len(ids), np.int32)
    values = np.zeros((len(ids), 2), np.float32)
    slots = [i for i, t in enumerate(ids) if t in (tok_cfg.coord_id, tok_cfg.size_id)]
    if len(slots) != len(region):
        raise ValueError(f"{len(region)} spatial values for {len(slots)} coord/size tokens")
    for i, v in zip(slots, region):
        kinds[i] = KIND_COORD if ids[i] == tok_cfg.coord_id else KIND_SIZE
        values[i] = v
    return kinds, values


class Prompts:
    """Token-id prompts of the reference (MD2 2025-06-21), including its quirks: the doubled
    answer id after a query, and the leading space before a detect/point object."""

    def __init__(self, tok: Tokenizer, cfg: TokenizerConfig):
        self.tok, self.cfg = tok, cfg
        self._byte_level = None
        self._bytes: dict = {}

    def encode(self, s: str) -> list[int]:
        # Default special-token handling, as the reference calls it.
        return self.tok.encode(s).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a log-probability entry's "bytes": a token can
        hold part of a UTF-8 character, which its decoded text cannot show).  Byte-level
        BPE (Moondream's tokenizer) maps its vocabulary's characters back to bytes; any
        other tokenizer gives the UTF-8 of the token's decoded text."""
        token_id = int(token_id)
        raw = self._bytes.get(token_id)   # (scheduler thread: 1 + k lookups per token)
        if raw is None:
            if self._byte_level is None:
                self._byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
            piece = self.tok.id_to_token(token_id)
            if self._byte_level and piece is not None and all(c in _BYTE_OF for c in piece):
                raw = bytes(_BYTE_OF[c] for c in piece)
            else:
                raw = self.tok.decode([token_id], skip_special_tokens=False).encode()
            self._bytes[token_id] = raw   # at most the vocabulary's size
        return raw

    def caption(self, length: str) -> list[int]:
        if length not in ("short", "normal", "long"):
            raise ValueError(f"caption length must be 'short', 'normal' or 'long', got {length!r}")
        return list(getattr(self.cfg, f"caption_{length}"))

    def query(self, question: str, *, spatial: tuple = (), reasoning: bool = False) -> list[int]:
        """The reference's query prompt: the suffix, then the suffix again (answer) or the
        thinking id (reasoning).  `spatial`: the coord / size ids of the spatial refs."""
        c = self.cfg
        opener = [c.thinking_id] if reasoning else list(c.query_suffix)
        return (list(c.query_prefix) + list(spatial) + self.encode(question)
                + list(c.query_suffix) + opener)

    def detect(self, obj: str) -> list[int]:
        c = self.cfg
        return list(c.detect_prefix) + self.encode(" " + obj) + list(c.detect_suffix)

    def segment(self, obj: str, *, spatial: tuple = ()) -> list[int]:
        """Moondream 3's segment prompt: the object without a leading space (unlike detect /
        point), after the spatial refs' ids."""
        c = self.cfg
        if not c.segment_prefix:
            raise ValueError("segment needs a Moondream 3 model; this model has no segment "
                             "skill (its config has no segment template)")
        return (list(c.segment_prefix) + list(spatial) + self.encode(obj)
                + list(c.segment_suffix))

    def point(self, obj: str) -> list[int]:
        c = self.cfg
        return list(c.point_prefix) + self.encode(" " + obj) + list(c.point_suffix)
