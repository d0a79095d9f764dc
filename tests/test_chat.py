"""Chat: conversations rendered token for token as kestrel 0.9.2 renders them (golden prompts
made by kestrel's own code, tests/kestrel_chat_golden.py), its refusals, and `Moondream.chat`
on the engine against the one-request reference path."""

import asyncio
import base64
import json
import os

import pytest

from photon_jax import Moondream
from photon_jax.api import ChatError, RequestError
from photon_jax.engine import reference
from photon_jax.engine.settings import Settings
from photon_jax.model.chat import parse_messages, render
from tokenizers import Tokenizer

from helpers import HERE, LAND, SQ

CHAT_DIR = os.path.join(HERE, "fixtures", "chat")
with open(os.path.join(CHAT_DIR, "kestrel_chat.json")) as f:
    GOLDEN = json.load(f)
BYTE_TOK = Tokenizer.from_file(os.path.join(CHAT_DIR, "tokenizer.json"))
QUERY_PREFIX = (1, 15381, 2)
G = {"temperature": 0, "max_tokens": 6}


def _marker(part, where):
    return "IMG"


def _ours(msgs, family, reasoning):
    c = render(parse_messages(msgs, _marker), family=family, query_prefix=QUERY_PREFIX,
               encode=lambda s: BYTE_TOK.encode(s).ids, reasoning=reasoning)
    seq = list(c.ids)
    for at in reversed(c.image_at):
        seq.insert(at, "image")
    return [0] + seq


@pytest.mark.parametrize("family", ["moondream2", "moondream3"])
def test_rendering_matches_kestrel(family):
    fam = GOLDEN["families"][family]
    assert fam["default_reasoning"] is True
    for key, want in fam["prompts"].items():
        name, mode = key.split("/")
        assert _ours(GOLDEN["cases"][name], family, mode == "reasoning") == want, key


def test_refusals_match_kestrel():
    for family in ("moondream2", "moondream3"):
        for name, err in GOLDEN["families"][family]["errors"].items():
            assert err is not None, name   # kestrel refuses every one of these
            with pytest.raises(ChatError):
                parse_messages(GOLDEN["error_cases"][name], _marker)
    with pytest.raises(ChatError, match=r"messages\[0\]\.content\[0\]: an image_url must be"):
        Moondream._chat.__globals__["_chat_image"](
            {"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "messages[0].content[0]")


@pytest.fixture(scope="module")
def md(tiny_ckpt):
    with Moondream.load(tiny_ckpt, max_batch_size=4) as m:
        yield m


def test_one_turn_moondream2_chat_is_the_query_prompt(md):
    m = md._m
    for reasoning in (False, True):
        turns = parse_messages([{"role": "user", "content": [
            {"type": "image", "image": LAND}, {"type": "text", "text": "w5 w6"}]}], lambda p, w: p)
        c = render(turns, family="moondream2", query_prefix=m.cfg.tokenizer.query_prefix,
                   encode=m.prompts.encode, reasoning=reasoning)
        assert c.ids == m.prompts.query("w5 w6", reasoning=reasoning) and c.image_at == (0,)
    one = [{"role": "user", "content": [{"type": "image", "image": LAND},
                                        {"type": "text", "text": "w5 w6"}]}]
    assert md.chat(one, reasoning=False, settings=G)["message"]["content"] == \
        md.query(LAND, "w5 w6", settings=G)["answer"]
    out = md.chat(one, settings=G)   # reasoning on by default, as kestrel's chat
    q = md.query(LAND, "w5 w6", reasoning=True, settings=G)
    assert out["message"]["content"] == q["answer"]
    assert out["message"]["reasoning"] == q["reasoning"]["text"]
    assert set(out) == {"message", "finish_reason"}
    text_only = [{"role": "user", "content": "w100 w200"}]
    assert md.chat(text_only, reasoning=False, settings=G)["message"]["content"] == \
        md.query(None, "w100 w200", settings=G)["answer"]


def test_conversation_matches_the_reference_and_reuses_the_image(md):
    m = md._m
    png = open(SQ, "rb").read()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    convo = [{"role": "system", "content": "w40 w41"},
             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "w5 w6"}]},
             {"role": "assistant", "content": "w7 w8 w9"},
             {"role": "user", "content": [{"type": "text", "text": "w10"},
                                          {"type": "text", "text": " w11"}]}]
    s = {"temperature": 0.7, "top_p": 0.9, "seed": 5, "max_tokens": 8}
    out = md.chat(convo, reasoning=False, settings=s, return_metrics=True)
    c = render(parse_messages(convo, lambda p, w: p), family="moondream2",
               query_prefix=m.cfg.tokenizer.query_prefix, encode=m.prompts.encode,
               reasoning=False)
    # The system text is folded into the first user turn, text parts joined with "".
    assert m.prompts.encode("w40 w41\n\nw5 w6") == c.ids[3:3 + len(m.prompts.encode(
        "w40 w41\n\nw5 w6"))]
    want = reference.generate_text(m, reference.encode_image(m, png), c.ids,
                                   Settings(temperature=0.7, top_p=0.9, seed=5, max_tokens=8))
    assert out["message"]["content"] == want["text"]
    assert out["finish_reason"] == want["finish_reason"]
    assert out["metrics"]["input_tokens"] == m.cfg.prefix_len + len(c.ids)
    # The follow-up turn: the image prefix comes from the cache.
    follow = convo + [{"role": "assistant", "content": out["message"]["content"]},
                      {"role": "user", "content": "w12"}]
    again = md.chat(follow, reasoning=False, settings=s, return_metrics=True)
    assert again["metrics"]["prefix_cache_hit"] is True


