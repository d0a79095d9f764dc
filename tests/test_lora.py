"""LoRA adapters (finetune variants): loaded as published, applied as the reference applies
them, many in one batch, no recompile when a new one arrives, bad ones refused by name.

The goldens (tests/fixtures/lora/golden.json) are the public reference's outputs on the tiny
Moondream 2 fixture with each adapter of that folder selected by settings["variant"]
(tests/fixtures/lora/make_golden.py wrote the adapters as `final.pt` files and ran it)."""

import http.server
import json
import os
import shutil
import threading

import pytest

from helpers import LAND, LORA_DIR, SQ, lora_tensors, write_lora, \
    write_safetensors
from photon_jax import Moondream
from photon_jax.convert.adapters import AdapterError, read_adapter, variant_path
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request, RequestError
from photon_jax.engine.settings import Settings, SettingsError
from photon_jax.model import lora

with open(os.path.join(LORA_DIR, "golden.json")) as _f:
    GOLDEN = json.load(_f)
VARIANTS = list(GOLDEN["adapters"])
FINAL_PT = {v: os.path.join(LORA_DIR, v, "final.pt") for v in VARIANTS}
IMAGES = {"sq378": SQ, "land800x600": LAND}


@pytest.fixture(scope="module")
def md(tiny_ckpt):
    m = Moondream.load(tiny_ckpt, adapters=FINAL_PT, max_adapters=4, max_lora_rank=8,
                       max_batch_size=8)
    yield m
    m.close()


def _run(md, case, image, variant):
    st = GOLDEN["settings"]
    s = {"temperature": 0, "max_tokens": st["max_tokens"], "variant": variant}
    if case.startswith("caption"):
        return {"text": md.caption(image, case.split("_")[1], settings=s)["caption"]}
    if case == "query":
        return {"text": md.query(image, st["question"], reasoning=False, settings=s)["answer"]}
    s = {"max_objects": st["max_objects"], "variant": variant}
    r = getattr(md, case)(image, st["object"], settings=s)
    return {case: r["objects" if case == "detect" else "points"]}


def _same(got: dict, want: dict) -> bool:
    if "text" in got:
        return got["text"] == want["text"]
    (k, g), w = next(iter(got.items())), next(v for n, v in want.items() if n != "ids")
    return len(g) == len(w) and all(abs(a[c] - b[c]) < 1e-6 for a, b in zip(g, w) for c in a)


def test_every_skill_with_each_adapter_gives_the_reference_outputs(md):
    """caption (short, normal), query, detect and point on two images, without an adapter
    and with each of two adapters (rank 4 under the training code's key names, rank 8 under
    the reference's renamed ones): the reference's outputs, every one.  The base runs first
    and the adapters after, on the same images, so a prefix cache that ignored the adapter
    would hand the adapted requests the base's image prefix."""
    bad = []
    for variant, runs in GOLDEN["runs"].items():
        for image_id, cases in runs.items():
            for case, want in cases.items():
                got = _run(md, case, IMAGES[image_id], None if variant == "base" else variant)
                if not _same(got, want):
                    bad.append((variant, image_id, case, got, want))
    assert not bad, bad[:3]
    # The goldens are worth checking: every adapted case differs from the base's.
    assert all(n == 10 for n in GOLDEN["cases_differing_from_base"].values())
    # each adapter's image prefixes were cached apart from the base's
    assert md.engine.stats()["prefix_cache"]["misses"] >= 2 * 3


