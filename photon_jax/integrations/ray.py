"""Ray Data integration: caption a dataset across many machines with `map_batches`.

Owns: `Captioner`, a callable class Ray runs as a pool of actors (one Moondream engine per
actor, on the actor's device), and `caption_dataset`, which wires it into `map_batches`.  Ray
does the distribution, retries and I/O; this module only turns a batch of images into
caption columns.  Install with `pip install "photon_jax[ray]"` (Ray 2.59 or 2.60).

    import ray
    from photon_jax.integrations.ray import caption_dataset
    ds = ray.data.read_binary_files("s3://bucket/images/", include_paths=True)
    ds = caption_dataset(ds, "/ckpt/moondream2", image_column="bytes", concurrency=4,
                         num_gpus=1)
    ds.write_parquet("s3://bucket/captions/")   # path, caption, finish_reason, ...

The image column may hold encoded file bytes, file paths, HxWx3 uint8 arrays (what
`ray.data.read_images` gives) or {"bytes", "path"} structs (Hugging Face image columns),
one kind per column (Arrow columns are typed: mixed bytes and paths become all bytes).
Each row gains "caption" (None when the image failed), "finish_reason", "output_tokens" and
"error" (None on success), exactly the fields of a `photon-caption --jsonl` record, so one
bad image never fails the batch.  Rows leave in batches of the rows that came in, each row
with all its own columns; batches leave in Ray's order (set
`DataContext.get_current().execution_options.preserve_order = True` for the input's).

Keeping every engine full.  One `Captioner.__call__` submits its batch and waits for all of
it, so on its own the engine's rows would drain at the tail of every batch.  Each actor
therefore works on `batches_in_flight` batches at once (default 2): Ray Data runs that many
calls of the same Captioner concurrently on threads of the actor
(`ActorPoolStrategy(max_concurrent_calls_per_actor=, enable_true_multi_threading=True)`;
`Moondream` is safe from several threads), and queues the next batches on the actor, so
while one batch finishes its tail the next one's requests already fill the freed rows:
up to batches_in_flight x batch_size requests in flight per engine (2 x batch_size, the
window `photon-caption` keeps).  Alternatives ruled out: a `__call__` that returns earlier
batches' results one batch late loses the last batch of every Ray task (map_batches has no
end-of-input hook), and carrying results across tasks breaks Ray's retries; an async
`__call__` alone overlaps batches only within one Ray task (one batch here); driving `ray.util.ActorPool` by hand from `iter_batches`
gives up Ray Data's streaming, retries and autoscaling.  Every call returns its own rows'
results, so each input row comes out exactly once.  The arguments are Ray 2.60's current
ones: `compute=ActorPoolStrategy(...)`, not `map_batches(concurrency=)` (deprecated since
2.51), and no `**ray_remote_args` such as `max_concurrency=` (deprecated since 2.59, the
first release with `max_concurrent_calls_per_actor`).
"""

from __future__ import annotations

import numpy as np

from ..dataset.job import failure, outcome

OUTPUT_COLUMNS = ("caption", "finish_reason", "output_tokens", "error")


