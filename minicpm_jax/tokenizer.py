"""Text ↔ ids: the checkpoint's tokenizer, its chat template, stop ids and incremental detokenization."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from minicpm_jax.config import ModelConfig
from minicpm_jax.errors import MiniCPMError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a model directory (``transformers.AutoTokenizer``); MiniCPMError if it has none.

    Never runs a checkpoint's own code and never asks: published MiniCPM4 directories carry ``auto_map``
    entries (remote-code classes), on which transformers would otherwise stop to ask "Do you wish to run the
    custom code? [y/N]" on stdin. Their tokenizer is a standard one: where transformers cannot tell which
    without the custom code, ``tokenizer.json`` is loaded as a generic fast tokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy import, only when text is involved

    path = os.fspath(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    # transformers fails in several ways on a config it cannot build without the custom code (a MiniCPM
    # LongRoPE config: AttributeError on max_position_embeddings); the tokenizer.json fallback covers them.
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
        error = e
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        try:
            return PreTrainedTokenizerFast.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as e:
            error = e
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise MiniCPMError(f"{path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the tokenizer files "
                           "of the model it came from")
    raise MiniCPMError(f"cannot load a tokenizer from {path!r}: {error}")


# Arguments of ``apply_chat_template`` that a request's template variables must not override.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                    "tokenizer_kwargs"})


def encode_prompt(
    tokenizer,
    text: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    enable_thinking: bool | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt ids for ``text`` (one user turn) or a whole ``messages`` list.

    With the chat template the assistant turn is opened (``add_generation_prompt``); ``enable_thinking``
    (MiniCPM4.1's hybrid reasoning switch) and ``template_kwargs`` (an OpenAI request's
    ``chat_template_kwargs``) are passed to the template as variables; names of ``apply_chat_template``'s own
    arguments are refused. Without a template the text is tokenized as is (with the tokenizer's BOS, if it
    adds one).
    """
    if messages is None:
        if text is None:
            raise MiniCPMError("no prompt given")
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}
        ]
    if not use_chat_template:
        return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise MiniCPMError("this tokenizer has no chat template; run with --use_chat_template=false")
    extra = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_ARGS & set(extra))
    if reserved:
        raise MiniCPMError(f"chat template variables {', '.join(reserved)} are reserved")
    if enable_thinking is not None:
        extra["enable_thinking"] = enable_thinking
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def sampling_defaults(model_dir: str | None) -> dict[str, float | int]:
    """The sampling settings a checkpoint's ``generation_config.json`` recommends (``temperature``,
    ``top_p``, ``top_k``; only valid values), used where a request gives none, as vLLM does. ``do_sample``
    is not consulted (vLLM neither): a recommended temperature is taken as meant."""
    path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    checks = {"temperature": lambda v: 0 <= v <= 2, "top_p": lambda v: 0 < v <= 1,
              "top_k": lambda v: isinstance(v, int) and v >= 0}
    return {k: raw[k] for k, ok in checks.items() if isinstance(raw.get(k), (int, float))
            and not isinstance(raw.get(k), bool) and ok(raw[k])} if isinstance(raw, dict) else {}


def stop_token_ids(config: ModelConfig, tokenizer=None, model_dir: str | None = None) -> list[int]:
    """End-of-sequence ids: config.json, generation_config.json and the tokenizer's eos, deduplicated."""
    ids = list(config.eos_token_ids)
    if model_dir:
        gen = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen):
            try:
                with open(gen, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError):
                eos = None
            ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))


# transformers' decode of a fast tokenizer (v5, v4): the Rust decode, then an optional space clean-up.
_BACKEND_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")


def fast_decode(tokenizer, skip_special_tokens: bool = True):
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, through the Rust tokenizer directly where
    that is the same function: a fast tokenizer that cleans up no spaces, whose ``decode`` only wraps the
    backend's. A server detokenizes every token of every stream twice on the scheduler's thread; the
    wrapper's Python costs ~5 µs a call there (1.2 vs 6.7 µs for SmolLM2's four-token window on this
    CPU). Any other tokenizer, or one whose class overrides ``decode`` / ``_decode``, keeps its own
    ``decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    plain = (getattr(cls.decode, "__qualname__", "") == "PreTrainedTokenizerBase.decode"
             and getattr(getattr(cls, "_decode", None), "__qualname__", "") in _BACKEND_DECODES)  # not overridden
    if backend is not None and plain and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenization: feed ids, get the newly completed text.

    Decodes a short window of recent ids and emits the difference, holding back text that ends in an
    incomplete UTF-8 sequence (U+FFFD), so multi-token characters and leading spaces come out right.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # ids before this are already emitted
        self._decode = fast_decode(tokenizer, skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        """Appends ids and returns the text they complete (possibly empty)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is left (including a trailing incomplete character)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class TextStream:
    """Detokenizes new ids, cuts the text at the first stop string and emits (``emit(text)``) only text
    that can no longer turn out to be the start of a stop string. ``tokens`` counts the ids taken: all of
    them, or up to the one that completed the stop string."""

    def __init__(self, tokenizer, stops: list[str], emit=None):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.emit = emit
        self.tokens = 0

    def push(self, ids: list[int]) -> bool:
        """Adds ids; returns True once a stop string has been seen."""
        if self.stopped:
            return True
        # With stop strings, one id at a time: ``tokens`` then says which id completed the stop string.
        for batch in ([[i] for i in ids] if self.stops else [list(ids)]):
            self.text += self.decoder.push(batch)
            self.tokens += len(batch)
            self._check_stop()
            if self.stopped:
                break
        self._flush(final=self.stopped)
        return self.stopped

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
            self._check_stop()
        self._flush(final=True)
        return self.text

    def _check_stop(self) -> None:
        hits = [i for i in (self.text.find(s, max(0, self.emitted - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _flush(self, final: bool) -> None:
        upto = len(self.text) if final or not self.stops else max(self.emitted, len(self.text) - self.hold)
        if self.emit is not None and upto > self.emitted:
            self.emit(self.text[self.emitted : upto])
        self.emitted = max(self.emitted, upto)
