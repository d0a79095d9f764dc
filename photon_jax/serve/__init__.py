"""Layer 5, serve: `photon-serve`'s HTTP application over one `Moondream`.

- `app`: the Starlette app (`create_app`, `ServeConfig`): routes, admission, streaming,
  cancellation;
- `inputs`: request bodies to API calls, every refusal naming its field;
- `compat`: published clients' spellings of a body mapped to the server's, before parsing;
- `intake`: bodies and images, each paid for (a byte budget) before it is read or decoded;
- `limits`: the budgets, their defaults, and uvicorn with connection and header bounds;
- `trust`: who may call (the key; local Host and Origin for keyless callers);
- `fetch`: remote images (--allow-remote-images) from public addresses, on their own pool;
- `metrics`: the Prometheus registry.

Its command line is `photon_jax.cli.serve`.

May import: the faces (`api`, `aio`, `sources`, `functional`), `base`.  Never the engine or
the model directly: what it needs of them the faces export.
"""
