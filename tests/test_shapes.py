"""Answers held to a shape (settings json_schema / regex / choices): every sampled answer is
inside its shape, the masked sampler leaves unshaped rows of the same step alone, pipelined
== blocking, and bad shapes are refused by name at submit.

The model is the tiny fixture with a byte-level tokenizer (tests/fixtures/chat): shapes are
defined over token bytes, which the fixture's word-level stand-in has not."""

import json
import os
import re

import jsonschema
import pytest
from tokenizers import Tokenizer

from photon_jax import Moondream
from photon_jax.api import RequestError, SettingsError
from photon_jax.engine.core import Engine
from photon_jax.engine.request import Request
from photon_jax.engine.settings import Settings, parse
from photon_jax.model import Model

from helpers import HERE, LAND, SQ

SCHEMA = {"type": "object",
          "properties": {"indoor": {"type": "boolean"},
                         "animal": {"enum": ["cat", "dog", "bird"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["indoor", "animal", "count"], "additionalProperties": False}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"indoor", "animal", "count"}
            and isinstance(obj["indoor"], bool) and obj["animal"] in ("cat", "dog", "bird")
            and isinstance(obj["count"], int) and 0 <= obj["count"] <= 9)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    base = Model.load(tiny_ckpt)
    tok = Tokenizer.from_file(os.path.join(HERE, "fixtures", "chat", "tokenizer.json"))
    return Model(base.cfg, base.params, tok, device=base.device)


@pytest.fixture(scope="module")
def engines(model):
    pipe, block = (Engine(model, max_batch_size=4, pipelined=p) for p in (True, False))
    yield pipe, block
    pipe.close()
    block.close()


def _requests(model):
    """A mixed batch: shaped and unshaped rows, greedy and sampled, with and without images."""
    q = model.prompts.query
    bos = [model.cfg.tokenizer.bos_id]
    hot = dict(temperature=1.0, top_p=0.95, max_tokens=40)
    return [Request("text", q("Is it indoor?"), LAND,
                    Settings(seed=1, shape=parse({"json_schema": SCHEMA}).shape, **hot)),
            Request("text", q("cat or dog?"), SQ,
                    Settings(seed=2, shape=parse({"choices": ["cat", "dog", "no"]}).shape, **hot)),
            Request("text", bos + q("What colour?"), None,
                    Settings(seed=3, shape=parse({"regex": "[a-f]{2}-[0-9]+"}).shape, **hot)),
            Request("text", q("What colour?"), LAND, Settings(temperature=0, max_tokens=8)),
            Request("text", q("Is it indoor?"), SQ,
                    Settings(seed=4, shape=parse({"json_schema": SCHEMA}).shape, **hot),
                    reasoning=True)]


def test_answers_stay_in_their_shape_pipelined_equals_blocking(model, engines):
    pipe, block = engines
    outs = {}
    for name, eng in (("pipelined", pipe), ("blocking", block)):
        outs[name] = [h.result(timeout=300) for h in eng.submit_many(_requests(model))]
    a = outs["pipelined"]
    assert [o["ids"] for o in a] == [o["ids"] for o in outs["blocking"]]
    assert _valid(json.loads(a[0]["text"])) and a[0]["finish_reason"] == "stop"
    assert a[1]["text"] in ("cat", "dog", "no") and a[1]["finish_reason"] == "stop"
    assert re.fullmatch(r"[a-f]{2}-[0-9]+", a[2]["text"]), a[2]["text"]
    assert _valid(json.loads(a[4]["text"]))   # shaped answer after free reasoning
    # The unshaped row of the shaped steps is what it is alone.
    alone = pipe.submit(_requests(model)[3]).result(timeout=300)
    assert a[3]["ids"] == alone["ids"]


def test_many_samples_all_valid(model, engines):
    pipe, _ = engines
    reqs = [Request("text", model.prompts.query("Is it indoor?"), LAND,
                    Settings(temperature=1.0, top_p=1.0, seed=s, max_tokens=40,
                             shape=parse({"json_schema": SCHEMA}).shape)) for s in range(8)]
    outs = [h.result(timeout=300) for h in pipe.submit_many(reqs)]
    objs = [json.loads(o["text"]) for o in outs]
    assert all(_valid(o) for o in objs)
    assert len({json.dumps(o, sort_keys=True) for o in objs}) > 1   # sampled, not forced
    # Without the shape, the same requests are not JSON.
    free = [h.result(timeout=300) for h in pipe.submit_many(
        [Request("text", r.prompt, r.image, Settings(temperature=1.0, top_p=1.0, seed=i,
                                                     max_tokens=40))
         for i, r in enumerate(reqs)])]
    assert not any(_parses(o["text"]) for o in free)


# Nesting, enums, arrays (of enums and of objects), anyOf with null, a top-level enum; every
# number bounded, so a random model's answers close within the budget.
SCHEMAS = [
    SCHEMA,
    {"type": "object", "additionalProperties": False, "required": ["box", "label"],
     "properties": {"box": {"type": "object", "additionalProperties": False,
                            "required": ["x", "y"],
                            "properties": {"x": {"type": "integer", "minimum": 0,
                                                 "maximum": 100},
                                           "y": {"type": "integer", "minimum": 0,
                                                 "maximum": 100}}},
                    "label": {"type": "string", "maxLength": 6}}},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["objects"],
     "properties": {"objects": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "additionalProperties": False, "required": ["name", "count"],
         "properties": {"name": {"type": "string", "maxLength": 5},
                        "count": {"type": "integer", "minimum": 1, "maximum": 5}}}}}},
    {"type": "object", "additionalProperties": False, "required": ["answer"],
     "properties": {"answer": {"anyOf": [{"type": "null"},
                                         {"type": "string", "pattern": "^[a-z]{1,5}$"}]}}},
    {"enum": ["yes", "no", 3, None]},
]


