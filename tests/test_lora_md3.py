"""Moondream 3's finetunes: adapters in kestrel's layout (dense MLP adapters on the first
layers, per-expert adapters on the mixture-of-experts layers) applied as Moondream's own
engine applies them, which is as if each adapter were merged into the weights it adapts.

The adapter (tests/fixtures/lora_md3/ft-md3@1/final.pt) was built and saved by kestrel
0.9.2's own `LoRA` module and read back by its own provider code
(tests/fixtures/lora_md3/make_adapter.py); `arrays.npz` beside it holds the drawn values,
which these tests merge into the model's weights with numpy, independently of the reader
and of the engine's slot tables."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import HERE, LAND, SQ, write_safetensors
from photon_jax import Moondream
from photon_jax.convert.adapters import AdapterError, read_adapter
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings
from photon_jax.model import Model, lora, moe, quant

ADAPTER_DIR = os.path.join(HERE, "fixtures", "lora_md3", "ft-md3@1")
FINAL_PT = os.path.join(ADAPTER_DIR, "final.pt")
GREEDY = {"temperature": 0, "max_tokens": 10}


@pytest.fixture(scope="module")
def drawn():
    with np.load(os.path.join(ADAPTER_DIR, "arrays.npz")) as d:
        return {k: d[k] for k in d.files}


def merged_model(base: Model, drawn: dict) -> Model:
    """`base` with the adapter merged into its weights: W [in, out] += (B A)^T for each dense
    MLP and each expert (numpy, float32)."""
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), base.params)   # Model owns its own
    text = dict(params["text"])
    blocks = [dict(b) for b in text["blocks"]]
    for i, b in enumerate(blocks):
        for proj, name in (("up", "fc1"), ("down", "fc2")):
            a, bb = drawn[f"dense.{i}.{proj}_a"], drawn[f"dense.{i}.{proj}_b"]
            w = np.asarray(b[name]["w"]) + (bb @ a).T
            b[name] = {**b[name], "w": jnp.asarray(w, b[name]["w"].dtype)}
    moes = [dict(b) for b in text["moe_blocks"]]
    for j, b in enumerate(moes):
        m = dict(b["moe"])
        for proj, name in (("up", "fc1"), ("down", "fc2")):
            a, bb = drawn[f"moe.{j}.{proj}_a"], drawn[f"moe.{j}.{proj}_b"]   # [E, r, in], [E, out, r]
            w = np.asarray(m[name]) + np.einsum("eor,eri->eio", bb, a)
            m[name] = jnp.asarray(w, m[name].dtype)
        b["moe"] = m
    text["blocks"], text["moe_blocks"] = blocks, moes
    params["text"] = text
    return Model(base.cfg, params, base.prompts.tok, device=base.device)


@pytest.fixture(scope="module")
def base(md3_ckpt):
    return Model.load(md3_ckpt)


def test_kestrels_checkpoint_is_read_as_kestrel_reads_it(base, drawn):
    """Every tensor under both of its module names, nested in `lora_state_dict`: read as
    the drawn values, rank 4 (2 per expert, k = 2), dense layers on fc1/fc2 only."""
    a = read_adapter(FINAL_PT, base.cfg, name="ft", max_rank=8)
    cfg = base.cfg.text
    assert a.rank == 4 and cfg.moe.experts_per_token == 2
    for i in range(cfg.n_dense):
        assert set(a.layers[i]) == {"fc1", "fc2"}
        np.testing.assert_array_equal(a.layers[i]["fc1"][0], drawn[f"dense.{i}.up_a"])
        np.testing.assert_array_equal(a.layers[i]["fc2"][1], drawn[f"dense.{i}.down_b"])
    for j in range(cfg.n_moe):
        layer = a.layers[cfg.n_dense + j]
        assert set(layer) == {"up", "down"}
        np.testing.assert_array_equal(layer["up"][1], drawn[f"moe.{j}.up_b"])
        np.testing.assert_array_equal(layer["down"][0], drawn[f"moe.{j}.down_a"])
    # The engine's slot form (max_rank 8, float32) was built by the read, on the loading
    # thread: the scheduler thread that writes the slot gets it ready-made.
    assert list(a._padded) == [(8, np.dtype(np.float32).str)]
    # Padded to a larger slot rank, the expert tables take rank 8 / 2 = 4 per expert.
    t = a.padded(8, np.float32)
    assert t is a.padded(8, np.float32)
    assert t[cfg.n_dense]["up"]["A"].shape == (cfg.moe.num_experts, 4, cfg.dim)
    assert not t[cfg.n_dense]["up"]["A"][:, 2:].any()


# Compiled (the schedules' loops run op by op otherwise); the reference's compile is shared
# by every case of a format.
_moe = jax.jit(moe.moe_mlp, static_argnames=("k", "schedule_"))
_merged = jax.jit(moe.dense_reference, static_argnames=("k",))


@pytest.mark.parametrize("fmt", [None, "fp8"], ids=["float", "fp8_experts"])
@pytest.mark.parametrize("how", ["dense", "gather", "blocks", "ragged", "megablox-interpret"])
def test_every_moe_schedule_applies_expert_adapters_as_the_merged_experts(base, drawn, how,
                                                                          fmt):
    """One MoE layer on 70 tokens of 3 rows (two adapters in slots 1 and 2, the base in slot
    0), per schedule: each row equals the merged layer's output (dense reference
    schedule), and the adapted rows differ from the base's.  With FP8 experts too (Moondream
    3.1's): the adapters beside the codes, widened in the product, against the widened
    experts merged."""
    cfg = base.cfg
    p = base.params["text"]["moe_blocks"][0]["moe"]
    if fmt is not None:
        p = {**p, **{n: jax.tree.map(jnp.asarray, quant.quantize(np.asarray(p[n]), fmt))
                     for n in ("fc1", "fc2")}}
    wide = {n: quant.dequantize(p[n], jnp.float32) for n in ("fc1", "fc2")}
    a = read_adapter(FINAL_PT, cfg, name="ft", max_rank=8)
    tables = lora.init_tables(cfg, 2, 8, jnp.float32)
    tables = lora.write_slot(tables, 1, jax.tree.map(jnp.asarray, a.padded(8, np.float32)))
    half = [{t: {"A": jnp.asarray(ab["A"]) * 0.5, "B": jnp.asarray(ab["B"])}
             for t, ab in layer.items()} for layer in a.padded(8, np.float32)]
    tables = lora.write_slot(tables, 2, half)
    layer = tables[cfg.text.n_dense]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 70, cfg.text.dim)).astype(np.float32))
    slot = jnp.repeat(jnp.asarray([1, 0, 2], jnp.int32), 70)
    k = cfg.text.moe.experts_per_token
    got = _moe(p, x, k=k, schedule_=how, lora=(layer, slot))
    for row, scale in ((0, 1.0), (1, 0.0), (2, 0.5)):
        m = dict(p)
        for proj, name in (("up", "fc1"), ("down", "fc2")):
            aa, bb = drawn[f"moe.0.{proj}_a"] * scale, drawn[f"moe.0.{proj}_b"]
            m[name] = wide[name] + jnp.asarray(np.einsum("eor,eri->eio", bb, aa))
        want = _merged(m, x[row], k=k)
        np.testing.assert_allclose(np.asarray(got[row]), np.asarray(want), rtol=2e-5,
                                   atol=2e-5)
    plain = _moe(p, x, k=k, schedule_=how)
    assert np.array_equal(np.asarray(got[1]), np.asarray(plain[1]))   # slot 0: no adapter
    assert np.abs(np.asarray(got[0]) - np.asarray(plain[0])).max() > 1e-2


def _outs(md, variant):
    s = dict(GREEDY, variant=variant) if variant else GREEDY
    return [md.caption(LAND, "short", settings=s)["caption"],
            md.query(SQ, "w100 w200", reasoning=False, settings=s)["answer"],
            md.query(None, "w7 w8 w9", reasoning=False, settings=s)["answer"]]


@pytest.fixture(scope="module")
def merged_outs(md3_ckpt, drawn):
    """The merged model's outputs, without an adapter (computed once for both tests)."""
    mm = merged_model(Model.load(md3_ckpt), drawn)
    merged = Moondream(mm, Engine(mm, max_batch_size=4))
    try:
        return _outs(merged, None)
    finally:
        merged.close()


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_engine_with_the_adapter_gives_the_merged_models_tokens(md3_ckpt, merged_outs,
                                                                    drawn, tmp_path, pipelined):
    """Captions and queries (an image prefix and text only) under the adapter equal the
    merged model's without one, pipelined and blocking, with base rows beside them in the
    same batches; the adapter changes every one of them.  Two more adapters loaded later
    (one evicting another from the 2 slots) trace no program again."""
    want = merged_outs
    base = Model.load(md3_ckpt)   # its own: closing a Moondream frees its model's weights
    md = Moondream(base, Engine(base, max_batch_size=4, pipelined=pipelined, max_adapters=2,
                                max_lora_rank=8,
                                adapters={"ft": read_adapter(FINAL_PT, base.cfg, name="ft",
                                                             max_rank=8)}))
    try:
        plain = _outs(md, None)
        got = _outs(md, "ft")
        # Adapted and base rows submitted together: they share the engine's steps.
        p = base.prompts
        mixed = md.engine.submit_many([
            Request("text", p.caption("short"), LAND, Settings(**GREEDY, variant=v))
            for v in ("ft", None, "ft", None)])
        mixed = [h.result()["text"] for h in mixed]
        # A second adapter (the same one with its A halved: another digest) into the free
        # slot, then a third evicting the least recently used: nothing is traced again.
        progs = md.engine.programs
        before = {n: getattr(progs, n)._cache_size()
                  for n in ("forward", "prefill_slot", "image_kv")}
        for name, scale in (("half", 0.5), ("third", 0.3)):
            t = {f"text_lora.{k}": v * scale if k.endswith("_a") else v
                 for k, v in drawn.items()}
            write_safetensors(tmp_path / f"{name}.safetensors", t)
            md.load_adapter(name, tmp_path / f"{name}.safetensors")
        others = [md.caption(LAND, "short", settings=dict(GREEDY, variant=v))["caption"]
                  for v in ("half", "third")]
        after = {n: getattr(progs, n)._cache_size()
                 for n in ("forward", "prefill_slot", "image_kv")}
        loads = md.engine.sched.adapters.loads
    finally:
        md.close()
    assert after == before and loads == 3
    assert len({want[0], plain[0], *others}) == 4
    assert got == want
    assert all(g != q for g, q in zip(got, plain))
    # the adapter's image prefix was cached apart from the base's
    assert mixed == [want[0], plain[0]] * 2