class Captioner:
    """Ray Data `map_batches` callable class (give it through `fn_constructor_kwargs`).

    checkpoint: a photon-convert directory readable from every actor's machine.
    image_column: the column holding the images; dropped from the output unless keep_image.
    length / prompt: caption length, or a question to ask instead (query mode).
    settings: Moondream settings dict (default: greedy, temperature 0, for datasets).
    batch_size: rows the engine decodes together; make Ray's batch_size at least this.
    tensor_parallel: K > 1 splits the model over the actor's first K devices (one engine).
    Calls may run concurrently on several threads of the actor (`caption_dataset`'s
    batches_in_flight): each submits its own batch and returns that batch's rows."""

    def __init__(self, checkpoint: str, *, image_column: str = "image",
                 length: str = "normal", prompt: str | None = None,
                 settings: dict | None = None, batch_size: int = 32, dtype=None, device=None,
                 workers: int = 4, prepend: str = "", append: str = "",
                 keep_image: bool = False, tensor_parallel: int | None = None):
        from ..api import Moondream

        self.image_column, self.keep_image = image_column, keep_image
        self.length, self.prompt = length, prompt
        self.settings = {"temperature": 0.0, **(settings or {})}
        self.prepend, self.append = prepend, append
        self.md = Moondream.load(checkpoint, dtype=dtype, device=device,
                                 max_batch_size=batch_size, workers=workers,
                                 tensor_parallel=tensor_parallel)

    def __call__(self, batch: dict) -> dict:
        if self.image_column not in batch:
            raise KeyError(f"no column {self.image_column!r} in the batch (columns: "
                           f"{sorted(batch)}); pass image_column=")
        images = batch[self.image_column]
        # Submit the whole batch first so it decodes together, then collect in order.
        started = []
        for x in images:
            try:
                started.append(self.md.start(_image(x), question=self.prompt,
                                             length=self.length, settings=self.settings))
            except (ValueError, TypeError) as e:
                started.append(e)
        outs = [failure(h) if isinstance(h, Exception) else
                outcome(h, self.prepend, self.append) for h in started]
        out = {k: v for k, v in batch.items() if k != self.image_column or self.keep_image}
        for col in OUTPUT_COLUMNS:
            out[col] = np.array([o[col] for o in outs],
                                dtype=np.int64 if col == "output_tokens" else object)
        return out

    def close(self) -> None:
        """Finish the actor's requests and free its engine."""
        self.md.close()


def _image(x):
    """One cell of the image column -> what `Moondream.start` accepts."""
    if isinstance(x, dict):   # Hugging Face / Arrow image struct
        if x.get("bytes") is not None:
            return bytes(x["bytes"])
        if x.get("path"):
            return x["path"]
        raise ValueError("image struct has neither 'bytes' nor 'path'")
    if isinstance(x, np.bytes_):
        return bytes(x)
    if isinstance(x, np.str_):
        return str(x)
    if x is None:
        raise ValueError("the image cell is empty (null)")
    return x


def caption_dataset(ds, checkpoint: str, *, concurrency: int | tuple[int, int] = 1,
                    num_gpus: float = 0, batch_size: int = 32, batches_in_flight: int = 2,
                    captioner: type = Captioner, **captioner_kwargs):
    """`ds.map_batches` with a pool of Captioner actors (each with `num_gpus` accelerators;
    0 on CPU), fed batches of `batch_size` rows.  A whole num_gpus K > 1 gives each actor
    one engine split over its K devices (`tensor_parallel=K`, unless given).

    concurrency: the number of actors, or (min, max) for a pool Ray scales between them.
    batches_in_flight: batches each actor works on at once, so up to batches_in_flight x
        batch_size requests are in flight on its engine (2: photon-caption's window; 1: one
        batch at a time, whose tail leaves engine rows idle).
    captioner: the callable class, `Captioner` or a subclass (one that adds columns, say).
    The other keyword arguments go to the Captioner."""
    import ray.data

    if isinstance(num_gpus, int) and num_gpus > 1:
        captioner_kwargs.setdefault("tensor_parallel", num_gpus)

    if not isinstance(batches_in_flight, int) or batches_in_flight < 1:
        raise ValueError(f"batches_in_flight must be an int >= 1, got {batches_in_flight!r}")
    pool = ({"min_size": concurrency[0], "max_size": concurrency[1]}
            if isinstance(concurrency, tuple) else {"size": concurrency})
    compute = ray.data.ActorPoolStrategy(
        **pool, max_concurrent_calls_per_actor=batches_in_flight,
        enable_true_multi_threading=True)
    return ds.map_batches(
        captioner, fn_constructor_kwargs={"checkpoint": checkpoint, "batch_size": batch_size,
                                          **captioner_kwargs},
        batch_size=batch_size, compute=compute, num_gpus=num_gpus)
