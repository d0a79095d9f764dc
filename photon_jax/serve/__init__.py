"""Layer 5, serve: `photon-serve`'s HTTP application over one `Moondream`.

- `app`: the Starlette app (`create_app`, `ServeConfig`): routes, admission, streaming,
  cancellation;
- `inputs`: request bodies to API calls, every refusal naming its field;
- `metrics`: the Prometheus registry.

Its command line is `photon_jax.cli.serve`.

May import: the faces (`api`, `aio`, `sources`, `functional`), `base`.  Never the engine or
the model directly: what it needs of them the faces export.
"""