def test_refused_conversations_name_the_fix(md):
    img = {"type": "image", "image": LAND}
    # Three images take 730 + 2 x 729 positions, past the fixture's context of 2048.
    with pytest.raises(RequestError, match="exceeds the context"):
        md.chat([{"role": "user", "content": [img, img, img, {"type": "text", "text": "w5"}]}])
    enc = md.encode_image(SQ)   # fine at the start; after it, refused by name
    assert md.chat(_convo(([enc], "w5")), reasoning=False, settings=G)
    with pytest.raises(RequestError, match="EncodedImage .*pass the image itself"):
        md.chat(_convo(([LAND], "w5"), ([enc], "w6")), reasoning=False, settings=G)
    enc.release()
    # An unreadable image in a later turn (prepared on a worker) fails its request alone.
    with pytest.raises(ValueError, match="image"):
        md.chat(_convo(([LAND], "w5"), ([b"not an image" * 10], "w6")), reasoning=False,
                settings=G)
    with pytest.raises(ChatError, match="last message must be from the user"):
        md.chat([{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}])
    with pytest.raises(ValueError, match="reasoning must be"):
        md.chat([{"role": "user", "content": "w5"}], reasoning="yes")
    long = [{"role": "user", "content": " ".join(["w50"] * md.engine.max_context)}]
    with pytest.raises(RequestError, match="exceeds the context"):
        md.chat(long, reasoning=False)
    # ...and the engine still answers.
    assert md.chat([{"role": "user", "content": "w5"}], reasoning=False, settings=G)


def test_stream_deltas_and_async(md):
    convo = [{"role": "user", "content": [{"type": "image", "image": LAND},
                                          {"type": "text", "text": "w9"}]}]
    whole = md.chat(convo, settings=G)
    deltas = list(md.chat(convo, stream=True, settings=G))
    assert "reasoning" in deltas[0]
    assert deltas[0]["reasoning"] == whole["message"]["reasoning"]
    assert "".join(d.get("content", "") for d in deltas[1:-1]) == whole["message"]["content"]
    assert deltas[-1] == {"finish_reason": whole["finish_reason"]}

    async def run():
        out = await md.achat(convo, settings=G)
        pieces = [d async for d in await md.achat(convo, stream=True, settings=G)]
        return out, pieces

    out, pieces = asyncio.run(run())
    assert out == whole and pieces == deltas


