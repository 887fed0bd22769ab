"""A trained LoRA adapter as a llama.cpp GGUF LoRA adapter, for the GGUF base it was trained on.

``export_gguf_lora(model, base, path, version)`` publishes ``<path>/adapter.gguf`` (atomically,
``rlx.io.export.publish``), the file llama.cpp loads with ``--lora`` / ``llama_adapter_lora_init``
(llama-cpp-python: ``Llama(..., lora_path=...)``):

- metadata ``general.type = "adapter"``, ``general.architecture`` = the base file's (llama.cpp
  refuses another), ``adapter.type = "lora"``, ``adapter.lora.alpha`` (float32: llama.cpp scales
  each product by alpha / rank, rank read from the tensors); rlx's scaling is written as
  ``alpha = scaling * rank``, so rsLoRA adapters carry their own effective alpha;
- for every adapted linear, ``<base tensor>.lora_a`` (numpy ``[r, in]``) and ``<base tensor>.lora_b``
  (``[out, r]``), float32, named after the base file's own tensor; ``lora_b``'s rows in the file's
  row order (llama.cpp's rope permutation of q / k in llama files, as the base stores them).

Adapters on MoE experts are refused (export them with ``export_peft``); so is a base that is not
the GGUF file the model was loaded from (its tensor names would not match).
"""

from __future__ import annotations

import os

import gguf
import jax
import numpy as np
from flax import nnx

from rlx.io.export import dense_adapters, publish
from rlx.models.decoder import Transformer
from rlx.models.gguf import GGUFCheckpoint, read_gguf
from rlx.models.stack import unrolled
from rlx.quant.config import QuantConfigError

FILE = "adapter.gguf"


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), np.float32)


def gguf_lora_tensors(model: Transformer, base: GGUFCheckpoint) -> tuple[dict[str, np.ndarray], float]:
    """(GGUF-named ``lora_a`` / ``lora_b`` tensors, ``adapter.lora.alpha``) of ``model``'s adapters."""
    model = unrolled(model, nnx.LoRAParam)  # scanned layers: per-layer adapters, base abstract
    if any(getattr(layer.mlp, "experts", None) is not None and
           any(lo is not None for lo in (layer.mlp.experts.gate_lora, layer.mlp.experts.up_lora,
                                         layer.mlp.experts.down_lora)) for layer in model.layers):
        raise QuantConfigError("the model has LoRA adapters on MoE experts, which the GGUF LoRA "
                               "export does not write; export them with rlx.io.export.export_peft")
    tensors, alphas = {}, set()
    for module, lo in dense_adapters(model).items():
        hf_name = f"{module}.weight"
        if hf_name not in base.tensors:
            raise QuantConfigError(f"{base.path} has no tensor {hf_name!r} for the adapter on "
                                   f"{module}: export against the GGUF file the model was loaded from")
        stored = base.tensors.gguf_name(hf_name)
        a, b = _np(lo.lora_a[...]), _np(lo.lora_b[...])  # [in, r], [r, out]
        if base.tensors.shape(hf_name) != (b.shape[1], a.shape[0]):
            raise QuantConfigError(f"{base.path}: {stored} is {list(base.tensors.shape(hf_name))}, "
                                   f"the adapter on {module} is for [{b.shape[1]}, {a.shape[0]}]: "
                                   "export against the GGUF file the model was loaded from")
        tensors[f"{stored}.lora_a"] = np.ascontiguousarray(a.T)
        tensors[f"{stored}.lora_b"] = base.tensors.stored_rows(hf_name, np.ascontiguousarray(b.T))
        alphas.add(float(lo.scaling) * a.shape[1])
    if not tensors:
        raise QuantConfigError("the model has no LoRA adapters to export; call rlx.quant.apply_lora first")
    if len(alphas) > 1:
        raise QuantConfigError(f"the adapters differ in alpha ({sorted(alphas)}); a GGUF LoRA file "
                               "carries one adapter.lora.alpha")
    return tensors, alphas.pop()


def export_gguf_lora(model: Transformer, base: str, path: str, version: str) -> str:
    """Publish ``model``'s adapters as ``<path>/adapter.gguf`` for the GGUF file ``base``."""
    ckpt = read_gguf(base)
    tensors, alpha = gguf_lora_tensors(model, ckpt)

    def write(tmp: str) -> dict:
        writer = gguf.GGUFWriter(os.path.join(tmp, FILE), ckpt.architecture)
        writer.add_type("adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", alpha)
        for name, value in tensors.items():
            writer.add_tensor(name, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return {"alpha": alpha, "base": os.path.basename(base), "tensors": len(tensors)}

    return publish(path, version, "gguf-lora", write)


__all__ = ["FILE", "export_gguf_lora", "gguf_lora_tensors"]
