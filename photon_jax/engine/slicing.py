"""Image prefixes computed a slice at a time between decode steps, so that a new image never
freezes the rows already decoding.

An image prefix is the vision encoder over the image's crops, then the prefill of BOS + its
patch embeddings through every text layer.  Both are bidirectional inside the image (a patch
attends every crop's patch in its encoder layer, every prefix position attends every other),
so a slice cannot be a range of positions; it is a range of layers over all positions:

- vision slices: `groups[0]` encoder blocks over all crops (the first also embeds the patches);
- text slices: `groups[1]` decoder layers over the prefix's positions (the first also pools
  and projects the encoder's features and puts BOS in front), or half a layer (0.5): its
  attention, then its MLP (Moondream's blocks are parallel: both read the same ln(x)).
  Their K/V go into a dense buffer, written into the prefix's pages after the last one.

Each layer computes what it computes in the one-program encode, from the same inputs, so the
result is the same bits (tests/test_slicing.py compares them).

Owns: `plan` (an image's slices and their costs in multiply-adds x 2), `ImageJob` (one
image's progress and the device arrays between its slices) and `SliceBudget` (how much slice
work goes between two decode launches, from the gaps the engine measures at commit).  The
engine (`core.Engine._slices`) dispatches them; the policy is in docs/slicing.md.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

from ..model import text
from ..model.config import MoondreamConfig
from .frontend import ImagePrefix



@dataclasses.dataclass(frozen=True)
class Slice:
    kind: str      # "vision" / "text" (whole layers) / "attention" / "mlp" (halves)
    first: int     # the first layer it runs
    n: int         # how many layers
    flops: float   # its estimated cost (2 x multiply-adds)
    kv_only: bool = False   # the prefix's last slice: its K/V, not its hidden (unused)


def _patches(cfg: MoondreamConfig) -> int:
    v = cfg.vision
    return (v.crop_size // v.enc_patch_size) ** 2


def vision_layer_flops(cfg: MoondreamConfig, crops: int) -> float:
    """One encoder block over `crops` crops: qkv, proj, the MLP and the attention."""
    v, z = cfg.vision, _patches(cfg)
    per_token = 2 * (4 * v.enc_dim ** 2 + 2 * v.enc_dim * v.enc_ff_dim) + 4 * z * v.enc_dim
    return float(crops * z * per_token)


def text_layer_flops(cfg: MoondreamConfig, moe: bool = False) -> float:
    """One decoder layer over the prefix's positions (an MoE layer: its routed experts)."""
    t, n = cfg.text, cfg.prefix_len
    qkv = t.dim * (t.n_heads + 2 * t.n_kv_heads) * t.head_dim
    ff = t.ff_dim
    if moe and t.moe is not None:
        ff = t.moe.experts_per_token * t.moe.expert_inner_dim
    per_token = 2 * (qkv + t.n_heads * t.head_dim * t.dim + 2 * t.dim * ff) + \
        4 * n * t.n_heads * t.head_dim
    return float(n * per_token)


def attention_share(cfg: MoondreamConfig) -> float:
    """The attention half's share of a dense decoder layer's flops over the prefix."""
    t, n = cfg.text, cfg.prefix_len
    attn = 2 * (t.dim * (t.n_heads + 2 * t.n_kv_heads) * t.head_dim +
                t.n_heads * t.head_dim * t.dim) + 4 * n * t.n_heads * t.head_dim
    return attn * n / text_layer_flops(cfg)


# Order-of-magnitude memory bandwidths (bytes/s): a decode step reads the weights once, so
# weight bytes / this is a first guess of its time, before any was measured.
_BANDWIDTH = {"cpu": 2e10, "gpu": 3e12, "tpu": 8e11}


