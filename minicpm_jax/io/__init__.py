"""Checkpoints on disk → parameter arrays, and back: the one map from checkpoint tensor names to engine
parameters (``names``), safetensors / native (Orbax) / GPTQ and marlin-cpmcu int4 / EAGLE draft / FR-Spec
readers and writers. Nothing here builds a model: ``minicpm_jax.model.loading`` does, from what these
modules yield.
"""
