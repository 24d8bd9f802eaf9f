"""Offline checkpoint converters: ``python -m checkpoints_convert {gguf,hf,inspect} ...``."""