def default_groups(cfg: MoondreamConfig, platform: str, weight_bytes: int,
                   ratio: float) -> tuple:
    """(encoder blocks, decoder layers) per slice, sized so that one slice takes about half
    the budget between two decode steps, both guessed: a step as the time to read the
    weights, slices at `default_rate` (the encoder at a third of it: its small attention
    heads run far below the peak; on this CPU the medium model's blocks ran at 45 Gflop/s
    where its decoder layers ran at 125-155).  Encoder blocks: a divisor of their count
    (every slice one program), at least 1.  Decoder layers: a divisor of the dense and MoE
    layer counts, or 0.5 (each layer in two slices, attention then MLP) when one layer
    would take longer than half the budget, as the medium model's do on a CPU.  Finer
    slices cost the host a launch each (tens of microseconds); the budget packs several
    into one gap."""
    rate = default_rate(platform)
    target = (ratio - 1) * weight_bytes / _BANDWIDTH.get(platform, 2e10) / 2
    nv = cfg.vision.enc_n_layers
    one = vision_layer_flops(cfg, cfg.vision.max_crops + 1) / (rate / 3)
    gv = max([d for d in range(1, nv + 1) if nv % d == 0 and d * one <= target], default=1)
    layer = text_layer_flops(cfg) / rate
    if layer > target:
        return gv, 0.5
    t = cfg.text
    fits = [d for d in range(1, t.n_layers + 1) if t.n_dense % d == 0 and
            t.n_moe % d == 0 and d * layer <= target]
    return gv, max(fits, default=1)


def check_groups(cfg: MoondreamConfig, groups) -> tuple:
    """`groups` as (encoder blocks, decoder layers), refused with the fix if unusable."""
    ok = isinstance(groups, (tuple, list)) and len(groups) == 2
    if ok:
        gv, gt = groups
        ok = isinstance(gv, int) and not isinstance(gv, bool) and gv >= 1 and (
            gt == 0.5 or isinstance(gt, int) and not isinstance(gt, bool) and gt >= 1)
    if not ok:
        raise ValueError(f"slice_groups must be None or (encoder blocks, decoder layers) per "
                         f"slice: a positive int and a positive int or 0.5 (half a layer), "
                         f"got {groups!r}")
    if cfg.vision.enc_n_layers % gv:
        raise ValueError(f"slice_groups: {gv} encoder blocks per slice must divide the "
                         f"encoder's {cfg.vision.enc_n_layers} blocks")
    return gv, gt


def text_kinds(cfg: MoondreamConfig) -> list[str]:
    t = cfg.text
    return ["dense"] * t.n_dense + ["moe"] * t.n_moe


def plan(cfg: MoondreamConfig, crops: int, groups: tuple) -> list[Slice]:
    """An image's slices, in order: vision groups, then decoder groups (a group never
    mixes dense and MoE layers: each group shape is one program) or, with 0.5 decoder
    layers per slice, each layer's attention half then its MLP half."""
    gv, gt = check_groups(cfg, groups)
    n = cfg.vision.enc_n_layers
    one = vision_layer_flops(cfg, crops)
    # The first also embeds the crops' patches: priced as one more block (on this CPU the
    # medium model's embedding took 5 ms, a block 6.6).
    out = [Slice("vision", a, gv, (gv + (a == 0)) * one) for a in range(0, n, gv)]
    kinds = text_kinds(cfg)
    t = cfg.text
    qkv = 2.0 * cfg.prefix_len * t.dim * (t.n_heads + 2 * t.n_kv_heads) * t.head_dim
    if gt == 0.5:
        share = attention_share(cfg)
        for i, k in enumerate(kinds[:-1]):
            f = text_layer_flops(cfg, k == "moe")
            a = share * text_layer_flops(cfg)
            out += [Slice("attention", i, 1, a), Slice("mlp", i, 1, max(f - a, 0.0))]
        # The last layer's K/V are all the prefix needs of it: its qkv projection.
        return out + [Slice("attention", len(kinds) - 1, 1, qkv, kv_only=True)]
    a = 0
    while a < len(kinds):
        b = a
        while b < len(kinds) and b - a < gt and kinds[b] == kinds[a]:
            b += 1
        out.append(Slice("text", a, b - a, (b - a) * text_layer_flops(cfg, kinds[a] == "moe")))
        a = b
    last = out[-1]   # (its last layer costs its qkv projection only)
    out[-1] = dataclasses.replace(last, kv_only=True, flops=last.flops - text_layer_flops(
        cfg, kinds[-1] == "moe") + qkv)
    return out


