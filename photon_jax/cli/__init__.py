"""The command lines: `photon-caption` (`caption`), `photon-convert` (`convert`) and
`photon-serve` (`serve`, the HTTP server, with `serve_inputs` and `serve_metrics`).  Each
also runs as `python -m photon_jax.cli.NAME`."""
