"""Real weights: SmolLM2-135M-Instruct (GGUF → HF dir) against transformers loading the same GGUF."""

import numpy as np
import jax.numpy as jnp
import pytest
import torch

from minicpm_jax.engine.engine import Engine
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.tokenizer import StreamDecoder, encode_prompt, stop_token_ids
from tests import helpers

pytestmark = pytest.mark.smollm2

TEXT = (
    "The history of astronomy spans thousands of years. Early civilizations tracked the motions of the Sun, "
    "the Moon and the planets, built calendars, and predicted eclipses. Later, telescopes revealed moons around "
    "Jupiter and the phases of Venus, and the laws of motion explained the orbits we observe. Today, space "
    "telescopes and radio arrays study galaxies billions of light years away."
)
CHATS = [
    "What is the capital of France?",
    "Explain how a rainbow forms, step by step.",
    "Give me three tips for learning to program.",
]


def test_logits_match_transformers_on_64_tokens(smollm2_model, smollm2_tokenizer, hf_smollm2):
    ids = smollm2_tokenizer(TEXT)["input_ids"][:64]
    assert len(ids) == 64
    cache = smollm2_model.new_cache(1)
    logits, _, _ = smollm2_model(jnp.asarray([ids], jnp.int32), cache)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    assert helpers.rel_err(np.asarray(logits[0]), ref) < 1e-4


def test_greedy_chat_continuations_match_transformers_generate(smollm2_model, smollm2_tokenizer, hf_smollm2, smollm2_dir):
    tok = smollm2_tokenizer
    prompts = [encode_prompt(tok, text) for text in CHATS]
    stops = stop_token_ids(smollm2_model.config, tok, smollm2_dir)
    assert stops == [2]
    engine = Engine(smollm2_model, batch_size=3, chunk_length=32, decode_block=16)
    ours, stats = engine.generate(prompts, max_new_tokens=48, stop_token_ids=stops)
    assert stats.decode_tokens == sum(len(r.token_ids) - 1 for r in ours)
    for prompt, res in zip(prompts, ours):
        with torch.no_grad():
            out = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=stops)
        assert res.token_ids == out[0, len(prompt):].tolist()
        assert res.finish_reason == ("stop" if res.token_ids[-1] in stops else "length")
    assert [len(r.token_ids) for r in ours][1:] == [48, 48]  # the long answers are compared in full
    assert "Paris" in tok.decode(ours[0].token_ids)


def test_stream_decoder_reassembles_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("Ünïcödé ✓ text — with emoji 🚀 and spaces  twice.")["input_ids"]
    dec = StreamDecoder(tok)
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_fast_decode_is_the_tokenizers_decode(smollm2_tokenizer):
    """The Rust fast path gives what ``decode`` gives (random windows, special tokens in and out); a
    tokenizer that cleans up spaces keeps its own ``decode``."""
    import copy

    from minicpm_jax.tokenizer import fast_decode

    tok = smollm2_tokenizer
    rng = np.random.default_rng(0)
    special = tok.all_special_ids
    for skip in (True, False):
        fast = fast_decode(tok, skip)
        for n in (1, 2, 4, 9):
            for _ in range(50):
                ids = [int(i) for i in rng.integers(0, tok.vocab_size, n)]
                ids[rng.integers(0, n)] = int(rng.choice(special))
                assert fast(ids) == tok.decode(ids, skip_special_tokens=skip)
    bypassed = copy.copy(tok)  # SmolLM2's tokenizer takes the fast path: its wrapper is never called
    bypassed.decode = None
    assert fast_decode(bypassed)([504, 1597]) == tok.decode([504, 1597], skip_special_tokens=True)

    class Custom(type(tok)):  # a tokenizer class with its own decoding keeps it
        def _decode(self, *args, **kwargs):
            return "custom"

    custom = copy.copy(tok)
    custom.__class__ = Custom
    assert fast_decode(custom)([504]) == "custom"
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    calls = []
    cleaning.decode = lambda ids, **kw: calls.append(ids) or "x"
    assert fast_decode(cleaning)([5]) == "x" and calls == [[5]]


def test_chat_template_and_plain_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = encode_prompt(tok, "hi", system_prompt="Be brief.")
    text = tok.decode(chat)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "hi", use_chat_template=False) == tok("hi")["input_ids"]


def test_enable_thinking_reaches_the_chat_template(smollm2_dir):
    """MiniCPM4.1-style templates branch on enable_thinking; the switch must reach the template."""
    from minicpm_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    )
    off = tok.decode(encode_prompt(tok, "hi", enable_thinking=False))
    on = tok.decode(encode_prompt(tok, "hi", enable_thinking=True))
    default = tok.decode(encode_prompt(tok, "hi"))
    assert off.endswith("<think>\n\n</think>\n") and not on.endswith("</think>\n") and default == on


@pytest.mark.parametrize("tokenizer_class, longrope", [(None, False), ("LlamaTokenizer", False), (None, True)])
def test_tokenizer_of_a_remote_code_checkpoint_loads_without_asking(smollm2_dir, smollm2_tokenizer, tmp_path,
                                                                    monkeypatch, tokenizer_class, longrope):
    """A directory laid out as MiniCPM4's are published (``model_type: minicpm`` and ``auto_map`` entries
    naming remote code): the tokenizer loads without running or asking about custom code (transformers
    would print "Do you wish to run the custom code? [y/N]" and read stdin), and without a tokenizer class
    it is the generic fast tokenizer of ``tokenizer.json``, which encodes like the demo's own."""
    import json
    import shutil

    from minicpm_jax.tokenizer import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(f"{smollm2_dir}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="minicpm", architectures=["MiniCPMForCausalLM"],
                  auto_map={"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                            "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"})
    if longrope:  # MiniCPM4's rope: transformers' generic config then fails with an AttributeError
        config["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": 8192,
                                  "short_factor": [1.0] * 32, "long_factor": [1.5] * 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok_config.pop("tokenizer_class", None)
    if tokenizer_class:
        tok_config["tokenizer_class"] = tokenizer_class
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_minicpm.MiniCPMTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    tok = load_tokenizer(tmp_path)
    assert not asked
    if tokenizer_class is None:
        assert encode_prompt(tok, CHATS[0]) == encode_prompt(smollm2_tokenizer, CHATS[0])


def test_a_directory_without_tokenizer_files_says_so(tmp_path):
    """A weights-only directory (a MiniCPM4 LongRoPE config and nothing else): the error names the missing
    files, not transformers' AttributeError about the config."""
    import json

    from minicpm_jax.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps(helpers.tiny_minicpm_config()))
    with pytest.raises(MiniCPMError, match="has no tokenizer .*copy the tokenizer files"):
        load_tokenizer(tmp_path)
