"""Training beside the engine: EAGLE drafts for any target the engine loads (``python -m
minicpm_jax.train_eagle``). ``data`` reads and batches the training text, ``distill`` makes
self-distillation data with the engine, ``objective`` holds the EAGLE losses over the engine's own draft
module, ``trainer`` runs optax / Orbax / data parallelism."""
