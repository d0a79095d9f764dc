"""Token sampling: greedy, or temperature + top-p exactly as the reference filters.

Randomness is a pure function of (request seed, token index): the key for a row's token i is
fold_in(PRNGKey(seed), i).  A row's draw therefore never depends on batch composition,
timing or mode (pipelined, blocking, one request at a time).
"""

import jax
import jax.numpy as jnp

from .dtypes import F32


def apply_bans(logits_RV, ban_RB):
    """Set the listed ids (per row, -1 = unused slot) to -inf."""
    v = logits_RV.shape[-1]
    ids = jnp.arange(v)[None, None, :]
    banned = (ids == ban_RB[:, :, None]).any(axis=1)
    return jnp.where(banned, -jnp.inf, logits_RV)


def _top_p_draw(logits_V, temperature, top_p, key):
    probs = jax.nn.softmax(logits_V / temperature)
    order = jnp.argsort(-probs, stable=True)
    sorted_p = probs[order]
    cum = jnp.cumsum(sorted_p)
    # Drop every entry whose cumulative mass *before* it already exceeds top_p.
    kept = jnp.where(cum - sorted_p > top_p, 0.0, sorted_p)
    kept = kept / kept.sum()
    idx = jax.random.categorical(key, jnp.log(kept))
    return order[idx]


def draw(logits_RV, temperature_R, top_p_R, seed_R, index_R):
    """[R, V] float32 logits (bans already applied as -inf) -> [R] int32 token ids.
    temperature 0 means argmax (lowest id on ties).  When no row samples, the top-p path
    (a sort over the vocabulary per row) is skipped on the device, not on the host."""
    greedy = jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)

    def stochastic(_):
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(
            seed_R, index_R)
        safe_t = jnp.where(temperature_R > 0, temperature_R, 1.0)
        drawn = jax.vmap(_top_p_draw)(logits_RV, safe_t, top_p_R, keys).astype(jnp.int32)
        return jnp.where(temperature_R > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature_R > 0), stochastic, lambda _: greedy, None)


def sample(logits_RV, ban_RB, temperature_R, top_p_R, seed_R, index_R):
    """-> [R] int32 token ids, with the listed ids banned."""
    return draw(apply_bans(logits_RV.astype(F32), ban_RB), temperature_R, top_p_R, seed_R,
                index_R)
