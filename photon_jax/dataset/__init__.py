"""Layer 5, dataset: `photon-caption`'s job, captioning a dataset of many thousands of
images on one's own devices.

- `files`: finding the images, where each one's outputs go, what is done on a re-run,
  crash-safe writes and the JSONL;
- `job`: one run: engines per device, the window of requests in flight, progress,
  interrupts, the summary and exit code.

Its command line is `photon_jax.cli.caption`; `photon_jax.integrations.ray` reuses its
records.

May import: the faces (`api`, `aio`, `sources`, `functional`), `base`.
"""
