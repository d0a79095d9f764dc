"""The asyncio surface (`Moondream.a*`, `photon_jax.aio`) on the fixture model: many
concurrent tasks share the batch and get the sync API's answers, streams join to the same
text, cancelling a task cancels its request; and the thread-safety of PIL inputs (threads
sharing one lazily opened image)."""

import asyncio
import os

import pytest
from PIL import Image

from photon_jax import Moondream

from helpers import FIXTURE_DIR, in_threads

LAND = os.path.join(FIXTURE_DIR, "img_land800x600.png")
SQ = os.path.join(FIXTURE_DIR, "img_sq378.png")
GREEDY = {"temperature": 0, "max_tokens": 10}
OBJ = {"max_objects": 3}


@pytest.fixture(scope="module")
def md(tiny_ckpt):
    with Moondream.load(tiny_ckpt, max_batch_size=8) as m:
        yield m


def _sync_expected(md):
    return {
        "caption": md.caption(LAND, "short", settings=GREEDY),
        "query": md.query(SQ, "What is this?", settings=GREEDY),
        "reason": md.query(LAND, "Why?", reasoning=True, settings=GREEDY),
        "detect": md.detect(LAND, "w42", settings=OBJ),
        "point": md.point(SQ, "w42", settings=OBJ),
    }


def test_many_concurrent_tasks_equal_the_sync_api(md):
    want = _sync_expected(md)
    calls = {
        "caption": lambda: md.acaption(LAND, "short", settings=GREEDY),
        "query": lambda: md.aquery(SQ, "What is this?", settings=GREEDY),
        "reason": lambda: md.aquery(LAND, "Why?", reasoning=True, settings=GREEDY),
        "detect": lambda: md.adetect(LAND, "w42", settings=OBJ),
        "point": lambda: md.apoint(SQ, "w42", settings=OBJ),
    }
    kinds = [list(calls)[i % len(calls)] for i in range(32)]

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(calls[k]() for k in kinds)), timeout=240)

    outs = asyncio.run(main())
    for kind, out in zip(kinds, outs):
        assert out == want[kind], kind
    # Lists and metrics work the same way.
    async def lists():
        return (await md.acaption([LAND, SQ], "short", settings=GREEDY),
                await md.aquery(LAND, "Why?", settings=GREEDY, return_metrics=True))
    lst, met = asyncio.run(lists())
    assert lst == md.caption([LAND, SQ], "short", settings=GREEDY)
    assert met["metrics"]["output_tokens"] >= 1 and "answer" in met


def test_async_stream_joins_to_the_same_text(md):
    want = md.caption(LAND, "normal", settings=GREEDY)["caption"]
    want_r = md.query(LAND, "Why?", reasoning=True, settings=GREEDY)

    async def main():
        out = await md.acaption(LAND, "normal", stream=True, settings=GREEDY)
        pieces = [p async for p in out["caption"]]
        r = await md.aquery(LAND, "Why?", reasoning=True, stream=True, settings=GREEDY)
        answer = "".join([p async for p in r["answer"]])
        return pieces, r["reasoning"], answer

    pieces, reasoning, answer = asyncio.run(main())
    assert "".join(pieces) == want
    assert {"reasoning": reasoning, "answer": answer} == want_r


def test_cancelling_a_task_or_closing_a_stream_cancels_the_request(md):
    # High temperature: the random fixture model rarely samples EOS (greedy stops in ~15
    # tokens); a burnt 20 ms per commit (the engine's benchmark knob) keeps it running.
    long = {"temperature": 50, "top_p": 1, "max_tokens": 1000}
    seen = []
    real = md.engine.submit_many

    def spy(reqs):
        hs = real(reqs)
        seen.extend(hs)
        return hs

    async def main():
        task = asyncio.ensure_future(md.acaption(LAND, "long", settings=long))
        await asyncio.sleep(0)   # submitted, then cancelled while it waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        out = await md.acaption(SQ, "long", stream=True, settings=long)
        agen = out["caption"]
        await asyncio.wait_for(agen.__anext__(), 60)   # one piece, then walk away
        await agen.aclose()

    md.engine.submit_many = spy
    md.engine.host_work_s = 0.02
    try:
        asyncio.run(main())
    finally:
        del md.engine.submit_many
        md.engine.host_work_s = 0.0
    assert len(seen) == 2
    for h in seen:
        r = h.result(timeout=60)
        assert r["finish_reason"] == "cancelled" and r["output_tokens"] < 1000
    # The rows came back and the next call answers normally.
    assert md.caption(LAND, "short", settings=GREEDY) == _sync_expected(md)["caption"]
    assert not md.engine.sched.running


def test_threads_sharing_one_lazily_opened_pil_image(md):
    # Image.open is lazy: the pixels are decoded on first access, and PIL's loader is not
    # thread-safe.  Each call must take its own copy on its own thread, under a lock.
    want = md.caption(LAND, "short", settings=GREEDY)
    for _ in range(3):
        img = Image.open(LAND)
        assert img.tile   # not decoded yet (lazy)
        assert in_threads(lambda: md.caption(img, "short", settings=GREEDY), 8) == [want] * 8


def test_pil_image_may_be_closed_or_changed_after_submit(md):
    want = md.caption(LAND, "short", settings=GREEDY)
    img = Image.open(LAND)
    out = md.caption(img, "short", stream=True, settings=GREEDY)   # submitted, not finished
    img.close()
    assert {"caption": "".join(out["caption"])} == want
    img = Image.open(LAND).convert("RGB")
    h = md.start(img, length="short", settings=GREEDY)
    img.paste((0, 0, 0), (0, 0, img.width, img.height))   # the request owns its copy
    assert h.result(timeout=120)["text"] == want["caption"]
