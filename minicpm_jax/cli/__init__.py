"""The command-line programs (``python -m minicpm_jax.run`` / ``.server`` / ``.perplexity``), their shared
flags and process settings, and the demo model."""
