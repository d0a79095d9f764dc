"""Top-p over a candidate set equals the reference's full sort whenever the nucleus fits in
the candidates: the same kept set and the same draw from the same key; and a draw does not
change when nearly tied candidates swap places (noise per token id, not per position)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from photon_jax.model import sampling


def full_sort_draw(logits_V, temperature, top_p, key):
    """The reference's top-p over the whole vocabulary: softmax, a stable descending sort,
    cumulative mass, then Gumbel-max with each token's own noise."""
    probs = jax.nn.softmax(logits_V / temperature)
    order = jnp.argsort(-probs, stable=True)
    sorted_p = probs[order]
    cum = jnp.cumsum(sorted_p)
    kept = jnp.where(cum - sorted_p > top_p, 0.0, sorted_p)
    return order[jnp.argmax(jnp.log(kept) + sampling.id_noise(key, order))]


def nucleus_size(logits_V, temperature, top_p):
    p = np.sort(np.asarray(jax.nn.softmax(logits_V / temperature), np.float64))[::-1]
    cum = np.cumsum(p)
    return int(np.sum(cum - p <= top_p))


@pytest.mark.parametrize("candidates", [16, 64])
def test_candidates_reproduce_the_full_sort_when_the_nucleus_fits(candidates):
    rng = np.random.default_rng(candidates)
    v, fits, checked = 4096, 0, 0
    new = jax.jit(lambda lg, t, p, s, i: sampling.draw(lg, t, p, s, i, candidates))
    old = jax.jit(jax.vmap(lambda lg, t, p, key: full_sort_draw(lg, t, p, key)))
    for trial in range(6):
        r = 64
        # Peaked and flat rows, ties included (repeated logits).
        scale = rng.choice([0.5, 2.0, 6.0], size=(r, 1))
        logits = rng.normal(size=(r, v)).astype(np.float32) * scale.astype(np.float32)
        logits[:, 10:14] = logits[:, 10:11]
        temp = rng.choice([0.3, 0.7, 1.0, 1.5], size=r).astype(np.float32)
        top_p = rng.choice([0.1, 0.3, 0.6, 0.9], size=r).astype(np.float32)
        seed = rng.integers(0, 1000, r).astype(np.int32)
        index = rng.integers(0, 50, r).astype(np.int32)
        got = np.asarray(new(jnp.asarray(logits), temp, top_p, seed, index))
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, index)
        want = np.asarray(old(jnp.asarray(logits), temp, top_p, keys))
        for i in range(r):
            n = nucleus_size(logits[i], temp[i], top_p[i])
            checked += 1
            if n < candidates:   # the nucleus fits: identical draw
                fits += 1
                assert got[i] == want[i], (trial, i, n)
            else:                # it does not: a draw among the most probable candidates
                top = np.argsort(-logits[i], kind="stable")[:candidates + 4]
                assert got[i] in top
    assert fits > checked // 4 and fits < checked   # both cases were exercised


def test_greedy_rows_and_the_greedy_variant_take_the_argmax():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 300)), jnp.float32)
    want = np.argmax(np.asarray(logits), -1)
    z = jnp.zeros(5, jnp.float32)
    i = jnp.zeros(5, jnp.int32)
    assert np.asarray(sampling.draw(logits, z, z + 1, i, i)).tolist() == want.tolist()
    ban = -jnp.ones((5, 1), jnp.int32)
    assert np.asarray(sampling.sample(logits, ban, z, z + 1, i, i, stochastic=False)).tolist() \
        == want.tolist()


def test_a_draw_survives_near_ties_swapping_places():
    """Two programs that round differently (another batch shape, the one-request path, a GPU)
    can swap two candidates whose probabilities differ by an ulp.  With noise per token id
    the draw stays; with noise per sorted position (jax.random.categorical over the sorted
    candidates) it moves to whichever token lands on the winning position."""
    rng = np.random.default_rng(5)
    r, v = 256, 512
    logits = rng.normal(size=(r, v)).astype(np.float32)
    # Pairs of near-ties among the most probable tokens, and the same logits with each pair's
    # order swapped by one ulp (what a different rounding does).
    top = np.argsort(-logits, axis=1)[:, :40]
    swapped = logits.copy()
    for i in range(r):
        for a, b in top[i].reshape(-1, 2):
            logits[i, b] = logits[i, a]
            swapped[i, a] = logits[i, a]
            swapped[i, b] = np.nextafter(logits[i, a], np.float32(np.inf))
    t = np.full(r, 1.0, np.float32)
    p = np.full(r, 0.95, np.float32)
    seed = np.arange(r, dtype=np.int32)
    index = np.zeros(r, np.int32)
    draw = jax.jit(lambda lg: sampling.draw(lg, t, p, seed, index, 64))
    a, b = np.asarray(draw(jnp.asarray(logits))), np.asarray(draw(jnp.asarray(swapped)))
    assert (a == b).all()

    def by_position(lg):
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, index)

        def one(lg_V, key):
            probs, ids = jax.lax.top_k(jax.nn.softmax(lg_V), 64)
            kept = jnp.where(jnp.cumsum(probs) - probs > 0.95, 0.0, probs)
            return ids[jax.random.categorical(key, jnp.log(kept))]
        return np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(lg), keys))

    assert (by_position(logits) != by_position(swapped)).sum() > r // 20


def test_draws_follow_the_kept_distribution():
    """Frequencies over 4096 seeds match the top-p renormalised probabilities (a wrong noise
    transform, e.g. exponential instead of Gumbel, biases them far beyond this bound)."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32)
    n = 4096
    logits = jnp.asarray(np.tile(np.log(p), (n, 1)))
    one = jnp.ones(n, jnp.float32)
    got = np.asarray(jax.jit(lambda lg: sampling.draw(lg, one, one * 0.75, jnp.arange(n),
                                                      jnp.zeros(n, jnp.int32), 6))(logits))
    kept = p[:3] / p[:3].sum()   # cumulative mass before token 3 is 0.8 > 0.75
    freq = np.bincount(got, minlength=6) / n
    assert freq[3:].sum() == 0
    assert np.abs(freq[:3] - kept).max() < 0.03, freq


def test_greedy_equals_argmax_on_ties_infinities_and_nan():
    """`greedy` (a max, then the lowest id holding it) picks what `np.argmax` picks: the
    lowest id among tied maxima, id 0 of an all -inf row (every id banned), the first NaN."""
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 3, size=(6, 64)).astype(np.float32)   # many ties
    x[1] = -np.inf
    x[2, [5, 9]] = np.nan
    x[3, 7] = np.inf
    x[4, [2, 40]] = np.inf
    got = np.asarray(jax.jit(sampling.greedy)(jnp.asarray(x)))
    assert got.tolist() == np.argmax(x, -1).tolist()
    assert got[1] == 0 and got[2] == 5 and got[4] == 2
