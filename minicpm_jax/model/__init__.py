"""The MiniCPM4 network as Flax NNX modules — layers, RoPE, the static KV cache, attention, the causal LM,
EAGLE draft modules — and building them from checkpoints (``loading``)."""