def _requests(model, variants):
    reqs = []
    for i, v in enumerate(variants):
        img = (LAND, SQ)[i % 2]
        reqs.append(Request("text", model.prompts.caption("normal"), img,
                            Settings(temperature=0, max_tokens=10, variant=v)))
    return reqs


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_a_mixed_batch_gives_each_row_its_tokens_alone_and_a_new_adapter_compiles_nothing(
        md, tmp_path, pipelined):
    """Rows of four adapters and rows without one, decoded together: each row's tokens are
    the ones it gets alone.  Then a fifth adapter is loaded and used (evicting the least
    recently used slot): no step program is traced again."""
    model = md.engine.model
    eng = Engine(model, max_batch_size=8, max_adapters=4, max_lora_rank=8, pipelined=pipelined,
                 adapters={})
    try:
        for name, seed in (("gamma", 11), ("delta", 12), ("epsilon", 13)):
            path = write_lora(tmp_path / f"{name}.safetensors", 2 + seed % 5, seed)
            eng.adapters[name] = read_adapter(path, model.cfg, name=name, max_rank=8)
        for v in VARIANTS:
            eng.adapters[v] = md.engine.adapters[v]
        mix = [None, "ft-alpha@100", "ft-beta@7", "gamma", None, "delta", "ft-alpha@100",
               "delta"]
        alone = [eng.submit(r).result(timeout=300)["ids"] for r in _requests(model, mix)]
        assert len({tuple(a) for a in alone}) >= 5   # the adapters make a difference
        together = [h.result(timeout=300)["ids"]
                    for h in eng.submit_many(_requests(model, mix))]
        assert together == alone
        assert eng.counters["decode"] + eng.counters["burst"] > 0
        progs = eng.programs
        before = {n: getattr(progs, n)._cache_size()
                  for n in ("forward", "prefill_slot", "image_kv")}
        fifth = eng.submit(_requests(model, ["epsilon"])[0]).result(timeout=300)["ids"]
        after = {n: getattr(progs, n)._cache_size()
                 for n in ("forward", "prefill_slot", "image_kv")}
        assert after == before
        assert fifth not in alone
        assert eng.sched.adapters.loads == 5   # four, then the fifth into an evicted slot
    finally:
        eng.close()


def test_ranks_128_and_512_in_one_batch_equal_the_one_request_path(md, tmp_path):
    """The largest ranks the issue names (512, and 128 beside it): rows of both adapters and
    rows without one, decoded together in slots sized for rank 512 (a rank-128 adapter is
    zero-padded there), give the one-request path's ids under each row's adapter."""
    from photon_jax.engine import reference

    model = md.engine.model
    # B twice the helper's default scale: strong enough that an engine which lost the
    # components past rank 64 gives other ids (checked by making it do so).
    adapters = {f"r{r}": read_adapter(write_lora(tmp_path / f"r{r}.safetensors", r, r,
                                                 b_scale=1.0),
                                      model.cfg, name=f"r{r}", max_rank=512)
                for r in (128, 512)}
    assert {a.rank for a in adapters.values()} == {128, 512}
    mix = [None, "r512", "r128", "r512"]
    reqs = [Request("text", model.prompts.caption("normal"), SQ,
                    Settings(temperature=0, max_tokens=10, variant=v)) for v in mix]
    eng = Engine(model, max_batch_size=4, max_adapters=2, max_lora_rank=512,
                 adapters=adapters)
    try:
        got = [h.result(timeout=300)["ids"] for h in eng.submit_many(reqs)]
    finally:
        eng.close()
    want = {}
    for v in (None, "r128", "r512"):
        a = None if v is None else adapters[v]
        enc = reference.encode_image(model, SQ, adapter=a)
        want[v] = reference.generate_text(model, enc, model.prompts.caption("normal"),
                                          Settings(temperature=0, max_tokens=10),
                                          adapter=a)["ids"]
    assert got == [want[v] for v in mix]
    # Each adapter changes the caption, and none is empty (an EOS at once would match a row
    # whose adapter was lost as easily as a right one).
    assert len({tuple(w) for w in want.values()}) == 3 and all(want.values())