def _text_skill(stop, on_text=None):
    from photon_jax.engine.skills import TextSkill

    words = {i: w for i, w in enumerate(["<eos>", "Hello", " wor", "ld", ".", " Bye", "\n",
                                         " STOP", "!"])}
    return TextSkill(max_tokens=50, prompt_end=10, max_context=100, eos_id=0,
                     decode=lambda ids: "".join(words[i] for i in ids), on_text=on_text,
                     stop=stop)


def test_stop_strings_cut_the_answer_and_never_reach_the_stream():
    for stop, ids, want, reason in (
            (("world",), [1, 2, 3], "Hello ", "stop"),            # across tokens
            (("d.",), [1, 2, 3, 4], "Hello worl", "stop"),
            (("Hello",), [1], "", "stop"),                        # at the first token
            (("xyz", " STOP"), [1, 6, 7], "Hello\n", "stop"),     # after a newline
            (("nowhere",), [1, 2, 3, 0], "Hello world", None)):   # never: EOS ends it
        pieces = []
        sk = _text_skill(stop, pieces.append)
        reasons = [sk.consume(t, None) for t in ids]
        end = next((r for r in reasons if r), None)
        assert end == (reason or "stop"), (stop, reasons)
        assert reasons.index(end) == len(ids) - 1   # it ended at the token that completed it
        out = sk.result(end)
        assert out["text"] == want and "".join(pieces) == want, (stop, out, pieces)
    from photon_jax.engine.settings import SettingsError, parse
    assert parse({"stop": "x"}).stop == ("x",) and parse({"stop": ["a", "b"]}).stop == ("a", "b")
    for bad in ("", [], ["a"] * 5, [1]):
        with pytest.raises(SettingsError, match="stop"):
            parse({"stop": bad})


def test_stop_on_the_engine(md):
    convo = [{"role": "user", "content": [{"type": "image", "image": LAND},
                                          {"type": "text", "text": "w9"}]}]
    s = {"temperature": 0, "max_tokens": 12}
    full = md.chat(convo, reasoning=False, settings=s)["message"]["content"]
    words = full.split(" ")
    assert len(words) >= 4, full
    cut = md.chat(convo, reasoning=False, settings={**s, "stop": [" " + words[2]]})
    assert cut["message"]["content"] == " ".join(words[:2])
    assert cut["finish_reason"] == "stop"
    streamed = list(md.chat(convo, reasoning=False, stream=True,
                            settings={**s, "stop": " " + words[2]}))
    assert "".join(d.get("content", "") for d in streamed) == " ".join(words[:2])


def test_moondream3_chat_uses_kestrels_openers(md3_ckpt):
    """Moondream 3's chat ends its prompt with kestrel's [3] (answer) / [4] (reasoning), not
    `query`'s doubled [3, 3], and runs on the engine: the result is the engine's answer to
    exactly that prompt."""
    from photon_jax.engine.request import Request

    with Moondream.load(md3_ckpt, max_batch_size=4) as md3:
        m = md3._m
        convo = [{"role": "system", "content": "w40"},
                 {"role": "user", "content": [{"type": "image", "image": SQ},
                                              {"type": "text", "text": "w5 w6"}]}]
        ids = {}
        for reasoning in (False, True):
            ids[reasoning] = render(parse_messages(convo, lambda p, w: p), family="moondream3",
                                    query_prefix=m.cfg.tokenizer.query_prefix,
                                    encode=m.prompts.encode, reasoning=reasoning).ids
        text = m.prompts.encode("w40\n\nw5 w6")
        assert ids[False] == list(m.cfg.tokenizer.query_prefix) + text + [3]
        assert ids[True] == list(m.cfg.tokenizer.query_prefix) + text + [4]
        assert m.prompts.query("w5 w6")[-2:] == [3, 3]   # query keeps the reference's
        out = md3.chat(convo, reasoning=False, settings=G, return_metrics=True)
        want = md3.engine.submit(Request("text", ids[False], SQ,
                                         Settings(temperature=0, max_tokens=6))).result()
        assert out["message"]["content"] == want["text"]
        assert out["metrics"]["input_tokens"] == m.cfg.prefix_len + len(ids[False])


