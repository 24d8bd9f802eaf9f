"""``python -m minicpm_jax.server``: the entry point of :mod:`minicpm_jax.cli.server` (see there)."""

from minicpm_jax.cli.server import main

if __name__ == "__main__":
    from absl import app

    app.run(main)