def test_an_image_encoded_under_a_variant_gives_the_references_outputs_for_that_variant(md):
    """encode_image(image, variant=...) computes the prefix under the adapter (as the
    reference's encode_image with settings["variant"] prefills the image through the
    adapted decoder): that variant's calls on it give the goldens.  A call of another
    variant (or none) uses the encoded prefix as it is, as the reference does with an
    EncodedImage it is handed: the one-request path on that prefix under the call's
    adapter."""
    from photon_jax.engine import reference

    v, st = "ft-beta@7", GOLDEN["settings"]
    s = {"temperature": 0, "max_tokens": st["max_tokens"], "variant": v}
    want = GOLDEN["runs"][v]["sq378"]
    enc = md.encode_image(SQ, variant=v)
    base = md.encode_image(SQ)
    try:
        assert enc.variant == v and base.variant is None and v in repr(enc)
        assert md.caption(enc, "short", settings=s)["caption"] == want["caption_short"]["text"]
        assert md.query(enc, st["question"], settings=s)["answer"] == want["query"]["text"]
        assert md.caption(base, "short", settings={**s, "variant": None})["caption"] == \
            GOLDEN["runs"]["base"]["sq378"]["caption_short"]["text"] != \
            want["caption_short"]["text"]
        # Crossed: the base's prefix under the adapter, the adapter's prefix under none.
        model, a = md.engine.model, md.engine.adapters[v]
        prompt = model.prompts.caption("short")
        one = Settings(temperature=0, max_tokens=st["max_tokens"])
        crossed = [(base, v, reference.encode_image(model, SQ), a),
                   (enc, None, reference.encode_image(model, SQ, adapter=a), None)]
        matched = [want["caption_short"]["text"],
                   GOLDEN["runs"]["base"]["sq378"]["caption_short"]["text"]]
        for (image, variant, prefix, adapter), same_call in zip(crossed, matched):
            got = md.caption(image, "short", settings={**s, "variant": variant})["caption"]
            assert got == reference.generate_text(model, prefix, prompt, one,
                                                  adapter=adapter)["text"]
            assert got != same_call   # the prefix used is the handed one, not recomputed
    finally:
        enc.release()
        base.release()
    assert md.engine.sched.adapters.in_use() == 0   # the encode gave its slot back
    # A variant that is not a name is refused by name, by the engine's own call too.
    with pytest.raises(SettingsError, match=r"settings\['variant'\] must be an adapter name"):
        md.engine.encode(SQ, ["ft-beta@7"])


def test_requests_for_another_adapter_wait_for_a_free_slot(md):
    """One slot, three adapters requested at once: each request waits until the rows
    using the slot's adapter finish, then gets its own tokens."""
    model = md.engine.model
    eng = Engine(model, max_batch_size=8, max_adapters=1, max_lora_rank=8,
                 adapters=md.engine.adapters)
    try:
        mix = ["ft-alpha@100", "ft-beta@7", "ft-alpha@100", None, "ft-beta@7"]
        alone = [eng.submit(r).result(timeout=300)["ids"] for r in _requests(model, mix)]
        loads = eng.sched.adapters.loads
        together = [h.result(timeout=300)["ids"]
                    for h in eng.submit_many(_requests(model, mix))]
        assert together == alone
        # The slot changed hands: the alone run left ft-beta in it and ft-alpha's rows need
        # it too.  Once, not necessarily twice: which adapter's rows are admitted first
        # depends on which requests' images are ready at the first admission.
        assert eng.sched.adapters.loads - loads >= 1
        st = eng.stats()["adapters"]
        assert st["slots_in_use"] == 0 and st["slot_loads"] == eng.sched.adapters.loads
        # the one slot's tables, counted in the memory plan
        assert eng.memory()["adapter_tables"] == lora.table_bytes(model.cfg, 1, 8) > 0
    finally:
        eng.close()


def test_an_encode_under_a_variant_waits_for_a_slot_and_gives_it_back(md):
    """One slot, which another adapter's tables fill (a request of it ran first) and a
    running request of it may hold: the variant's encode waits for the slot if it is held,
    must rewrite it (an encode that skipped the write would compute the prefix under the
    other adapter's tables), and leaves no slot held; the goldens' ids follow."""
    model = md.engine.model
    v, st = "ft-beta@7", GOLDEN["settings"]
    eng = Engine(model, max_batch_size=8, max_adapters=1, max_lora_rank=8,
                 adapters=md.engine.adapters)
    try:
        eng.submit(_requests(model, ["ft-alpha@100"])[0]).result(timeout=300)
        busy = eng.submit(_requests(model, ["ft-alpha@100"])[0])
        enc = eng.encode(SQ, v).result(timeout=300)
        assert busy.result(timeout=300)["ids"] and enc.variant == v
        got = eng.submit(Request("text", model.prompts.caption("short"), enc, Settings(
            temperature=0, max_tokens=st["max_tokens"], variant=v))).result(timeout=300)
        assert got["ids"] == GOLDEN["runs"][v]["sq378"]["caption_short"]["ids"]
        enc.release()
        assert eng.stats()["adapters"]["slots_in_use"] == 0
    finally:
        eng.close()