def rate_kind(sl: Slice) -> str:
    """The speed a slice runs at (`SliceBudget.KINDS`): a last slice's qkv projection alone
    runs as an MLP half does (dense matmuls only)."""
    return "mlp" if sl.kv_only and sl.kind == "attention" else sl.kind


class ImageJob:
    """One image prefix being computed slice by slice into its cache entry's pages.  The
    entry is pinned and marked pending (requests for the image wait) until the last slice
    wrote the pages; then the requests find it as a cache hit."""

    def __init__(self, key: bytes, entry, prep, slices: list[Slice], adapter_slot: int = 0,
                 on_done=None, seq=None):
        self.key, self.entry, self.prep, self.slices = key, entry, prep, slices
        self.adapter_slot = adapter_slot
        self.seq = seq   # the request that asked for it (its cancel drops the job)
        self.on_done = on_done   # called once the prefix is written (else: unpin the entry)
        self.next = 0
        self.x = None   # the encoder's activations between slices, then the decoder's
        self.h = None   # a decoder layer's block input ln(x), between its two halves
        self.k = self.v = None   # the prefix's K/V so far [L, S, K, H]

    @property
    def started(self) -> bool:
        return self.next > 0

    @property
    def done(self) -> bool:
        return self.next == len(self.slices)

    def peek(self) -> Slice:
        return self.slices[self.next]

    def remaining_flops(self) -> float:
        return sum(s.flops for s in self.slices[self.next:])


def text_layers(params, cfg: MoondreamConfig) -> list:
    """The decoder layers' params in order (`launch` passes a slice's layers alone)."""
    return [p for p, _ in text.layer_params(params["text"], cfg.text)]


def launch(P, params, layers: list, kinds: list, job: ImageJob, sl: Slice, scalar,
           adapters=None, slot=None) -> ImagePrefix | None:
    """Dispatch slice `sl` of `job` with the programs `P` (`step.EnginePrograms`;
    asynchronous, no host sync), keeping its outputs on the job -> the prefix once the job
    is done, else None.  `layers`, `kinds`: `text_layers` and `text_kinds`; `scalar(n)`: n
    as an int32 device scalar; `adapters`, `slot`: the LoRA slot tables and the job's slot
    ([1] int32) the prefix is computed under, or None."""
    prep = job.prep
    if sl.kind == "vision":
        if sl.first == 0:
            job.x = P.vision_embed(params, prep.crops)
        job.x = P.vision_blocks(params, job.x, scalar(sl.first), sl.n)
    else:
        if sl.first == 0 and sl.kind != "mlp":   # job.x: now the decoder's activations
            job.x, job.k, job.v = P.prefix_input(params, job.x, prep.src, prep.ph, prep.pw)
        a, b = sl.first, sl.first + sl.n
        extra = () if adapters is None else (adapters[a:b], slot)
        group, at = layers[a:b], scalar(a)
        if sl.kind == "attention" and sl.kv_only:
            job.k, job.v = P.prefix_attention(group[0], job.x, job.k, job.v, at, *extra,
                                              kv_only=True)
        elif sl.kind == "attention":   # job.h: the block input ln(x) between the halves
            job.x, job.h, job.k, job.v = P.prefix_attention(group[0], job.x, job.k, job.v,
                                                            at, *extra)
        elif sl.kind == "mlp":
            job.x = P.prefix_mlp(group[0], kinds[a], job.x, job.h, *extra)
            job.h = None
        elif sl.kv_only:
            job.k, job.v = P.prefix_layers(group, tuple(kinds[a:b]), job.x, job.k, job.v, at,
                                           *extra, kv_only=True)
        else:
            job.x, job.k, job.v = P.prefix_layers(group, tuple(kinds[a:b]), job.x, job.k,
                                                  job.v, at, *extra)
    job.next += 1
    if not job.done:
        return None
    enc = ImagePrefix(job.k, job.v, prep.tiling)
    job.x = job.h = job.k = job.v = None
    return enc