def _kestrel_tensors(drawn, prefix="text_lora."):
    return {prefix + k: v for k, v in drawn.items()}


BAD = {
    "attention_key": (lambda t: t.update({"text.blocks.0.attn.qkv.A":
                                          np.zeros((4, 64), np.float32)}),
                      r"adapts text layer 0's qkv.*layer 0 is a dense layer; its targets: "
                      r"\['fc1', 'fc2'\]"),
    "vision": (lambda t: t.update({"vision_lora.proj_fc2.down": np.zeros((4, 128),
                                                                          np.float32)}),
               "vision projection"),
    "prefixes_differ": (lambda t: t.update({"_text.moe.0.up_a": t["text_lora.moe.0.up_a"]
                                            + 1}), "differ"),
    "expert_count": (lambda t: t.update({"text_lora.moe.1.down_b":
                                         t["text_lora.moe.1.down_b"][:4]}), "do not fit"),
    "moe_past_the_model": (lambda t: t.update({"text_lora.moe.2.up_a": t["text_lora.moe.0.up_a"],
                                               "text_lora.moe.2.up_b": t["text_lora.moe.0.up_b"]}),
                           "text layer 4"),
    "dense_on_an_moe_layer": (lambda t: t.update({
        "text_lora.dense.2.up_a": t["text_lora.dense.0.up_a"],
        "text_lora.dense.2.up_b": t["text_lora.dense.0.up_b"]}),
        r"layer 2's fc1.*layer 2 is a mixture-of-experts layer; its targets: \['down', 'up'\]"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_moondream3_adapter_is_refused_by_name(base, drawn, tmp_path, kind):
    edit, words = BAD[kind]
    t = _kestrel_tensors(drawn)
    edit(t)
    p = tmp_path / f"{kind}.safetensors"
    write_safetensors(p, t)
    with pytest.raises(AdapterError, match=words) as e:
        read_adapter(p, base.cfg, name=f"bad-{kind}", max_rank=8)
    assert f"bad-{kind}" in str(e.value)


def test_ranks_are_counted_as_kestrel_counts_them(base, drawn, tmp_path):
    """A per-expert rank counts k times against max_lora_rank (kestrel: rank = per-expert
    rank x experts per token); the same names unprefixed in a safetensors file read the
    same; a max_lora_rank below k cannot hold any expert adapter and is refused."""
    p = tmp_path / "plain.safetensors"
    write_safetensors(p, dict(drawn))
    a = read_adapter(p, base.cfg, name="plain", max_rank=4)
    assert a.rank == 4 and a.digest == read_adapter(FINAL_PT, base.cfg, name="x",
                                                     max_rank=4).digest
    experts = tmp_path / "experts.safetensors"
    write_safetensors(experts, {k: v for k, v in drawn.items() if k.startswith("moe.")})
    assert read_adapter(experts, base.cfg, name="e", max_rank=4).rank == 4
    with pytest.raises(AdapterError, match=r"rank 4 \(2 per expert, 2 experts per token\).*"
                                           "max_lora_rank 3"):
        read_adapter(experts, base.cfg, name="big", max_rank=3)
    with pytest.raises(ValueError, match="max_lora_rank 1 is below Moondream 3's 2 experts"):
        Engine(base, max_batch_size=2, max_adapters=1, max_lora_rank=1)
