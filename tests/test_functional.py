"""The functional API (`photon_jax.functional`) inside the user's own jax.jit / vmap / grad,
against the reference's golden outputs (tests/fixtures/moondream2-tiny, float32)."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from photon_jax import functional as F
from photon_jax.engine import reference as R
from photon_jax.engine.settings import parse
from photon_jax.model import Model, text

from helpers import FIXTURE_DIR

MAX = 12   # the fixture's max_tokens
PAD = 8    # prompts padded to one length: the longest fixture prompt (query)


def image_path(cases, iid):
    return os.path.join(FIXTURE_DIR, next(i["file"] for i in cases["images"] if i["id"] == iid))


def padded(prompt, t=PAD):
    """A prompt's ids zero-padded to t (one shape for every fixture prompt) and its length."""
    ids = np.zeros(t, np.int32)
    ids[:len(prompt)] = prompt
    return ids, np.int32(len(prompt))


def user_caption(cfg, max_tokens=MAX):
    """What a user writes: encode -> prefill -> greedy generate for one sequence.  prompt_T
    may be padded after its `length` real ids."""
    def caption(params, crops, src, ph, pw, prompt_T, length):
        img_ZD = F.encode_image(params, cfg, crops, src, ph, pw)
        x_TD = F.prompt_embeddings(params, cfg, img_ZD, prompt_T)
        n = cfg.prefix_len + length
        logits_V, _, cache = F.prefill(params, cfg, x_TD, length=n,
                                       cache_len=x_TD.shape[0] + max_tokens)
        return F.generate(params, cfg, logits_V, cache, n, max_tokens=max_tokens)
    return caption


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return Model.load(tiny_ckpt)


@pytest.fixture(scope="module")
def caption(model):
    return jax.jit(user_caption(model.cfg))


@pytest.fixture(scope="module")
def img_sq(model, cases):
    """sq378's image embeddings [P, D]."""
    enc = jax.jit(F.encode_image, static_argnums=1)
    return enc(model.params, model.cfg, *F.image_inputs(model.cfg, image_path(cases, "sq378")))


def test_jit_caption_matches_reference(model, cases, caption):
    # sq378 stops at EOS after 7 ids; land800x600 runs to max_tokens.
    for iid, case in [("sq378", "caption_normal"), ("land800x600", "caption_short")]:
        ref = cases["fp32"][iid]["cases"][case]
        ids = np.asarray(caption(model.params, *F.image_inputs(model.cfg, image_path(cases, iid)),
                                 *padded(ref["prompt_ids"])))
        n = len(ref["ids"])
        assert ids.shape == (MAX,)
        assert ids[:n].tolist() == ref["ids"], (iid, case)
        assert (ids[n:] == -1).all()
        assert (n < MAX) == (ref["stop"] == "eos")


def test_jit_caption_equals_reference_path(model, cases, caption):
    """The same ids as the one-request reference path (`reference.generate_text`) on the
    same loaded model."""
    ref = cases["fp32"]["sq378"]["cases"]["caption_normal"]
    path = image_path(cases, "sq378")
    out = R.generate_text(model, R.encode_image(model, path), ref["prompt_ids"],
                          parse({"temperature": 0, "max_tokens": MAX}))
    ids = np.asarray(caption(model.params, *F.image_inputs(model.cfg, path),
                             *padded(ref["prompt_ids"])))
    assert ids[ids >= 0].tolist() == out["ids"]
    assert out["finish_reason"] == "stop"


def test_vmap_batch_equals_per_example(model, cases, caption):
    """Two images of one tiling (sq378 and its mirror image) with prompts of different
    lengths (padded): the vmapped batch equals each example run alone, and padding changes
    nothing (row 0 is the reference's caption, stopped at EOS while row 1 runs on)."""
    cfg = model.cfg
    path = image_path(cases, "sq378")
    mirror = np.ascontiguousarray(np.asarray(Image.open(path).convert("RGB"))[:, ::-1])
    inputs = [F.image_inputs(cfg, path), F.image_inputs(cfg, mirror)]
    ref = cases["fp32"]["sq378"]["cases"]
    prompts, lengths = (np.stack(a) for a in zip(padded(ref["caption_normal"]["prompt_ids"]),
                                                  padded(ref["query"]["prompt_ids"])))

    batched = jax.jit(jax.vmap(user_caption(cfg), in_axes=(None, 0, 0, 0, 0, 0, 0)))
    got = np.asarray(batched(model.params, *[np.stack(a) for a in zip(*inputs)], prompts,
                             lengths))
    assert got.shape == (2, MAX)
    for i in range(2):
        one = caption(model.params, *inputs[i], prompts[i], lengths[i])
        np.testing.assert_array_equal(got[i], np.asarray(one))
    want = ref["caption_normal"]["ids"]
    assert got[0].tolist() == want + [-1] * (MAX - len(want))
    assert (got[1] >= 0).sum() > len(want)