class SliceBudget:
    """How much slice work goes between two decode launches, so that a decoding row waits at
    most about `ratio` times its usual gap: (ratio - 1) x the median gap between two decode
    commits with no slice between them, in seconds, filled with slices at their measured
    speeds.

    Speeds are kept per kind of work (`rate_kind`): the encoder's blocks, a decoder layer's
    attention half, its MLP half and whole decoder layers run at very different flops per
    second (on this CPU, the medium model's at 40, 80, 200 and 150 Gflop/s).  They are
    measured at commit, without syncing: the gap before a decode step that had slices in
    front of it, less the median gap, is their time; the rates of the kinds in it are
    scaled by how far off the prediction was, each by its share of the prediction.  They
    start at the platform's guess (`default_rate`, the encoder at a third and attention at
    half of it).  The rates follow the typical slice; the budget's `margin` covers the
    slow ones.  Until a plain gap was seen, one slice goes per launch.  `fixed`: a
    constant budget in flops per launch, over every kind alike (tests, benchmarks), no
    measuring."""

    KINDS = ("vision", "attention", "mlp", "text")

    def __init__(self, ratio: float, rate: float, fixed: float | None = None, window: int = 64):
        self.ratio, self.fixed = ratio, fixed
        self.rates = {"vision": rate / 3, "attention": rate / 2, "mlp": rate, "text": rate}
        self.gaps: collections.deque = collections.deque(maxlen=window)
        self._median, self._stale = None, False   # (the median, recomputed when read)
        # How far the slices' time overran its prediction, over the last sliced gaps: the
        # budget is divided by its 90th percentile, so the longest gaps (not the mean) stay
        # near `ratio` when slice times scatter (they do on a shared CPU).
        self.overruns: collections.deque = collections.deque(maxlen=32)
        self._margin = 1.0

    def seconds(self) -> float:
        """The time slices may take in front of the next decode step (0: one slice)."""
        if self.median_gap is None:
            return 0.0
        return (self.ratio - 1.0) * self._median / self._margin

    @property
    def margin(self) -> float:
        """What the budget is divided by (>= 1): the recent overruns' 90th percentile."""
        return self._margin

    def cost(self, sl: Slice) -> float:
        """`sl`'s share of the budget: its flops with a fixed budget, else its expected
        seconds."""
        return sl.flops if self.fixed is not None else sl.flops / self.rates[rate_kind(sl)]

    def limit(self) -> float:
        """The budget in `cost`'s units."""
        return self.fixed if self.fixed is not None else self.seconds()

    @property
    def median_gap(self) -> float | None:
        """The median of the recent plain gaps (seconds), or None before the first.  Sorted
        only when read (while images are sliced), not at every commit."""
        if self._stale:
            # (list(): one copy under the GIL; `Engine.stats` may read it from another thread)
            self._median, self._stale = statistics.median(list(self.gaps)), False
        return self._median

    def observe(self, gap_s: float, work: dict) -> None:
        """A decode commit `gap_s` after the previous one, with `work` (rate kind -> flops)
        of slices launched before its step."""
        if gap_s <= 0:
            return
        if not any(work.values()):
            self.gaps.append(gap_s)
            self._stale = True
            return
        if self.median_gap is None:
            return
        parts = {k: f / self.rates[k] for k, f in work.items() if f}
        predicted = sum(parts.values())
        if predicted < 0.2 * self._median:   # too small to tell from the noise
            return
        # Bounded: one outlier (a page fault, another process) cannot swing a rate far.
        off = min(max((gap_s - self._median) / predicted, 0.25), 4.0)
        self.overruns.append(off)
        if len(self.overruns) >= 8:
            self._margin = max(1.0, float(sorted(self.overruns)[int(0.9 * (len(
                self.overruns) - 1))]))
        # Slower than predicted: corrected at once (a long gap is what the budget is for);
        # faster: a quarter of the way (one quick gap does not buy the next one a longer one).
        step = 1.0 if off > 1 else 0.25
        for k, t in parts.items():
            self.rates[k] /= off ** (step * t / predicted)


def default_rate(platform: str) -> float:
    """A first guess of the flops per second slices run at, before the engine measured
    them: this CPU's (2 cores, AVX-512) order of magnitude, a GPU's and a TPU's well below
    their bf16 peaks.  The first budget is (ratio - 1) x gap x this; the measurement then
    replaces it within a few launches."""
    return {"cpu": 1e11, "gpu": 2e14, "tpu": 1e14}.get(platform, 1e11)
