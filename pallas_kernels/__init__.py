"""Pallas kernels, each beside a jnp reference with the same signature, and the backend namespaces that
serve them to the model.

:mod:`pallas_kernels.backend` is the one place a backend is chosen; :mod:`pallas_kernels.xla` (the
references) and :mod:`pallas_kernels.triton` (the kernels) hold the same op names. Kernels:
``attention`` (flash prefill, flash-decoding), ``tree_attention`` (speculative tree verification),
``cache_write`` (new K/V into the cache in place), ``int4_matmul`` (W4A16), ``infllm/`` (InfLLM-v2:
``stage1`` scores, ``select`` block selection, ``stage2`` block-sparse and local-window attention,
``decode`` selection + attention in one kernel, ``compress`` compressed keys); shared pieces in ``flash``
(online softmax, split merges) and ``launch`` (launch options, tuned table); ``topk`` (an exact two-stage
top-k in XLA). Nothing here imports ``minicpm_jax``.
"""
