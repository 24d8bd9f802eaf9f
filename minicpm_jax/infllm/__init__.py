"""InfLLM-v2 trainable sparse attention above the kernels: the dense/sparse policy, the compressed-key
caches, and sparse attention for plain tokens and for speculative-tree nodes. The kernels and their jnp
references are in ``pallas_kernels.infllm``; which ones run is the kernel backend's choice."""
