"""Generation: the engine's public step API (prefill, first token, decode blocks) and ``generate``, the
device programs behind it (``steps``), sampling, stops, continuous batching (``scheduler``) and EAGLE
speculative decoding (``speculative``)."""
