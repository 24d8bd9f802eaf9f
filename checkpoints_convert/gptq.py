"""int4 checkpoints: GPTQ → the native format or CPM.cu's marlin-cpmcu layout, and the GPTQ writer.

* ``--layout native``: an Orbax checkpoint in the engine's int4 layout (see ``checkpoints_convert.hf``).
* ``--layout marlin``: a directory CPM.cu loads as ``MiniCPM4-*-marlin-cpmcu``: ``model_gptq.safetensors``
  with fused ``qkv_proj`` / ``gate_up_proj``, Marlin-packed ``qweight int32 [K/16, 2N]`` and
  Marlin-permuted ``scales``, no ``qzeros`` / ``g_idx``; dense tensors and config.json as in the source
  (what CPM.cu's ``gptq2marlin.py`` writes). Needs a symmetric checkpoint without act-order.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

from checkpoints_convert.common import ShardedSafetensorsWriter, atomic_output_dir, check_destination, write_json
from checkpoints_convert.hf import copy_side_files, convert_hf
from minicpm_jax.config import ModelConfig, read_config_json
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io import int4_formats as int4
from minicpm_jax.io.hf import hf_checkpoint_quant
from minicpm_jax.io.int4_checkpoint import MARLIN_CPMCU_FILE, read_int4_linear
from minicpm_jax.io.names import Linear, model_map, resolve_tied_head, split_linears
from minicpm_jax.io.safetensors import TensorReader, safetensors_files
from minicpm_jax.quant import CheckpointQuant, QuantSpec, gptq_config_dict

LAYOUTS = ("native", "marlin")
CPMCU_GROUP_SIZE = 128  # the only group size CPM.cu's Marlin kernel is built for


def dense_tensor_names(config: ModelConfig, names: set[str]) -> list[str]:
    """Checkpoint names of the tensors that stay dense in an int4 model (embeddings, norms, lm_head)."""
    cmap = model_map(config, names)
    return [t.name for t in cmap.tensors] + [n for lin in cmap.linears if not lin.quantizable for n in lin.weight_names]


def write_gptq_tensors(writer: ShardedSafetensorsWriter, config: ModelConfig, linears: dict[tuple, int4.Int4Weight],
                       checkpoint_format: str = "gptq") -> None:
    """Adds every decoder linear in GPTQ form under the split Hugging Face names (``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``). ``linears`` maps an Int4Linear's
    module path to its (fused) weight."""
    shapes = split_linears(config)
    for path, w in linears.items():
        layer, module, linear = path[2], path[3], path[4]
        parts = shapes[(module, linear)]
        for (name, _), part in zip(parts, int4.split_columns(w, [n for _, n in parts])):
            for suffix, array in int4.gptq_pack(part, checkpoint_format).items():
                writer.add(f"model.layers.{layer}.{module}.{name}.{suffix}", array)


def write_gptq_config(src: str, dst: str, spec: QuantSpec, checkpoint_format: str = "gptq") -> None:
    """config.json of ``src`` with the GPTQ ``quantization_config`` of ``spec``."""
    raw = read_config_json(src)
    raw["quantization_config"] = gptq_config_dict(spec, checkpoint_format)
    write_json(os.path.join(dst, "config.json"), raw)


def _marlin_tensors(src: Linear, w: int4.Int4Weight) -> dict[str, np.ndarray]:
    if w.zeros is not None or not w.trivial_g_idx:
        raise MiniCPMError(f"{src.prefixes[0]}: the marlin-cpmcu layout needs symmetric weights without act-order")
    prefix = ".".join(str(p) for p in src.path)
    return {
        f"{prefix}.qweight": int4.marlin_pack(w.q),
        f"{prefix}.scales": int4.marlin_permute_scales(w.scales.astype(np.float16), per_channel=w.scales.shape[0] == 1),
    }


def convert_to_marlin(src: str, dst: str, *, overwrite: bool = False, progress: bool = True) -> CheckpointQuant:
    """Writes the marlin-cpmcu form of the GPTQ checkpoint ``src`` to ``dst`` (atomically)."""
    from tqdm import tqdm

    check_destination(dst, overwrite)
    config = ModelConfig.from_pretrained(src)
    files = safetensors_files(src)
    config = resolve_tied_head(config, set(files))
    quant = hf_checkpoint_quant(src, config, files)
    if quant is None:
        raise MiniCPMError(f"{src} is not an int4 checkpoint (no *.qweight tensors)")
    if not quant.spec.sym or quant.spec.act_order:
        raise MiniCPMError(f"{src}: the marlin-cpmcu layout needs symmetric weights without act-order (sym=true, "
                           f"desc_act=false; this checkpoint has sym={quant.spec.sym}, desc_act={quant.spec.act_order})")
    if quant.spec.group_size != CPMCU_GROUP_SIZE:
        print(f"warning: group_size {quant.spec.group_size}: minicpm-jax loads it, CPM.cu only runs group "
              f"{CPMCU_GROUP_SIZE}", file=sys.stderr)
    names = set(files)
    tensors: dict[str, np.ndarray] = {}
    with TensorReader(files) as reader:
        for name in dense_tensor_names(config, names):
            if name not in names:
                raise MiniCPMError(f"{src}: missing tensor {name}")
            tensors[name] = np.asarray(reader.get(name))
        int4_linears = [lin for lin in model_map(config, names).linears if lin.quantizable]
        for source in tqdm(int4_linears, desc="repacking", unit="linear", disable=not progress):
            tensors.update(_marlin_tensors(source, read_int4_linear(source, quant, reader.get_optional)))
    with atomic_output_dir(dst, overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, MARLIN_CPMCU_FILE), metadata={"format": "pt"})
        with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        write_json(os.path.join(tmp, "config.json"), raw)
        copy_side_files(src, tmp)
    return quant


def convert_gptq(src: str, dst: str, *, layout: str = "native", overwrite: bool = False, progress: bool = True) -> None:
    """``python -m checkpoints_convert gptq``: a GPTQ (or marlin-cpmcu) checkpoint → ``layout``."""
    if layout not in LAYOUTS:
        raise MiniCPMError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "native":
        convert_hf(src, dst, overwrite=overwrite, progress=progress, require_int4=True)
    else:
        convert_to_marlin(src, dst, overwrite=overwrite, progress=progress)
