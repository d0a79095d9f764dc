"""Output held to a shape (a JSON schema, a regex or a list of choices): the grammar library's
matchers per request and the token masks they give the sampler.

The grammar work is llguidance's (the Guidance project's Rust engine, also behind vLLM and
SGLang's structured output): it compiles the shape against the tokenizer's token bytes and,
after each committed token, names the tokens that keep the output inside the shape.  What
this module owns:

- `Grammars`, one per loaded model: the library's view of the tokenizer (built once, on
  first use) and the compiled shapes, cached by their canonical text, so a schema sent with
  every request is compiled once; a request gets a cheap copy of the cached matcher.
- `Matcher`, one per request: `mask()` is the packed allow-bitmask of the next token (int32
  words, bit i of word w allows token 32 w + i, `vocab` bits), `consume(token)` advances it.

Where it runs (engine/core.py): a token commits on the host, the skill feeds it to its
matcher, and the next step's finalize asks for the mask and hands it to the sampling
program beside the constraint ids; the forward of that step is already running on the
device meanwhile, so the mask costs no device time.  EOS is allowed exactly when the output
is complete.

The shape is applied to the answer only: a reasoning query's reasoning is free text.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import numpy as np

from .request import RequestError
from .settings import SHAPES


def _library():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as e:   # a broken install: it is a dependency of the package
        raise RequestError("output shapes (json_schema / regex / choices) need the "
                           f"llguidance package, which failed to import ({e}); reinstall "
                           "photon_jax") from None
    return llguidance


def _choices_regex(choices) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class Matcher:
    """One request's position in its shape."""

    def __init__(self, matcher, vocab: int, eos_id: int):
        self._m = matcher
        self._buf = np.zeros((1, (vocab + 31) // 32), np.int32)
        self.vocab, self.eos_id = vocab, eos_id

    def mask(self) -> np.ndarray:
        """The allow-bitmask of the next token: int32 [ceil(vocab / 32)] (a fresh array)."""
        import llguidance.numpy as lln
        lln.fill_next_token_bitmask(self._m, self._buf, 0)
        out = self._buf[0].copy()
        if not out.any():   # a matcher in error allows nothing: end the output instead
            out.view(np.uint32)[self.eos_id // 32] = np.uint32(1 << (self.eos_id % 32))
        return out

    def consume(self, token: int) -> None:
        """Advance past a committed token.  A token the mask did not allow (only possible for
        a token forced past it, e.g. at the length cap) leaves the matcher in error; its
        later masks then allow EOS only."""
        self._m.consume_token(int(token))


class Grammars:
    """Shapes compiled against one tokenizer, cached (least recently used first out)."""

    def __init__(self, tokenizer, vocab: int, eos_id: int, cache_size: int = 64):
        self._tokenizer, self.vocab, self.eos_id = tokenizer, vocab, eos_id
        self._lltok = None
        self._cache: OrderedDict = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()   # submit runs on callers' threads

    def _tok(self):
        if self._lltok is None:
            llg = _library()
            try:
                self._lltok = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab,
                                              eos_token=self.eos_id)
            except Exception as e:  # noqa: BLE001 - the library raises plain errors
                raise RequestError(
                    f"output shapes need a byte-level tokenizer (Moondream's starmie is one); "
                    f"the grammar library cannot read this model's tokenizer.json: {e}"
                ) from None
        return self._lltok

    def matcher(self, kind: str, spec_json: str) -> Matcher:
        """A fresh matcher for a shape (`spec_json`: the spec as canonical JSON, see
        `settings.Settings.shape`); a bad shape is a RequestError naming the setting."""
        key = kind + ":" + spec_json
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
            else:
                template = self._compile(kind, json.loads(spec_json))
                self._cache[key] = template
                while len(self._cache) > self._size:
                    self._cache.popitem(last=False)
            return Matcher(template.deep_copy(), self.vocab, self.eos_id)

    def _compile(self, kind: str, spec):
        llg = _library()
        where = f"settings[{kind!r}]"
        try:
            if kind == "json_schema":
                # Compact JSON by default: with free whitespace a weak sample can spend its
                # whole budget on blanks between tokens and never close the object.  A
                # schema's own "x-guidance" options still win.
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    spec, defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec)
            elif kind == "choices":
                grammar = llg.LLMatcher.grammar_from_regex(_choices_regex(spec))
            else:
                raise RequestError(f"unknown output shape {kind!r}; expected one of "
                                   f"{list(SHAPES)}")
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RequestError(f"{where} cannot be compiled: {e}") from None
        m = llg.LLMatcher(self._tok(), grammar)
        if m.is_error():
            raise RequestError(f"{where} cannot be compiled: {m.get_error()}")
        return m
