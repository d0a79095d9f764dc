"""The process's memory-mapping limit (`hostmem.mapping_headroom`): XLA:CPU keeps each
compiled program's code in mappings of its own, and a process at Linux's `vm.max_map_count`
fails its compiles and can then crash in libgcc's unwinder (docs/testing.md, "The worker
crashes").  The engine warns near the limit; the suite releases its compiled programs
between files when a worker passes half of it (conftest.py)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np

from photon_jax.engine import hostmem

from helpers import release_programs


def write(path, text):
    path.write_text(text)
    return str(path)


def test_mappings_are_counted_from_proc(tmp_path):
    maps = write(tmp_path / "maps", "a\n" * 1234)
    limit = write(tmp_path / "max_map_count", "65530\n")
    assert hostmem.mapping_headroom(maps, limit) == (1234, 65530)
    assert hostmem.mapping_headroom(str(tmp_path / "none"), limit) is None
    assert hostmem.mapping_headroom(maps, str(tmp_path / "none")) is None
    # This process, on Linux: some mappings, under its limit.
    room = hostmem.mapping_headroom()
    assert room is not None and 0 < room[0] < room[1]


def test_the_warning_starts_past_the_share_and_names_the_fixes(tmp_path):
    limit = write(tmp_path / "max_map_count", "1000\n")
    under = write(tmp_path / "under", "m\n" * 800)
    over = write(tmp_path / "over", "m\n" * 801)
    assert hostmem.mappings_warning(under, limit) is None
    msg = hostmem.mappings_warning(over, limit)
    assert "801 memory mappings of the 1000" in msg
    assert "vm.max_map_count" in msg and "xla_cpu_parallel_codegen_split_count=1" in msg


def test_the_engine_warning_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(hostmem, "_warned_mappings", False)
    monkeypatch.setattr(hostmem, "mappings_warning", lambda: "near the limit")
    log = logging.getLogger("photon_jax.test_map_limit")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert hostmem.warn_mappings(log) is True
        assert hostmem.warn_mappings(log) is False
    assert [r.getMessage() for r in caplog.records] == ["photon_jax: near the limit"]


@jax.jit
def _held(x):
    return jnp.tanh(x * 3.0) @ x.T + 1.0


def test_released_programs_give_their_mappings_back():
    """The suite's guard frees compiled code that live functions still hold: one jitted
    function compiled for 40 shapes keeps 40 executables (and their mappings) for as long
    as it lives, until `release_programs` (jax's caches, photon_jax's program caches, a
    collection) drops them."""
    release_programs()
    before = hostmem.mappings_in_use()
    for n in range(1, 41):
        np.asarray(_held(jnp.ones((n, 4))))
    grown = hostmem.mappings_in_use()
    assert grown > before + 40          # at least one mapping each, held by `_held`
    release_programs()
    assert hostmem.mappings_in_use() < before + (grown - before) / 4


def test_an_engine_on_the_cpu_warns_at_close_past_the_share(tiny_ckpt, monkeypatch, caplog):
    """The engine asks at close (what it compiled on first use), so a process that keeps
    making engines hears of the limit before it reaches it."""
    from photon_jax.engine.core import Engine
    from photon_jax.model import Model

    monkeypatch.setattr(hostmem, "_warned_mappings", False)
    monkeypatch.setattr(hostmem, "mappings_warning", lambda: "near the limit")
    eng = Engine(Model.load(tiny_ckpt), max_batch_size=1)
    with caplog.at_level(logging.WARNING, logger="photon_jax.engine.core"):
        eng.close()
    assert "photon_jax: near the limit" in [r.getMessage() for r in caplog.records]
