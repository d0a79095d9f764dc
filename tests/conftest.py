"""Shared test fixtures: the tiny reference model (converted once per session) and its
golden cases, all from tests/fixtures (a fresh clone tests itself)."""

import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE_DIR = os.path.join(HERE, "fixtures", "moondream2-tiny")
MANIFEST = os.path.join(HERE, "fixtures", "moondream2-manifest.json")
MD3_FIXTURE_DIR = os.path.join(HERE, "fixtures", "moondream3-tiny")


@pytest.fixture(scope="session")
def fixture_dir():
    return FIXTURE_DIR


@pytest.fixture(scope="session")
def cases():
    with open(os.path.join(FIXTURE_DIR, "cases.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def arrays():
    return dict(np.load(os.path.join(FIXTURE_DIR, "cases.npz")))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The fixture's HF folder converted with photon-convert (float32)."""
    from photon_jax.convert import convert

    out = tmp_path_factory.mktemp("ckpt") / "tiny-f32"
    convert(FIXTURE_DIR, str(out), dtype="float32", log=lambda s: None)
    return str(out)


@pytest.fixture(scope="session")
def tiny_ckpt_bf16(tmp_path_factory):
    from photon_jax.convert import convert

    out = tmp_path_factory.mktemp("ckpt") / "tiny-bf16"
    convert(FIXTURE_DIR, str(out), dtype="bfloat16", log=lambda s: None)
    return str(out)


@pytest.fixture(scope="session")
def md3_cases():
    with open(os.path.join(MD3_FIXTURE_DIR, "cases.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def md3_arrays():
    return dict(np.load(os.path.join(MD3_FIXTURE_DIR, "cases.npz")))


@pytest.fixture(scope="session")
def md3_ckpt(tmp_path_factory):
    """The Moondream 3 fixture's HF folder converted with photon-convert (float32)."""
    from photon_jax.convert import convert

    out = tmp_path_factory.mktemp("ckpt") / "md3-tiny-f32"
    convert(MD3_FIXTURE_DIR, str(out), dtype="float32", log=lambda s: None)
    return str(out)


def biased_model(ckpt: str, biases: dict):
    """The checkpoint's model with `biases` ({token id: value}) added to the LM head's bias:
    random weights rarely emit EOS, coordinates or grounding ids on their own."""
    import jax

    from photon_jax.model import Model

    base = Model.load(ckpt)
    params = jax.tree.map(lambda x: x, base.params)
    head = dict(params["text"]["lm_head"])
    for tok, val in biases.items():
        head["b"] = head["b"].at[tok].add(val)
    params["text"] = {**params["text"], "lm_head": head}
    return Model(base.cfg, params, base.prompts.tok, device=base.device)
