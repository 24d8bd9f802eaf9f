"""``python -m minicpm_jax.perplexity``: the entry point of :mod:`minicpm_jax.cli.perplexity` (see there)."""

from minicpm_jax.cli.perplexity import main

if __name__ == "__main__":
    from absl import app

    app.run(main)