def test_grad_of_caption_log_likelihood(model, cases, img_sq):
    """Teacher forcing over the reference's caption (+ EOS), with the params in the stacked
    checkpoint layout (`text.stack_layers`, as for training): the loss's gradient with
    respect to the text weights is finite and reaches every layer and the LM head; the
    logits' greedy choices are the caption itself."""
    cfg = model.cfg
    ref = cases["fp32"]["sq378"]["cases"]["caption_normal"]
    target = ref["ids"] + [cfg.tokenizer.eos_id]
    ids_T = jnp.array(ref["prompt_ids"] + target[:-1])
    tgt = jnp.array(target)

    def nll(text_params, params, img_ZD):
        p = {**params, "text": text_params}
        _, hidden_TD, _ = F.prefill(p, cfg, F.prompt_embeddings(p, cfg, img_ZD, ids_T))
        lg = F.logits(p, cfg, hidden_TD[-len(target):])
        lp = jax.nn.log_softmax(lg)
        return -jnp.take_along_axis(lp, tgt[:, None], axis=1).sum(), lg

    params = text.stack_layers(model.params)
    (loss, lg), g = jax.jit(jax.value_and_grad(nll, has_aux=True))(
        params["text"], params, img_sq)
    assert np.isfinite(float(loss)) and float(loss) > 0
    leaves = jax.tree.leaves(g)
    assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
    for li in range(cfg.text.n_layers):
        assert any(np.abs(np.asarray(x[li])).max() > 0 for x in jax.tree.leaves(g["blocks"]))
    assert np.abs(np.asarray(g["lm_head"]["w"])).max() > 0
    lg = np.array(lg)
    lg[1:, cfg.tokenizer.answer_id] = -np.inf   # the reference bans it after the first token
    assert lg.argmax(-1).tolist() == target


def test_decode_step_equals_prefill(model, cases, img_sq):
    """Cached == uncached: prefill T - 2 positions then two decode steps gives the logits,
    hidden states and cache of one prefill over all T."""
    cfg = model.cfg
    ref = cases["fp32"]["sq378"]["cases"]["caption_normal"]
    ids = ref["prompt_ids"] + ref["ids"][:2]

    @jax.jit
    def run(params, img_ZD):
        x_TD = F.prompt_embeddings(params, cfg, img_ZD, jnp.array(ids))
        t = x_TD.shape[0]
        full = F.prefill(params, cfg, x_TD)
        _, _, cache = F.prefill(params, cfg, x_TD[:-2], cache_len=t)
        lg1, h1, cache = F.decode_step(params, cfg, cache, ids[-2], t - 2)
        lg2, h2, cache = F.decode_step(params, cfg, cache, ids[-1], t - 1)
        return full, (F.logits(params, cfg, full[1][-2]), lg1, lg2, h1, h2, cache)

    (lg, hid, cache), (lg1_full, lg1, lg2, h1, h2, cache2) = run(model.params, img_sq)
    t, v, d = cfg.prefix_len + len(ids), cfg.text.vocab_size, cfg.text.dim
    # The module boundary: shapes and dtypes of what the functions hand back.
    chex.assert_shape(img_sq, (cfg.prefix_len - 1, d))
    chex.assert_shape([lg1, lg2], (v,))
    chex.assert_shape([h1, h2], (d,))
    chex.assert_shape(hid, (t, d))
    chex.assert_type([lg1, lg2, h1, h2, hid], jnp.float32)
    chex.assert_trees_all_equal_shapes_and_dtypes(cache2, cache)
    tol = dict(rtol=1e-4, atol=1e-4)
    chex.assert_trees_all_close((lg2, lg1, np.stack([h1, h2]), cache2),
                                (lg, lg1_full, hid[-2:], cache), **tol)
    assert cache.k.shape[:2] == (cfg.text.n_layers, t)


def test_region_heads_reproduce_reference_detect(model, cases, img_sq):
    """sq378's detect, one object, with the region heads and encoders: x, y and size are the
    values the reference fed, and after the size the argmax is EOS (the reference's stop)."""
    cfg = model.cfg
    ref = cases["fp32"]["sq378"]["cases"]["detect"]

    @jax.jit
    def detect_one(params, img_ZD):
        x_TD = F.prompt_embeddings(params, cfg, img_ZD, jnp.array(ref["prompt_ids"]))
        t = x_TD.shape[0]
        lg0, h, cache = F.prefill(params, cfg, x_TD, cache_len=t + 3)
        x = F.decode_coordinate(params, cfg, h[-1])
        _, h, cache = F.decode_embedding(params, cfg, cache, F.encode_coordinate(params, cfg, x), t)
        y = F.decode_coordinate(params, cfg, h)
        _, h, cache = F.decode_embedding(params, cfg, cache, F.encode_coordinate(params, cfg, y),
                                         t + 1)
        wh = F.decode_size(params, cfg, h)
        lg, _, _ = F.decode_embedding(params, cfg, cache, F.encode_size(params, cfg, wh), t + 2)
        return lg0, x, y, wh, lg

    lg0, x, y, wh, lg = detect_one(model.params, img_sq)
    fed = ref["fed_values"][0]
    assert int(np.argmax(lg0)) != cfg.tokenizer.eos_id
    assert (float(x), float(y)) == (fed["x"], fed["y"])
    np.testing.assert_allclose(np.asarray(wh), fed["size"], rtol=1e-6)
    assert int(np.argmax(lg)) == cfg.tokenizer.eos_id
    assert ref["decode_positions"][0] == len(ref["prompt_ids"]) + cfg.prefix_len
