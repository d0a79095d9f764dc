"""The public Python API, shaped like Moondream's own (`caption`, `query`, `detect`, `point`,
`encode_image`; the same argument names, settings keys and return dicts).

This first version runs every call through the one-request reference path; the pipelined
engine takes its place behind the same methods without changing results.  Calls are safe from
several threads: each call owns its KV cache and the params are read-only.
"""

from __future__ import annotations

import os

import jax

from . import reference
from .model import Model
from .reference import EncodedImage
from .settings import parse

class Moondream:
    def __init__(self, model: Model):
        self._model = model

    @classmethod
    def load(cls, path, *, dtype=None, device=None) -> "Moondream":
        """Load a checkpoint directory written by `photon-convert`.

        dtype: None keeps the checkpoint's dtype; "bfloat16" or "float32" casts on load.
        device: a `jax.Device`, a device index, or None for the default device.
        Nothing is downloaded: the directory holds the weights, config and tokenizer.
        """
        return cls(Model.load(os.fspath(path), dtype=dtype, device=device))

    @property
    def config(self):
        return self._m.cfg

    @property
    def _m(self) -> Model:
        if self._model is None:
            raise RuntimeError("this Moondream instance is closed")
        return self._model

    def close(self) -> None:
        """Drop the params and compiled programs so their device memory can be freed."""
        if self._model is not None:
            for leaf in jax.tree.leaves(self._model.params):
                leaf.delete()
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- skills -------------------------------------------------------------------------

    def encode_image(self, image) -> EncodedImage:
        """Encode once, query many times: the result (the image prefix's KV) is accepted by
        every method in place of an image.  Valid for this loaded model only; do not persist
        it across versions."""
        return reference.encode_image(self._m, image)

    def caption(self, image, length: str = "normal", *, stream: bool = False,
                settings: dict | None = None) -> dict:
        s = parse(settings)
        m = self._m
        prompt = m.prompts.caption(length)  # validates `length` before any device work
        enc = reference.encode_image(m, image)
        return {"caption": self._text(enc, prompt, s, stream)}

    def query(self, image=None, question: str | None = None, *, stream: bool = False,
              settings: dict | None = None) -> dict:
        if not isinstance(question, str):
            raise ValueError("question must be a string")
        s = parse(settings)
        m = self._m
        if image is None:
            # Text-only query, as the reference builds it: BOS, then the prompt from
            # position 0, purely causal.
            enc = None
            prompt = [m.cfg.tokenizer.bos_id] + m.prompts.query(question)
        else:
            enc = reference.encode_image(m, image)
            prompt = m.prompts.query(question)
        return {"answer": self._text(enc, prompt, s, stream)}

    def detect(self, image, object: str, *, settings: dict | None = None) -> dict:
        return {"objects": self._points(image, object, settings, with_size=True)}

    def point(self, image, object: str, *, settings: dict | None = None) -> dict:
        return {"points": self._points(image, object, settings, with_size=False)}

    # -- plumbing -----------------------------------------------------------------------

    def _text(self, enc, prompt, s, stream):
        gen = reference.iter_text(self._m, enc, prompt, s)
        if stream:
            return gen
        return "".join(gen)

    def _points(self, image, obj, settings, *, with_size):
        if not isinstance(obj, str) or not obj.strip():
            raise ValueError("object must be a non-empty string, e.g. 'face'")
        s = parse(settings)
        m = self._m
        enc = reference.encode_image(m, image)
        prompt = m.prompts.detect(obj) if with_size else m.prompts.point(obj)
        return reference.generate_points(m, enc, prompt, with_size=with_size,
                                         max_objects=s.max_objects)["objects"]
