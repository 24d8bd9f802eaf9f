"""EAGLE speculative decoding: the round math (``rounds``) and the engine that runs it (``engine``)."""