# -- log-probabilities ----------------------------------------------------------------------

def _reference_logprobs(m, image, prompt, ids):
    """log_softmax of the one-request path's logits at each answer position, the answer's
    ids fed back (teacher-forced): [len(ids), V]."""
    import jax
    import numpy as np
    from photon_jax.model.config import KIND_TOKEN

    sess = reference._Session(m, reference.encode_image(m, image))
    _, _, lg = sess.prefill(prompt)
    out = []
    for t in ids:
        out.append(np.asarray(jax.nn.log_softmax(np.asarray(lg[0], np.float32))))
        _, lg = sess.decode(KIND_TOKEN, t)
    return np.stack(out)


def test_logprobs_are_the_models_own_and_ride_with_the_answer(md):
    """Each answer token's entry: its log-probability and the k most likely ids at its
    position, equal to the one-request path's log_softmax (teacher-forced); greedy and
    sampled answers alike, and unchanged answers beside them."""
    import numpy as np

    m = md._m
    for s in ({"temperature": 0, "max_tokens": 8},
              {"temperature": 1.0, "seed": 5, "max_tokens": 8}):
        plain = md.query(LAND, "w9", settings=s)
        r = md.query(LAND, "w9", settings={**s, "logprobs": 3})
        assert r["answer"] == plain["answer"] and "logprobs" not in plain
        ids = [e["id"] for e in r["logprobs"]]
        assert len(ids) == len(r["logprobs"]) >= 4
        assert m.prompts.decode(ids) == r["answer"]
        want = _reference_logprobs(m, LAND, m.prompts.query("w9"), ids)
        for e, lp in zip(r["logprobs"], want):
            assert abs(e["logprob"] - lp[e["id"]]) < 2e-4, (e, lp[e["id"]])
            best = np.argsort(-lp)[:3]
            assert [t["id"] for t in e["top_logprobs"]] == best.tolist()
            assert np.allclose([t["logprob"] for t in e["top_logprobs"]], lp[best], atol=2e-4)
            assert e["bytes"] == list(m.prompts.token_bytes(e["id"]))
            assert e["token"] == bytes(e["bytes"]).decode("utf-8", errors="replace")
    # logprobs=True (0 alternatives), and a stream: its deltas carry the same entries.
    convo = [{"role": "user", "content": [{"type": "image", "image": LAND},
                                          {"type": "text", "text": "w9"}]}]
    s = {"temperature": 0, "max_tokens": 8, "logprobs": True}
    whole = md.chat(convo, reasoning=False, settings=s)
    assert whole["logprobs"] and all(e["top_logprobs"] == [] for e in whole["logprobs"])
    deltas = list(md.chat(convo, reasoning=False, stream=True, settings=s))
    assert [e for d in deltas for e in d["logprobs"]] == whole["logprobs"]
    assert "".join(d.get("content", "") for d in deltas) == whole["message"]["content"]


