"""Layer 6, integrations: adapters to other systems' APIs (optional extras; nothing here is
imported by default).

- `ray`: Ray Data's `map_batches` over a pool of Moondream actors, records as
  `photon-caption` writes them.

May import: `dataset`, the faces (`api`), `base`.
"""
