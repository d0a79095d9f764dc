"""Layer 2, model: Moondream itself, as pure functions over a param dict, and what it takes
to hold one: its config, its checkpoint, its tokenizer, its layout over chips.

- the network: `layers`, `vision`, `text` (dense KV cache; any other cache through an access
  object it is handed), `moe`, `region`, `sampling`;
- its description and storage: `config`, `params`, `checkpoint`;
- its inputs on the host: `pixels` (images to crops), `tokenizer` (prompts to ids);
- where it runs: `platforms` (which kernels and schedules a device gets), `sharding` (the
  split over a mesh), `loaded` (`Model`: config, params on a device or mesh, prompts).

Nothing here knows a request, a page table or a scheduler: the engine pages the KV cache
and hands the model its pool through access objects.  `Model` is importable from here:
`from photon_jax.model import Model`.

May import: `kernels`, `base`.
"""

from .loaded import Model  # noqa: F401  (README's `from photon_jax.model import Model`)
