"""Benchmarks of minicpm-jax (outside the library; run from a checkout): ``python -m benchmarks`` runs the
scenarios (``e2e``, ``kernels``, ``load``, ``int4``, ``sparse``, ``spec``) against ceilings and peers
measured in the same run; ``python -m benchmarks.hf_peer`` is the HF transformers peer,
``python -m benchmarks.tune`` the attention-kernel launch sweep. Raw results live in ``results/``."""
