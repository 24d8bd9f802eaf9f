"""Pallas kernels (Triton backend on GPU, interpret mode on CPU), each beside a jnp reference.

``attention`` — flash prefill and flash-decoding over the static KV cache, with ``attention_reference``;
``backend`` — interpret/Triton launch options and the measured launch-config table; ``tune`` — the sweep
that measures it; ``timing`` — device-side timing loops for µs-scale kernels. The model reaches kernels
only through ``minicpm_jax.attention``.
"""