def test_logprob_rows_beside_plain_rows_in_one_batch(md):
    """A step whose rows differ (some ask for log-probabilities, some not) gives each row
    what it gets alone."""
    import numpy as np
    from photon_jax.engine.request import Request
    from photon_jax.engine.settings import parse

    m = md._m
    prompts = [m.prompts.query("w9"), m.prompts.query("w5 w6"), m.prompts.caption("short")]
    kinds = [{"logprobs": 2, "seed": 1}, {"seed": 2}, {"logprobs": 0, "seed": 3}]
    base = {"temperature": 1.0, "max_tokens": 6}
    alone = [md.engine.submit(Request("text", p, LAND, parse({**base, **k}))).result()
             for p, k in zip(prompts, kinds)]
    together = [h.result() for h in md.engine.submit_many(
        [Request("text", p, LAND, parse({**base, **k})) for p, k in zip(prompts, kinds)])]

    def split(r):   # (the result without values, the values)
        r = json.loads(json.dumps(r))
        values = [[e.pop("logprob")] + [t.pop("logprob") for t in e["top_logprobs"]]
                  for e in r.get("logprobs", [])]
        return r, values

    # The same answers and entries; the values to float32 noise (a batch of 4 rows runs
    # another compiled program than a batch of 1).
    for a, b in zip(together, alone):
        (ra, va), (rb, vb) = split(a), split(b)
        assert ra == rb
        assert len(va) == len(vb) and all(np.allclose(x, y, atol=1e-5) for x, y in zip(va, vb))
    assert "logprobs" not in alone[1] and len({r["text"] for r in alone}) == 3
    for r, k in ((alone[0], 3), (alone[2], 1)):   # own + alternatives, per answer token
        assert [len(v) for v in split(r)[1]] == [k] * len(r["ids"]) and r["ids"]


def test_logprobs_settings_refused_by_name(md):
    from photon_jax.engine.settings import SettingsError, parse

    assert parse({"logprobs": True}).logprobs == 0 and parse({"logprobs": False}).logprobs is None
    assert parse({"logprobs": 0}).logprobs == 0
    assert parse({"logprobs": 20}).logprobs == 20
    for bad in (21, -1, "5", 2.5):
        with pytest.raises(SettingsError, match="logprobs"):
            parse({"logprobs": bad})
    with pytest.raises(RequestError, match="logprobs.*drop the setting"):
        md.detect(LAND, "w3", settings={"logprobs": 2})


def test_token_bytes_of_a_byte_level_tokenizer_rebuild_the_text():
    """Byte-level BPE tokens can hold part of a UTF-8 character: their bytes, not their
    decoded text, add up to the answer."""
    from photon_jax.model.tokenizer import Prompts

    p = Prompts(BYTE_TOK, None)
    text = " héllo wörld 😀 ¬"
    ids = BYTE_TOK.encode(text).ids
    assert b"".join(p.token_bytes(i) for i in ids) == text.encode()
    assert any(BYTE_TOK.decode([i]) == "\ufffd" for i in ids)   # a split character


# -- several images: image blocks anywhere in a conversation --------------------------------

def test_the_block_mask_is_kestrels(md):
    """`attention_mask` with image blocks equals kestrel's rule, written from its block ids:
    a key is visible from a query at or after it, or in the same image block; BOS joins the
    first block when the image follows it (the image prefix)."""
    import numpy as np
    from photon_jax.model.layers import attention_mask

    rng = np.random.default_rng(0)
    for _ in range(40):
        n, z = int(rng.integers(6, 40)), int(rng.integers(1, 6))
        ids, t = [-1], 1                     # BOS, then text and blocks of z positions
        front = bool(rng.integers(2))
        nb = 0
        while t + z < n:
            if (t == 1 and front) or rng.random() < 0.2:
                ids += [nb] * z
                nb, t = nb + 1, t + z
            else:
                ids.append(-1)
                t += 1
        ids += [-1] * (n - len(ids))
        if ids[1] >= 0:
            ids[0] = ids[1]                  # kestrel: BOS joins the first block
        ids = np.asarray(ids)
        want = (np.arange(n)[None] <= np.arange(n)[:, None]) | (
            (ids[:, None] == ids[None]) & (ids[:, None] >= 0))
        # Ours: the front block is the image prefix (1 + z positions), the others `vis`.
        # Built at one padded length (one compile; a query's row depends on its own
        # position and block end only), compared on the first n positions.
        prefix = 1 + z if ids[0] >= 0 else 0
        pos = np.arange(40)
        vis = pos.copy()
        for b in np.unique(ids[ids >= 0]):
            where = np.flatnonzero(ids == b)
            if where[0] >= prefix:
                vis[where] = where[-1]
        got = attention_mask(pos[None], np.asarray([prefix]), 40, vis[None])[0]
        assert (np.asarray(got)[:n, :n] == want).all(), ids


