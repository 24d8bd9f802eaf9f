"""Pallas kernels (Triton backend on GPU, interpret mode on CPU), each beside a jnp reference.

Empty until the attention-kernel work lands; the model reaches kernels only through
``minicpm_jax.attention`` / ``minicpm_jax.layers``.
"""
