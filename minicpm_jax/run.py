"""``python -m minicpm_jax.run``: the entry point of :mod:`minicpm_jax.cli.run` (see there)."""

from minicpm_jax.cli.run import main

if __name__ == "__main__":
    from absl import app

    app.run(main)
