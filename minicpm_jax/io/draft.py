"""EAGLE draft checkpoints: their tensors (safetensors, or ``pytorch_model.bin`` through torch), the kind
of draft they hold, vLLM's naming, their int4 settings, and writing them back.

Names: CPM.cu / SafeAILab (``fc``, ``input_norm1/2``, ``layers.0.*``; EAGLE-3 ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``) are the engine's (:func:`minicpm_jax.io.names.draft_map`). Two other layouts are
renamed on reading (:func:`engine_draft_names`): vLLM's MiniCPM EAGLE (``model.fc``,
``model.eagle_layers.0.*``, ``model.norm`` plus copies of the target's embedding and lm_head) and EAGLE-3
drafts whose decoder layer is ``layers.0.*`` / ``model.layers.0.*`` (CPM.cu's converter and vLLM call
``midlayer`` so internally; some exporters save it so).
"""

from __future__ import annotations

import json
import os

import numpy as np

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.int4_checkpoint import checkpoint_quant
from minicpm_jax.io.names import Linear
from minicpm_jax.quant import CheckpointQuant, read_quantize_config


def read_draft_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a draft directory as NumPy arrays (bf16 kept as ``ml_dtypes.bfloat16``):
    ``*.safetensors``, else ``pytorch_model.bin`` (needs torch)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors: dict[str, np.ndarray] = {}
    if files:
        for f in files:
            try:
                with safe_open(os.path.join(path, f), framework="flax") as h:
                    tensors.update({k: np.asarray(h.get_tensor(k)) for k in h.keys()})
            except (SafetensorError, OSError, ValueError) as e:
                raise MiniCPMError(f"{os.path.join(path, f)} is not a readable safetensors file ({e})") from None
        return tensors
    binary = os.path.join(path, "pytorch_model.bin")
    if not os.path.isfile(binary):
        raise MiniCPMError(f"no *.safetensors or pytorch_model.bin in the draft directory {path!r}")
    try:
        import torch
    except ImportError:
        raise MiniCPMError(f"{binary} is a PyTorch file: install torch to read it, or convert it to safetensors") from None
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise MiniCPMError(f"cannot read {binary}: {e}") from None
    import ml_dtypes

    return {k: v.float().numpy().astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
            for k, v in state.items()}


def from_vllm_names(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], bool]:
    """Renames a vLLM-format MiniCPM EAGLE checkpoint (``model.fc``, ``model.input_norm{1,2}``,
    ``model.eagle_layers.0.*``, ``model.norm``, ``model.embed_tokens``, ``lm_head``) to CPM.cu's names;
    returns (tensors, whether it was vLLM's). The copies of the target's embedding and lm_head are
    dropped (the target's own are used); ``norm.weight`` is kept, and the draft map reads past it (vLLM
    builds that norm and never applies it); drafts of more than one layer are refused."""
    if not any(n.startswith(("model.eagle_layers.", "model.fc.")) for n in tensors):
        return tensors, False
    layers = {n.split(".")[2] for n in tensors if n.startswith("model.eagle_layers.")}
    if layers - {"0"}:
        raise MiniCPMError(f"this draft has {len(layers)} EAGLE layers; only one-layer drafts are supported")
    out = {}
    for name, value in tensors.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        name = name.replace("model.eagle_layers.0.", "layers.0.")
        out[name[len("model."):] if name.startswith("model.") else name] = value
    return out, True


def to_vllm_names(tensors: dict[str, np.ndarray], embed: np.ndarray, lm_head: np.ndarray) -> dict[str, np.ndarray]:
    """CPM.cu-format MiniCPM EAGLE tensors → vLLM's names, with the target's embedding and lm_head, and a
    ``model.norm.weight`` of ones when the draft has none: vLLM's ``EagleMiniCPMModel`` builds that norm
    without applying it, but its loader refuses a checkpoint that leaves a parameter unset."""
    out = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    for name, value in tensors.items():
        out["model." + name.replace("layers.0.", "eagle_layers.0.")] = value
    if "model.norm.weight" not in out:
        norm = tensors.get("input_norm1.weight")
        out["model.norm.weight"] = np.ones(embed.shape[1], norm.dtype if norm is not None else embed.dtype)
    return out


def is_eagle3(names: set[str]) -> bool:
    """Whether tensor names (any layout) are an EAGLE-3 draft's: a ``d2t`` table or a ``hidden_norm``."""
    return "d2t" in names or any(n.startswith("midlayer.") or n.endswith(".hidden_norm.weight") for n in names)


def from_eagle3_layer_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An EAGLE-3 draft whose decoder layer is named ``layers.0.*`` or ``model.layers.0.*`` (CPM.cu's
    gptq2marlin converter works on ``model.layers.0``, vLLM loads ``midlayer`` as ``layers.0``) renamed to
    ``midlayer.*``; other drafts are returned as they are. Drafts of more than one layer are refused."""
    names = set(tensors)
    if not is_eagle3(names) or any(n.startswith("midlayer.") for n in names):
        return tensors
    out = {}
    for name, value in tensors.items():
        stripped = name[len("model."):] if name.startswith("model.layers.") else name
        if stripped.startswith("layers."):
            layer, rest = stripped[len("layers."):].split(".", 1)
            if layer != "0":
                raise MiniCPMError(f"this EAGLE-3 draft has a layer {layer} ({name}); only one-layer drafts are supported")
            name = "midlayer." + rest
        out[name] = value
    return out


def engine_draft_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A draft's tensors in the engine's names whatever layout they came in (CPM.cu / SafeAILab, vLLM's
    MiniCPM EAGLE, EAGLE-3 with ``layers.0``): :func:`from_vllm_names` then :func:`from_eagle3_layer_names`."""
    return from_eagle3_layer_names(from_vllm_names(tensors)[0])


def draft_kind_of(names: set[str]) -> str:
    """``minicpm``, ``llama`` or ``eagle3`` from a draft checkpoint's tensor names (CPM.cu / SafeAILab
    names, after :func:`engine_draft_names`); a clear error for other checkpoints."""
    if "fc.weight" not in names and "fc.qweight" not in names:
        raise MiniCPMError("not an EAGLE draft checkpoint: it has no fc.weight (or int4 fc.qweight) tensor")
    if is_eagle3(names):
        return "eagle3"
    return "minicpm" if "input_norm1.weight" in names else "llama"


def draft_quant(path: str, raw: dict, tensors: dict[str, np.ndarray], fc: Linear) -> CheckpointQuant | None:
    """The int4 settings of a quantized draft (``quantization_config`` in its config.json ``raw`` or
    ``quantize_config.json``; Marlin packing recognised from the ``fc.qweight`` shape, as CPM.cu's converter
    keeps the GPTQ config), or None when it is dense."""
    settings = raw.get("quantization_config") or read_quantize_config(path)
    return checkpoint_quant(f"draft {path!r}", settings, set(tensors), lambda n: tuple(tensors[n].shape), fc,
                            declared_needs_codes=False)


def write_draft(path: str, tensors: dict[str, np.ndarray], config: dict) -> None:
    """Writes a draft directory (``model.safetensors`` + ``config.json``) to a temporary directory beside
    ``path`` and renames it into place; an existing ``path`` is refused."""
    from safetensors.numpy import save_file

    if os.path.exists(path):
        raise MiniCPMError(f"{path!r} already exists")
    tmp = path.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, path)
