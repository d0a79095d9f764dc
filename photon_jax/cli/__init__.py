"""Layer 6, the command lines: `photon-caption` (`caption`), `photon-convert` (`convert`)
and `photon-serve` (`serve`), each only its flags, their checks and its exit code; the
engine flags the first and last share are defined once, in `flags`.  Each also runs as
`python -m photon_jax.cli.NAME`.

May import: `dataset`, `serve`, the faces (`api`, `sources`), `convert`, `base`.
"""