def _convo(*turns):
    """[(image or None, ...), text] per user turn, with an assistant reply between."""
    msgs = []
    for i, (images, text) in enumerate(turns):
        if i:
            msgs.append({"role": "assistant", "content": f"w{40 + i} w{50 + i}"})
        msgs.append({"role": "user", "content": [{"type": "image", "image": x} for x in images]
                     + [{"type": "text", "text": text}]})
    return msgs


def _reference_chat(md, convo, settings):
    """The one-request path on the same rendering: the image prefix, then the prompt with
    its image blocks."""
    from photon_jax.api import _chat_image, _chat_prompt
    from photon_jax.engine.settings import parse

    m = md._m
    c = render(parse_messages(convo, _chat_image), family=m.cfg.family,
               query_prefix=m.cfg.tokenizer.query_prefix, encode=m.prompts.encode,
               reasoning=False)
    image, prompt, blocks = _chat_prompt(m, c)
    enc = None if image is None else reference.encode_image(m, image)
    return reference.generate_text(m, enc, prompt, parse(settings), blocks=blocks), c


def test_several_images_equal_the_one_request_path(md):
    """Images in later turns, an image after a text-only turn, and two images side by side
    (two blocks, not one) answer as the one-request path does, greedy (and sampled, n = 2)."""
    from photon_jax.model.chat import parse_messages as pm

    cases = [_convo(([LAND], "w9"), ([SQ], "w5")),            # front + a later turn
             _convo(((), "w3 w4"), ([SQ], "w5")),              # the first image in turn 2
             _convo(([SQ, LAND], "w7"))]                       # two blocks side by side
    sampled = {"temperature": 1.0, "seed": 4, "max_tokens": 6}
    for convo, s in [(c, G) for c in cases] + [(cases[2], sampled)]:
        got = md.chat(convo, reasoning=False, settings=s)
        want, c = _reference_chat(md, convo, s)
        assert got["message"]["content"] == want["text"], (convo, s)
        assert len(c.images) == sum(len(t.images) for t in pm(convo, _marker))
    # Another place for the block, the same prompt bucket and image count: no new compile
    # (the layout is data, not shape).
    from photon_jax.engine import step

    prefill = step.programs_of(md._m).prefill_slot
    compiled = prefill._cache_size()
    convo = _convo(([LAND], "w9 w8 w7 w6 w5"), ([SQ], "w5"))
    assert md.chat(convo, reasoning=False, settings=G)["message"]["content"] == \
        _reference_chat(md, convo, G)[0]["text"]
    assert prefill._cache_size() == compiled
    # n answers of one conversation prefill together and share the images' embeddings.
    s = {"temperature": 1.0, "seed": 4, "max_tokens": 6}
    both = md._chat(cases[0], False, False, s, False, 2).wait()
    assert [r["message"]["content"] for r in both] == [
        _reference_chat(md, cases[0], {**s, "seed": 4 + i})[0]["text"] for i in range(2)]
    # The blocks matter: swapping the two side-by-side images changes the answer, and so
    # does another image in turn 2.
    a = md.chat(_convo(([SQ, LAND], "w7")), reasoning=False, settings=G)
    b = md.chat(_convo(([LAND, SQ], "w7")), reasoning=False, settings=G)
    c = md.chat(_convo(([LAND], "w9"), ([LAND], "w5")), reasoning=False, settings=G)
    d = md.chat(_convo(([LAND], "w9"), ([SQ], "w5")), reasoning=False, settings=G)
    assert a != b and c != d


