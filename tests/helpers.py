"""Helpers shared by tests and by `bench/gpu_run.py` (which runs the same surfaces on a GPU):
a model with biased logits, and one call of every public surface.  Imports nothing from JAX
at module level (conftest imports this before it sets JAX's environment)."""

import os
import threading

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                           "moondream2-tiny")
LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
SQ = os.path.join(FIXTURE_DIR, "img_sq378.png")
GREEDY = {"temperature": 0, "max_tokens": 6}
# Moondream 3's tiny fixture: EOS for varied lengths, and its coordinate and size ids (the
# fixture's head biases them by -10) so that segment emits a box.
MD3_BIASES = {0: 0.8, 5: 17.0, 6: 16.0}


def biased_model(ckpt: str, biases: dict, device=None):
    """The checkpoint's model with `biases` ({token id: value}) added to the LM head's bias:
    random weights rarely emit EOS, coordinates or grounding ids on their own."""
    import jax

    from photon_jax.model import Model

    base = Model.load(ckpt, device=device)
    params = jax.tree.map(lambda x: x, base.params)
    head = dict(params["text"]["lm_head"])
    for tok, val in biases.items():
        head["b"] = head["b"].at[tok].add(val)
    params["text"] = {**params["text"], "lm_head": head}
    return Model(base.cfg, params, base.prompts.tok, device=base.device)


def surfaces(md, md3) -> dict:
    """One call of every public surface of a Moondream 2 (`md`) and a Moondream 3 (`md3`):
    each skill, a list, streams (whole and closed early), reasoning, spatial refs, text-only,
    seeded sampling, prefix-cache hits (an encoded image and repeated images), a cancel,
    and segment.  Every value is plain data, comparable between runs."""
    g = GREEDY
    out = {"caption": md.caption(LAND, "short", settings=g),
           "list": md.caption([LAND, SQ, LAND], "short", settings=g),
           "query": md.query(SQ, "w5 w6", settings=g),
           "reasoning": md.query(LAND, "w9", reasoning=True, settings=g),
           "spatial": md.query(LAND, "w9", spatial_refs=[[0.3, 0.4], [0.1, 0.1, 0.6, 0.7]],
                               settings=g),
           "text_only": md.query(None, "w100 w200", settings=g),
           "sampled": md.query(LAND, "w5", settings={"temperature": 1.0, "seed": 3,
                                                     "max_tokens": 6}),
           "detect": md.detect(LAND, "w7", settings={"max_objects": 3}),
           "point": md.point(SQ, "w7", settings={"max_objects": 3}),
           "stream": "".join(md.caption(SQ, "normal", stream=True, settings=g)["caption"])}
    early = md.query(LAND, "w3", stream=True, settings={"max_tokens": 64})["answer"]
    out["stream_first_piece"] = next(iter(early))
    early.close()   # closing the stream cancels its request
    enc = md.encode_image(SQ)
    out["encoded"] = [md.caption(enc, "short", settings=g), md.query(enc, "w8", settings=g)]
    enc.release()
    h = md.start(LAND, settings={"max_tokens": 200})
    h.cancel()
    out["cancelled"] = h.result(timeout=120)["finish_reason"]
    out["after_cancel"] = md.caption(LAND, "short", settings=g)
    if md3 is not None:
        out["md3"] = [md3.caption(LAND, "short", settings=g),
                      md3.segment(LAND, "w7", settings={"temperature": 0, "max_tokens": 8}),
                      md3.detect(LAND, "w7", settings={"max_objects": 2})]
    return out


def run_surfaces(models, pipelined: bool, kv_cache_tokens: int | None = None) -> dict:
    """`surfaces` on fresh engines over already loaded models (md2, md3 or None); the
    engines are closed after, the models' weights are kept for the next run."""
    from photon_jax import Moondream
    from photon_jax.engine import Engine

    mds = [None if m is None else
           Moondream(m, Engine(m, max_batch_size=4, pipelined=pipelined,
                               kv_cache_tokens=kv_cache_tokens)) for m in models]
    try:
        return surfaces(*mds)
    finally:
        for md in mds:
            if md is not None:
                md.engine.close()


def in_threads(fn, n: int, timeout: float = 240) -> list:
    """`fn()` on `n` threads released together (a barrier) -> their results; raises the
    first error any of them met."""
    barrier = threading.Barrier(n)
    results, errors = [], []

    def work():
        try:
            barrier.wait(timeout=30)
            results.append(fn())
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert len(results) == n, f"{n - len(results)} threads did not finish in {timeout} s"
    return results