def _bad(tmp_path, name, edit):
    t = lora_tensors(4, 0)
    edit(t)
    p = tmp_path / f"{name}.safetensors"
    write_safetensors(p, t)
    return p


BAD = {
    "wrong_shape": (lambda t: t.update({"text.blocks.0.attn.qkv.A":
                                        t["text.blocks.0.attn.qkv.A"][:, :32]}), "do not fit"),
    "other_model_layer": (lambda t: t.update({"text.blocks.5.mlp.fc1.A":
                                              t["text.blocks.0.mlp.fc1.A"],
                                              "text.blocks.5.mlp.fc1.B":
                                              t["text.blocks.0.mlp.fc1.B"]}), "layer 5"),
    "unknown_key": (lambda t: t.update({"vision.blocks.0.attn.qkv.A":
                                        t["text.blocks.0.attn.qkv.A"]}), "not a Moondream text adapter"),
    "missing_B": (lambda t: t.pop("text.blocks.1.mlp.fc2.B"), "needs both A and B"),
    "nan": (lambda t: t["text.blocks.0.attn.proj.B"].__setitem__((0, 0), float("nan")),
            "NaN"),
    "two_spellings": (lambda t: t.update({
        "text_model.transformer.h.0.mixer.Wqkv.parametrizations.weight.0.A":
            t["text.blocks.0.attn.qkv.A"]}), "same weight under two names"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_adapter_is_refused_by_name_before_it_touches_a_slot(md, tmp_path, kind):
    edit, words = BAD[kind]
    path = _bad(tmp_path, kind, edit)
    loaded = dict(md.engine.adapters)
    with pytest.raises(AdapterError, match=words) as e:
        md.load_adapter(f"bad-{kind}", path)
    assert f"bad-{kind}" in str(e.value)
    assert md.engine.adapters == loaded


def test_rank_over_the_limit_and_unloaded_variants_are_refused(md, tmp_path):
    with pytest.raises(AdapterError, match="max_lora_rank 8"):
        md.load_adapter("big", write_lora(tmp_path / "big.safetensors", 16, 1))
    md.load_adapter("short-lived", write_lora(tmp_path / "s.safetensors", 2, 3))
    md.unload_adapter("short-lived")
    with pytest.raises(RequestError, match="'short-lived'.*not loaded"):
        md.engine.submit(_requests(md.engine.model, ["short-lived"])[0]).result(timeout=60)
    with pytest.raises(RequestError, match="'nope'.*not loaded"):
        md.engine.submit(_requests(md.engine.model, ["nope"])[0]).result(timeout=60)
    eng = Engine(md.engine.model, max_batch_size=2)
    try:
        with pytest.raises(RequestError, match="ft-beta@7.*no adapter slots"):
            eng.submit(_requests(md.engine.model, ["ft-beta@7"])[0]).result(timeout=60)
    finally:
        eng.close()


def test_a_variant_id_is_read_from_the_reference_cache_folder_and_never_fetched_offline(
        md, tmp_path, monkeypatch):
    """settings={"variant": id} with an id not loaded: its final.pt is taken from
    `$HF_HUB_CACHE/md_variants/<id>/` as the reference would; offline, a missing one is
    refused by name (no network)."""
    cache = tmp_path / "hub"
    os.makedirs(cache / "md_variants" / "ft-beta@7")
    shutil.copy(FINAL_PT["ft-beta@7"], cache / "md_variants" / "ft-beta@7" / "final.pt")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOONDREAM_ENDPOINT", "http://127.0.0.1:9")   # nothing listens
    name = "ft-beta@7"
    saved = md.engine.adapters.pop(name)
    try:
        want = GOLDEN["runs"][name]["sq378"]["query"]
        assert _same(_run(md, "query", SQ, name), want)
        assert name in md.adapters
        with pytest.raises(AdapterError, match="'missing@1' is not loaded.*HF_HUB_OFFLINE"):
            md.caption(SQ, settings={"variant": "missing@1"})
    finally:
        md.engine.adapters[name] = saved


def test_a_model_loaded_with_no_adapter_options_serves_variants_on_first_need(
        tiny_ckpt, tmp_path, monkeypatch, caplog):
    """Moondream.load with nothing about adapters: plain requests run the programs without
    adapter products (no slot tables exist), while the plan sets the default slots' bytes
    aside; the first variant request (an id from the reference's cache folder) makes the
    tables, logs it once, and gets the reference's outputs; plain requests still do, and so
    do later variants through load_adapter."""
    cache = tmp_path / "hub"
    os.makedirs(cache / "md_variants" / "ft-alpha@100")
    shutil.copy(FINAL_PT["ft-alpha@100"], cache / "md_variants" / "ft-alpha@100" / "final.pt")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with Moondream.load(tiny_ckpt, max_batch_size=4) as m:
        base = GOLDEN["runs"]["base"]["sq378"]
        assert _same(_run(m, "caption_short", SQ, None), base["caption_short"])
        assert m.engine.lora is None
        mem = m.engine.memory()
        assert mem["adapter_slots"] == 4
        assert mem["adapter_tables"] == lora.table_bytes(m.config, 4, 16) > 0
        with caplog.at_level("INFO", logger="photon_jax.engine.core"):
            for v in VARIANTS:
                if v == "ft-beta@7":   # the other way in: loaded by path
                    m.load_adapter(v, FINAL_PT[v])
                want = GOLDEN["runs"][v]["sq378"]
                for case in ("caption_short", "query", "point"):
                    assert _same(_run(m, case, SQ, v), want[case]), (v, case)
        assert m.engine.lora is not None
        assert sum("adapter slots enabled" in r.message for r in caplog.records) == 1
        for case in ("caption_short", "detect"):
            assert _same(_run(m, case, SQ, None), base[case]), case
        assert m.engine.stats()["adapters"]["slots_in_use"] == 0


def test_max_adapters_0_refuses_variants_naming_the_option(tiny_ckpt):
    with Moondream.load(tiny_ckpt, max_batch_size=2, max_adapters=0) as m:
        with pytest.raises(ValueError, match="max_adapters=0"):
            m.load_adapter("a", FINAL_PT["ft-alpha@100"])
        with pytest.raises(RequestError, match="'x'.*max_adapters=0"):
            m.engine.submit(_requests(m.engine.model, ["x"])[0]).result(timeout=60)
        assert m.engine.memory()["adapter_tables"] == 0


def test_a_missing_variant_is_downloaded_where_and_as_the_reference_downloads_it(
        tmp_path, monkeypatch):
    seen = {}
    body = open(FINAL_PT["ft-alpha@100"], "rb").read()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen["path"], seen["headers"] = self.path, dict(self.headers)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("MOONDREAM_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
        monkeypatch.setenv("MOONDREAM_API_KEY", "key-123")
        p = variant_path("ft-alpha@100")
        assert p == tmp_path / "hf" / "hub" / "md_variants" / "ft-alpha@100" / "final.pt"
        assert p.read_bytes() == body
        assert seen["path"] == "/v1/variants/ft-alpha@100/download"
        assert seen["headers"]["User-Agent"] == "moondream-torch"
        assert seen["headers"]["X-Moondream-Auth"] == "key-123"
        with pytest.raises(AdapterError, match="not a variant id"):
            variant_path("../../etc")
    finally:
        srv.shutdown()


def test_photon_caption_with_an_adapter(md, tiny_ckpt, tmp_path):
    """photon-caption --adapter NAME=PATH --variant NAME captions as the API with that
    variant."""
    from photon_jax.cli.caption import main

    jl = tmp_path / "out.jsonl"
    rc = main([SQ, LAND, "--model", tiny_ckpt, "--adapter", f"beta={FINAL_PT['ft-beta@7']}",
               "--variant", "beta", "--max-lora-rank", "8", "--max-tokens", "10",
               "--no-sidecar", "--jsonl", str(jl), "--quiet", "--no-compile-cache"])
    assert rc == 0
    got = {json.loads(x)["path"]: json.loads(x)["caption"] for x in jl.read_text().splitlines()}
    s = {"temperature": 0, "max_tokens": 10, "variant": "ft-beta@7"}
    assert got == {os.path.abspath(p): md.caption(p, settings=s)["caption"] for p in (SQ, LAND)}


def test_a_bad_adapter_given_to_load_is_refused_before_the_weights_load(tiny_ckpt, tmp_path,
                                                                        monkeypatch):
    """Moondream.load(adapters=...) checks every adapter against the config first (in the
    load's preflight, before the weights are read): a bad one is refused by name and no
    model is built."""
    from photon_jax.model import loaded

    placed = []
    real = loaded.Model.__init__
    monkeypatch.setattr(loaded.Model, "__init__",
                        lambda self, *a, **k: (placed.append(1), real(self, *a, **k))[1])
    bad = write_lora(tmp_path / "wide.safetensors", 4, 0, dim=128)
    with pytest.raises(AdapterError, match="'wide'.*do not fit"):
        Moondream.load(tiny_ckpt, adapters={"wide": bad})
    assert placed == []
    with pytest.raises(ValueError, match="max_adapters=0"):
        Moondream.load(tiny_ckpt, adapters={"alpha": FINAL_PT["ft-alpha@100"]}, max_adapters=0)
    assert placed == []


def test_the_one_request_path_with_an_adapter_gives_the_reference_ids(md):
    """The oracle the randomized workloads compare with (engine/reference.py) applies an
    adapter as the reference does: its caption and query ids are the goldens'."""
    from photon_jax.engine import reference

    model = md.engine.model
    a = md.engine.adapters["ft-beta@7"]
    s = Settings(temperature=0, max_tokens=GOLDEN["settings"]["max_tokens"])
    for image_id, path in IMAGES.items():
        enc = reference.encode_image(model, path, adapter=a)
        want = GOLDEN["runs"]["ft-beta@7"][image_id]
        got = reference.generate_text(model, enc, model.prompts.caption("short"), s,
                                      adapter=a)
        assert got["ids"] == want["caption_short"]["ids"]
        got = reference.generate_text(model, enc, model.prompts.query(
            GOLDEN["settings"]["question"]), s, adapter=a)
        assert got["ids"] == want["query"]["ids"]


@pytest.mark.parametrize("seed", [0])
def test_random_mixed_workloads_with_adapters_equal_the_one_request_path(tiny_ckpt, tmp_path,
                                                                         seed):
    """Random mixed requests (captions, queries, text-only, detect, point, a shared system
    prompt, follow-ups of earlier answers; image paths and encoded prefixes) of which half
    name one of three adapters, in staggered waves through 2 adapter slots and 3 rows,
    pipelined and blocking: every result equals the one-request path under the request's
    adapter (prefix and conversation caches shared across adapters would break this)."""
    from helpers import ENGINE_IMAGES, biased_model, run_in_waves, strip, workload

    from photon_jax.engine import reference

    model = biased_model(tiny_ckpt, {0: 0.8})
    adapters = {v: read_adapter(FINAL_PT[v], model.cfg, name=v, max_rank=8) for v in VARIANTS}
    adapters["gamma"] = read_adapter(write_lora(tmp_path / "g.safetensors", 3, 21),
                                     model.cfg, name="gamma", max_rank=8)
    encoded = [reference.encode_image(model, p) for p in ENGINE_IMAGES]
    items = workload(model, encoded, seed, 16, adapters=adapters, followups=True)
    reqs = [r for r, _ in items]
    assert 4 <= sum(r.settings.variant is not None for r in reqs) <= 12
    for pipelined in (True, False):
        eng = Engine(model, max_batch_size=3, pipelined=pipelined, max_adapters=2,
                     max_lora_rank=8, adapters=adapters)
        try:
            got = run_in_waves(eng, reqs, waves=5)
            hits = eng.stats()["conversation_cache"]["hit_pages"]
        finally:
            eng.close()
        assert [strip(g) for g in got] == [w for _, w in items]
        assert hits > 0   # follow-ups (under their adapter) read the conversation cache
        assert eng.sched.adapters.in_use() == 0 and eng.sched.adapters.loads >= 3