def test_follow_ups_with_images_read_the_cache_and_never_another_images_pages(md):
    """A follow-up that sends the history back prefills only its new tokens, its images'
    blocks included; a conversation that differs only in its second image reads no page
    that holds that image."""
    m, z = md._m, md._m.cfg.prefix_len - 1
    s = {"temperature": 0, "max_tokens": 4}
    first = _convo(([LAND], "w9"), ([SQ], "w5"))
    r1 = md.chat(first, reasoning=False, settings=s, return_metrics=True)
    follow = first + [{"role": "assistant", "content": r1["message"]["content"]},
                      {"role": "user", "content": "w6"}]
    r2 = md.chat(follow, reasoning=False, settings=s, return_metrics=True)
    assert r2["message"]["content"] == _reference_chat(md, follow, s)[0]["text"]
    # Everything up to the last full page of turn 2's prompt came from the caches.
    page = md.engine.page_size
    assert r2["metrics"]["cached_tokens"] >= (r1["metrics"]["input_tokens"] // page) * page
    other = _convo(([LAND], "w9"), ([md_other_image()], "w5"))
    r3 = md.chat(other, reasoning=False, settings=s, return_metrics=True)
    want, c = _reference_chat(md, other, s)
    assert r3["message"]["content"] == want["text"]
    # The second image's block starts after the prefix and turn 1's tokens: the cache gave
    # nothing from the page that holds its start on (the first conversation's pages there
    # hold SQ's block), and without that image in the keys it would have.
    start = m.cfg.prefix_len + c.image_at[1]
    assert r3["metrics"]["cached_tokens"] <= max(m.cfg.prefix_len, start // page * page)
    r4 = md.chat(first, reasoning=False, settings=s, return_metrics=True)
    assert r4["metrics"]["cached_tokens"] >= start + z - page   # its own pages: read


def md_other_image():
    import numpy as np

    return (np.arange(300 * 200 * 3) % 251).astype(np.uint8).reshape(200, 300, 3)


def test_three_images_past_moondream_2s_context(md):
    """Three images (a prefix and two blocks, 2,188 positions) need more than Moondream 2's
    2,048 positions of context; with a longer one (the random weights do not mind where the
    rotary positions end) they answer as the one-request path does."""
    from dataclasses import replace

    from photon_jax.engine.core import Engine
    from photon_jax.model import Model

    m = md._m
    cfg = replace(m.cfg, text=replace(m.cfg.text, max_context=3072))
    model = Model(cfg, m.params, m.prompts.tok, device=m.device)
    long = Moondream(model, Engine(model, max_batch_size=2, kv_cache_tokens=3 * 3072))
    try:
        convo = _convo(([LAND, SQ], "w7"), ((), "w8"), ([md_other_image()], "w9"))
        for s in (G, {"temperature": 1.0, "seed": 2, "max_tokens": 6}):
            got = long.chat(convo, reasoning=False, settings=s, return_metrics=True)
            want, c = _reference_chat(long, convo, s)
            assert got["message"]["content"] == want["text"] and len(c.images) == 3
            assert got["metrics"]["input_tokens"] == 1 + len(c.ids) + 3 * (cfg.prefix_len - 1)
    finally:
        long.engine.close()


@pytest.mark.parametrize("attention", ["pallas-interpret", "pallas-tpu-interpret"])
def test_two_images_on_the_gpu_and_tpu_decode_kernels(md, attention):
    """A pool written by a two-image prefill (the front image and a block in a later turn),
    decoded by the GPU and the TPU decode kernels (interpreted): the default attention's
    answers, greedy and sampled.  Decode attention is causal whatever the blocks, so what
    is checked is that the kernels read such a pool (pages past the blocks, the TPU's
    packed layout) as the default attention does."""
    from photon_jax.engine.core import Engine
    from photon_jax.model import Model

    base = md._m
    m = Model(base.cfg, base.params, base.prompts.tok, attention=attention)
    convo = _convo(([LAND], "w9"), ([SQ], "w5"))
    settings = [G, {"temperature": 1.0, "seed": 4, "max_tokens": 6}]
    want = [md.chat(convo, reasoning=False, settings=s)["message"]["content"] for s in settings]
    kernel = Moondream(m, Engine(m, max_batch_size=2))
    try:
        got = [kernel.chat(convo, reasoning=False, settings=s)["message"]["content"]
               for s in settings]
    finally:
        kernel.engine.close()   # (Moondream.close would free the weights md shares)
    assert got == want and all(got)
