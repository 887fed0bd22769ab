"""An OFT adapter (``config.lora.kind="oft"``, ``rlx.quant.oft``) as a HF PEFT OFT folder.

PEFT 0.21 stores one ``oft_R.weight`` ``[in / b, b (b - 1) / 2]`` per adapted linear, named
``base_model.model.<hf module>.oft_R.weight``: the upper triangles rlx trains, unchanged (both
take rows in the same order and the same row-major triangle, so no transpose or sign flip);
``adapter_config.json`` has ``peft_type: OFT``, ``oft_block_size`` with ``r: 0`` and the Cayley
form (``use_cayley_neumann``, ``num_cayley_neumann_terms``). PEFT's OFT has no
``target_parameters``, so it cannot adapt transformers-5's fused expert tensors: an adapter on
MoE experts is refused here (``export_merged`` folds every rotation, the experts' included), as
is a MoE family whose MLP names PEFT remaps to its experts.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from rlx.models.decoder import Transformer
from rlx.models.families import family_of
from rlx.models.hf import param_map
from rlx.models.stack import unrolled
from rlx.quant.config import LoraConfig, QuantConfigError
from rlx.quant.oft import OFT

# a layer's experts' adapter attributes (rlx.models.moe.Experts)
_EXPERT_ADAPTERS = ("gate_lora", "up_lora", "down_lora")


def oft_adapters(model: Transformer) -> dict[str, OFT]:
    """HF module name -> the OFT adapter of every adapted ``Linear`` (named by ``param_map``);
    OFT adapters on MoE experts are refused (see the module doc)."""
    sources, out = param_map(model.config), {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, OFT):
            continue
        if path[-1] in _EXPERT_ADAPTERS:
            raise QuantConfigError(
                "PEFT's OFT cannot adapt MoE experts (no target_parameters for transformers' "
                "fused expert tensors); export_merged folds them, or set config.lora.experts=False")
        kernel = "/".join(map(str, path[:-1])) + "/kernel"
        out[sources[kernel].hf_names[0].removesuffix(".weight")] = node
    return out


def export_config(lora: LoraConfig, modules: list[str], base_model_name_or_path: str | None) -> dict:
    """``adapter_config.json`` of a PEFT OFT folder for ``lora``'s rotation on ``modules``."""
    return {"peft_type": "OFT", "task_type": "CAUSAL_LM", "r": 0,
            "oft_block_size": lora.oft.block_size, "module_dropout": 0.0, "coft": False,
            "eps": 6e-5, "block_share": False, "use_cayley_neumann": lora.oft.cayley_neumann,
            "num_cayley_neumann_terms": lora.oft.neumann_terms, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": False, "init_weights": True, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path,
            "peft_version": "0.21.0"}  # the Neumann series of PEFT >= 0.18 (its version check)


def oft_peft(model: Transformer, lora: LoraConfig, base_model_name_or_path: str | None = None
             ) -> tuple[dict[str, np.ndarray], dict]:
    """(PEFT-named ``oft_R.weight`` tensors, ``adapter_config.json``) of ``model``'s OFT adapters
    (``rlx.io.export.export_peft`` writes them for ``lora.kind="oft"``)."""
    adapters = oft_adapters(unrolled(model, nnx.LoRAParam))
    if not adapters:
        raise QuantConfigError("the model has no OFT adapters to export; call rlx.quant.apply_lora "
                               "with lora.kind='oft' first")
    if family_of(model.config).peft_remaps_mlp_names and any(".mlp." in n for n in adapters):
        raise QuantConfigError(
            f"PEFT reads the MLP names of {model.config.architecture} as its fused experts, so an "
            "OFT adapter on its dense or shared MLPs has no PEFT name; use export_merged")
    tensors = {f"base_model.model.{name}.oft_R.weight": np.asarray(o.oft_r[...], np.float32)
               for name, o in adapters.items()}
    modules = sorted({name.rsplit(".", 1)[1] for name in adapters})
    return tensors, export_config(lora, modules, base_model_name_or_path)