def test_every_schema_holds(model, engines):
    """Six schemas, three sampled answers each, in one batch: each parses, validates and
    ended by itself (EOS allowed only once the value is complete)."""
    pipe, _ = engines
    reqs = [Request("text", model.prompts.query("Describe it."), [LAND, SQ, None][s % 3],
                    Settings(temperature=1.0, top_p=0.9, seed=s, max_tokens=120,
                             shape=parse({"json_schema": schema}).shape))
            for schema in SCHEMAS for s in range(3)]
    for r in reqs:
        if r.image is None:
            r.prompt = [model.cfg.tokenizer.bos_id] + r.prompt
    outs = [h.result(timeout=300) for h in pipe.submit_many(reqs)]
    for i, o in enumerate(outs):
        schema = SCHEMAS[i // 3]
        assert o["finish_reason"] == "stop", (schema, o["text"])
        jsonschema.validate(json.loads(o["text"]), schema)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_bad_shapes_are_refused_by_name(model, engines, tiny_ckpt):
    pipe, _ = engines
    q = model.prompts.query("w5")
    for settings, match in (({"json_schema": {"type": 5}}, r"settings\['json_schema'\]"),
                            ({"regex": "(ab"}, r"settings\['regex'\]")):
        h = pipe.submit(Request("text", q, LAND, parse(settings)))
        with pytest.raises(RequestError, match=match):
            h.result(timeout=60)
    with pytest.raises(SettingsError, match="at most one output shape"):
        parse({"regex": "a", "choices": ["a"]})
    with pytest.raises(SettingsError, match="json_schema.*must be a JSON schema object"):
        parse({"json_schema": "{}"})
    with pytest.raises(SettingsError, match="choices"):
        parse({"choices": []})
    # Bounded before anything compiles: the spec's size, its nesting, a stop string's length.
    with pytest.raises(SettingsError, match="bytes as JSON"):
        parse({"choices": ["x" * 1000] * 100})
    deep = {}
    for _ in range(100_000):
        deep = {"items": deep}
    with pytest.raises(SettingsError, match="nested too deeply"):
        parse({"json_schema": deep})
    with pytest.raises(SettingsError, match="1 to 256 characters"):
        parse({"stop": "x" * 257})
    h = pipe.submit(Request("detect", model.prompts.detect("w5"), LAND,
                            parse({"choices": ["a"]})))
    with pytest.raises(RequestError, match="shapes a text answer"):
        h.result(timeout=60)
    # A word-level tokenizer (the fixture's) has no token bytes: refused, not guessed.
    with Moondream.load(tiny_ckpt, max_batch_size=4) as md:
        with pytest.raises(RequestError, match="byte-level tokenizer"):
            md.query(LAND, "w5", settings={"choices": ["a"]})
        assert md.query(LAND, "w5", settings={"max_tokens": 2})   # and the engine goes on
