"""The independent oracles of the test suite, written from the formulas and format definitions, never
from the code under test: the NumPy MiniCPM4 forward, the transformers oracle (a Llama with MiniCPM's
scalings folded in), InfLLM-v2's compressed keys, and GPTQ packing / dequantization with bit loops.

Oracles used by one test module only stay in that module.
"""

from __future__ import annotations

import math

import numpy as np


# ----------------------------------------------------------------------------- NumPy reference
def numpy_forward(cfg: dict, w: dict[str, np.ndarray], ids: np.ndarray, max_length: int) -> np.ndarray:
    """Logits ``[T, vocab]`` (float64) of one sequence, written directly from the MiniCPM4 formulas."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    eps = cfg["rms_norm_eps"]
    t = len(ids)
    W = {k: v.astype(np.float64) for k, v in w.items()}

    # RoPE: inv_freq_i = 1 / (ext_i * theta^(2i/d)); ext = long iff the cache exceeds the original length.
    rs = cfg.get("rope_scaling") or {}
    inv = 1.0 / cfg.get("rope_theta", 10000.0) ** (np.arange(0, d, 2) / d)
    mscale = 1.0
    if rs.get("rope_type") == "longrope":
        orig = rs["original_max_position_embeddings"]
        ext = np.array(rs["long_factor"] if max_length > orig else rs["short_factor"])
        inv = inv / ext
        ratio = cfg["max_position_embeddings"] / orig
        mscale = math.sqrt(1 + math.log(ratio) / math.log(orig)) if ratio > 1 else 1.0
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1) * mscale
    sin = np.concatenate([np.sin(ang)] * 2, -1) * mscale

    def rope(x):  # [T, heads, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        rot = np.concatenate([-x2, x1], -1)
        return x * cos[:, None] + rot * sin[:, None]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

    def silu(x):
        return x / (1 + np.exp(-x))

    res = cfg.get("scale_depth", 1.0) / math.sqrt(L) if cfg["model_type"] == "minicpm" else 1.0
    x = W["model.embed_tokens.weight"][ids] * (cfg.get("scale_emb", 1.0) if cfg["model_type"] == "minicpm" else 1.0)
    causal = np.tril(np.ones((t, t), bool))
    for layer in range(L):
        p = f"model.layers.{layer}."
        a = rms(x, W[p + "input_layernorm.weight"])
        q = rope((a @ W[p + "self_attn.q_proj.weight"].T).reshape(t, nh, d))
        k = rope((a @ W[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, d))
        v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, d)
        out = np.zeros((t, nh, d))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[:, head] @ k[:, kv].T / math.sqrt(d)
            s = np.where(causal, s, -np.inf)
            p_ = np.exp(s - s.max(-1, keepdims=True))
            p_ /= p_.sum(-1, keepdims=True)
            out[:, head] = p_ @ v[:, kv]
        x = x + res * (out.reshape(t, nh * d) @ W[p + "self_attn.o_proj.weight"].T)
        m = rms(x, W[p + "post_attention_layernorm.weight"])
        g = silu(m @ W[p + "mlp.gate_proj.weight"].T) * (m @ W[p + "mlp.up_proj.weight"].T)
        x = x + res * (g @ W[p + "mlp.down_proj.weight"].T)
    x = rms(x, W["model.norm.weight"])
    if cfg["model_type"] == "minicpm":
        x = x / (h / cfg.get("dim_model_base", 1.0))
    head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else W["lm_head.weight"]
    return x @ head.T


# ----------------------------------------------------------------------------- transformers oracle
def hf_llama_with_minicpm_folded(cfg: dict, w: dict[str, np.ndarray]):
    """transformers ``LlamaForCausalLM`` computing the same function as a MiniCPM checkpoint.

    scale_emb is folded into the embedding, scale_depth/sqrt(L) into o_proj and down_proj, and
    dim_model_base/hidden into lm_head; LongRoPE goes through transformers' own rope init.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    L = cfg["num_hidden_layers"]
    rs = cfg.get("rope_scaling")
    rope_parameters = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if rs and rs.get("rope_type") == "longrope":
        rope_parameters = {
            "rope_type": "longrope",
            "rope_theta": cfg["rope_theta"],
            "short_factor": rs["short_factor"],
            "long_factor": rs["long_factor"],
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
        }
    lcfg = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=L,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(lcfg).eval()
    res = cfg["scale_depth"] / math.sqrt(L)
    sd = {}
    for name, value in w.items():
        v = value.astype(np.float32)
        if name == "model.embed_tokens.weight":
            v = v * cfg["scale_emb"]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            v = v * res
        sd[name] = torch.from_numpy(np.ascontiguousarray(v))
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    sd["lm_head.weight"] = torch.from_numpy(np.ascontiguousarray(head * (cfg["dim_model_base"] / cfg["hidden_size"])))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


# ----------------------------------------------------------------------------- InfLLM-v2
def np_compress(k: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    """``k [..., S, D]`` → means of every complete window ``[stride*j, stride*j + kernel)`` along S."""
    s = k.shape[-2]
    n = (s - kernel) // stride + 1 if s >= kernel else 0
    if not n:
        return np.zeros((*k.shape[:-2], 0, k.shape[-1]))
    return np.stack([k[..., stride * j: stride * j + kernel, :].mean(-2) for j in range(n)], axis=-2)


def np_compress_step(k, k1, k2, old, new, *, layer: int, kernel1: int, stride1: int, kernel2: int,
                     stride2: int) -> list[np.ndarray]:
    """The compressed-key update of one decode step: for each row that grew (``new[b] > old[b]``, by one
    token) and each of (k1, k2), the window the step completed, ``j = (new - kernel) / stride`` when that is
    whole, gets the mean of its keys in ``layer``. k ``[L, B, KVH, S, D]``; returns float64 (k1, k2)."""
    k = np.asarray(k, np.float64)
    out = []
    for comp, kernel, stride in ((k1, kernel1, stride1), (k2, kernel2, stride2)):
        comp = np.array(np.asarray(comp, np.float64))
        for b in range(k.shape[1]):
            start = int(new[b]) - kernel
            if new[b] > old[b] and start >= 0 and start % stride == 0:
                comp[layer, b, :, start // stride] = k[layer, b, :, start:start + kernel].mean(-2)
        out.append(comp)
    return out


# ----------------------------------------------------------------------------- GPTQ int4 formats
def pack_rows_oracle(q: np.ndarray) -> np.ndarray:
    """GPTQ qweight: word [k//8, n] holds row k at bits 4·(k%8)."""
    k_dim, n_dim = q.shape
    words = np.zeros((k_dim // 8, n_dim), np.uint32)
    for k in range(k_dim):
        words[k // 8] |= q[k].astype(np.uint32) << np.uint32(4 * (k % 8))
    return words.view(np.int32)


def pack_cols_oracle(z: np.ndarray) -> np.ndarray:
    """GPTQ qzeros: word [g, n//8] holds column n at bits 4·(n%8)."""
    g_dim, n_dim = z.shape
    words = np.zeros((g_dim, n_dim // 8), np.uint32)
    for n in range(n_dim):
        words[:, n // 8] |= z[:, n].astype(np.uint32) << np.uint32(4 * (n % 8))
    return words.view(np.int32)


def unpack_rows_oracle(qweight: np.ndarray) -> np.ndarray:
    words = qweight.view(np.uint32)
    q = np.zeros((8 * words.shape[0], words.shape[1]), np.int64)
    for k in range(q.shape[0]):
        q[k] = (words[k // 8] >> np.uint32(4 * (k % 8))) & 0xF
    return q


def unpack_cols_oracle(qzeros: np.ndarray) -> np.ndarray:
    words = qzeros.view(np.uint32)
    z = np.zeros((words.shape[0], 8 * words.shape[1]), np.int64)
    for n in range(z.shape[1]):
        z[:, n] = (words[:, n // 8] >> np.uint32(4 * (n % 8))) & 0xF
    return z


def gptq_dequant_oracle(qweight, qzeros, scales, g_idx, fmt: str) -> np.ndarray:
    """float64 ``w[k, n] = scale[g_idx[k], n] · (q[k, n] − zero[g_idx[k], n])``."""
    q = unpack_rows_oracle(qweight)
    z = unpack_cols_oracle(qzeros) + (1 if fmt == "gptq" else 0)
    s = scales.astype(np.float64)
    w = np.empty(q.shape, np.float64)
    for k in range(q.shape[0]):
        g = int(g_idx[k])
        w[k] = s[g] * (q[k] - z[g])
    return w
