"""Exports for serving, each published atomically with a version string.

``publish(path, version, kind, write)`` writes into a fresh temp folder next to ``path``, adds
``rlx_export.json`` (``{"version", "kind", ...}``), then renames it into place; a reader sees either
the old complete folder or the new complete one (an existing folder is first renamed aside, then
removed). Four kinds:

- ``export_peft``: the LoRA adapter as HF PEFT (``adapter_config.json`` + ``adapter_model.safetensors``,
  names ``base_model.model.<hf module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``).
  transformers-5 MoE models store experts fused (``mlp.experts.gate_up_proj [E, 2f, d]``,
  ``mlp.experts.down_proj [E, d, f]``, plain ``nn.Parameter``s that ``target_modules`` cannot reach);
  peft 0.21 adapts them through ``target_parameters`` with ``lora_A [E*r, in]`` (row ``e*r + j``) and
  ``lora_B [out, r*E]`` (column ``j*E + e``). rlx's separate per-expert gate and up adapters (rank r
  each) are exported exactly as one block-diagonal adapter of rank 2r on ``gate_up_proj``
  (``rank_pattern`` / ``alpha_pattern`` keep alpha / r). peft nests two wrapped parameters of one
  module: ``gate_up_proj``'s adapter is then named ``experts.base_layer.lora_*`` and ``down_proj``'s
  ``experts.lora_*``. peft refuses dropout on wrapped parameters, so such configs carry
  ``lora_dropout: 0`` (dropout plays no part in serving). gpt-oss stores ``gate_up_proj`` as
  ``[E, d, 2f]`` with gate and up columns interleaved (``MoENames.fused``): peft's factors are
  the same (``in`` and ``out`` as named), the gate's rows of ``lora_B`` the even ones.
  An OFT adapter (``lora.kind="oft"``) is written as a PEFT OFT folder (``rlx.io.export_oft``).
- ``export_base``: the frozen base in the layout SGLang loads as the same values (mapping in
  ``rlx.quant.serving``; a GGUF base is the GGUF file it was loaded from).
- ``export_merged``: base dequantized + ``(alpha / r) B A`` merged (OFT: ``R W``), plain HF safetensors (float32 by
  default; ``python -m rlx.export`` writes the base's own dtype) that any consumer loads.
- ``export_critic``: PPO's critic apart from the policy, for ``AutoModelForTokenClassification``
  with one label: its adapter + value head as a PEFT folder (LoRA mode) or its merged model with
  the head (full mode).

The float exports stream: one rlx weight at a time is read (all-gathered where it is spread over
processes), laid out under its HF names and handed to a ``ShardWriter``, which holds at most one
safetensors shard (``MAX_SHARD_BYTES``); no host ever holds the whole model. ``rlx_export.json``
records the writer's accounting (``shards``, ``bytes``, ``peak_held_bytes``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator

import jax
import numpy as np
from flax import nnx

from rlx.io.export_oft import oft_peft
from rlx.mesh import host_values
from rlx.models.config import to_hf_config
from rlx.models.decoder import Transformer
from rlx.models.families import FAMILIES, family_of
from rlx.models.hf import ParamSource, param_map, put_hf_layout
from rlx.models.moe import CorrectionBias
from rlx.models.safetensors_io import ShardWriter
from rlx.models.stack import unrolled
from rlx.quant.config import LoraConfig, QuantConfig, QuantConfigError
from rlx.quant.loading import node_at
from rlx.quant.lora import LoRA
from rlx.quant.oft import OFT
from rlx.quant.serving import quantization_config, to_serving


MAX_SHARD_BYTES = 2 << 30  # a safetensors shard of a float export, at most (one tensor may be more)


def publish(path: str, version: str, kind: str, write: Callable[[str], dict | None]) -> str:
    """Run ``write(tmp_dir)`` and move the result to ``path`` atomically; returns ``path``."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        extra = write(tmp) or {}
        with open(os.path.join(tmp, "rlx_export.json"), "w") as f:
            json.dump({"version": str(version), "kind": kind, **extra}, f, indent=2)
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_version(path: str) -> str:
    with open(os.path.join(path, "rlx_export.json")) as f:
        return json.load(f)["version"]


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), np.float32)


# Model types whose MoE experts transformers 5 fuses and for which peft 0.21 reads the MLP names of
# ``target_modules`` (gate_proj / up_proj / down_proj) as the fused experts' parameters (its
# transformers-4 conversion), so those names cannot reach a dense or shared-expert MLP. Their
# MLP adapters go to ``target_parameters`` by weight ('mlp.shared_experts.up_proj.weight'): the
# same tensors, which peft then puts on exactly those linears.
# (``rlx.models.families``: ``FamilySpec.peft_remaps_mlp_names``)
PEFT_REMAPS_MLP_NAMES = tuple(t for t, s in FAMILIES.items() if s.peft_remaps_mlp_names)


def dense_adapters(model: Transformer) -> dict[str, LoRA]:
    """HF module name -> adapter of every adapted ``Linear``, named by ``param_map`` (so
    'layers/1/mlp/shared_expert/up_proj' is DeepSeek's 'model.layers.1.mlp.shared_experts.up_proj')."""
    sources, out = param_map(model.config), {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, LoRA) and node.lora_a.ndim == 2:
            kernel = "/".join(map(str, path[:-1])) + "/kernel"
            out[sources[kernel].hf_names[0].removesuffix(".weight")] = node
    return out


def _expert_tensors(lg, lu, ld, prefix: str, nested: bool, interleaved: bool = False
                    ) -> dict[str, np.ndarray]:
    """PEFT ``target_parameters`` tensors of one layer's experts (see the module docstring);
    ``interleaved``: gate and up outputs alternate (gpt-oss), else gate first, then up."""
    out = {}
    if lg is not None or lu is not None:
        parts = [p for p in (lg, lu) if p is not None]
        f = parts[0].lora_b.shape[-1]
        e = parts[0].lora_a.shape[0]
        a = np.concatenate([_np(p.lora_a[...]).transpose(0, 2, 1) for p in parts], axis=1)  # [E, R, d]
        big_r = a.shape[1]
        b = np.zeros((e, 2 * f, big_r), np.float32)  # [E, 2f, R], block diagonal
        col = 0
        for half, p in enumerate((lg, lu)):
            if p is not None:
                r = p.lora_a.shape[-1]
                rows = slice(half, 2 * f, 2) if interleaved else slice(half * f, (half + 1) * f)
                b[:, rows, col:col + r] = _np(p.lora_b[...]).transpose(0, 2, 1)
                col += r
        name = f"{prefix}.base_layer" if nested else prefix
        out[f"{name}.lora_A.weight"] = a.reshape(e * big_r, -1)
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.transpose(1, 2, 0).reshape(2 * f, big_r * e))
    if ld is not None:
        e, _, r = ld.lora_a.shape
        out[f"{prefix}.lora_A.weight"] = _np(ld.lora_a[...]).transpose(0, 2, 1).reshape(e * r, -1)
        bd = _np(ld.lora_b[...]).transpose(2, 1, 0)  # [d, r, E]
        out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(bd.reshape(bd.shape[0], r * e))
    return out


def peft_state(model: Transformer) -> tuple[dict[str, np.ndarray], dict]:
    """(PEFT-named adapter tensors, the shape facts ``adapter_config.json`` needs)."""
    model = unrolled(model, nnx.LoRAParam)  # scanned layers: per-layer adapters, base abstract
    tensors, modules, params, gate_up = {}, set(), set(), False
    remapped = family_of(model.config).peft_remaps_mlp_names
    interleaved = family_of(model.config).moe_names.fused
    for name, lo in dense_adapters(model).items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = _np(lo.lora_a[...]).T.copy()
        tensors[f"base_model.model.{name}.lora_B.weight"] = _np(lo.lora_b[...]).T.copy()
        leaf = name.rsplit(".", 1)[1]
        if remapped and ".mlp." in name:  # 'model.layers.1.mlp.shared_experts.up_proj'
            params.add(f"mlp.{name.split('.mlp.', 1)[1]}.weight")
        else:
            modules.add(leaf)
    for i, layer in enumerate(model.layers):
        ex = getattr(layer.mlp, "experts", None)
        if ex is None or (ex.gate_lora, ex.up_lora, ex.down_lora) == (None, None, None):
            continue
        has_gu = ex.gate_lora is not None or ex.up_lora is not None
        nested = has_gu and ex.down_lora is not None
        prefix = f"base_model.model.model.layers.{i}.mlp.experts"
        tensors.update(_expert_tensors(ex.gate_lora, ex.up_lora, ex.down_lora, prefix, nested,
                                       interleaved))
        if has_gu:
            params.add("mlp.experts.gate_up_proj")
            gate_up = True
        if ex.down_lora is not None:
            params.add("mlp.experts.down_proj")
    return tensors, {"target_modules": sorted(modules), "target_parameters": sorted(params),
                     "gate_up": gate_up}


def export_peft(model: Transformer, lora: LoraConfig, path: str, version: str,
                base_model_name_or_path: str | None = None, head: dict | None = None) -> str:
    """Write the adapters of ``model`` as a HF PEFT adapter folder (published atomically); with a
    ``head`` (HF-named tensors of a task head, e.g. ``value_head_tensors``) a token-classification
    adapter whose head is PEFT's ``modules_to_save``."""
    if lora.kind == "oft":  # a PEFT OFT folder (rlx.io.export_oft)
        tensors, config = oft_peft(model, lora, base_model_name_or_path)
        return _write_peft(path, version, config, tensors, {"adapter": "oft"})
    tensors, facts = peft_state(model)
    if not tensors:
        raise QuantConfigError("the model has no LoRA adapters to export; call rlx.quant.apply_lora first")
    modules_to_save = sorted({name.split(".")[0] for name in head or {}}) or None
    tensors.update({f"base_model.model.{name}": value for name, value in (head or {}).items()})
    rank_pattern, alpha_pattern = {}, {}
    if facts["gate_up"] and lora.gate_up_rank != lora.rank:  # experts' gate + up as one adapter
        rank_pattern["gate_up_proj"] = lora.gate_up_rank
        alpha_pattern["gate_up_proj"] = lora.alpha * lora.gate_up_rank / lora.rank
    config = {
        "peft_type": "LORA", "task_type": "TOKEN_CLS" if head else "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if facts["target_parameters"] else lora.dropout,
        "target_modules": facts["target_modules"], "target_parameters": facts["target_parameters"] or None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": modules_to_save,
        "base_model_name_or_path": base_model_name_or_path,
    }

    return _write_peft(path, version, config, tensors, {"rank": lora.rank, "alpha": lora.alpha})


def _write_peft(path: str, version: str, config: dict, tensors: dict[str, np.ndarray], facts: dict
                ) -> str:
    """Publish a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    def write(tmp: str) -> dict:
        from safetensors.numpy import save_file

        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        return facts

    return publish(path, version, "peft", write)


def _value(node, dtype=np.float32) -> np.ndarray:
    """A weight's (dequantized) value on the host. One spread over several processes' devices is
    all-gathered: a collective, so every process reads the same weights in the same order."""
    value = node[...] if isinstance(node, nnx.Variable) else node.dequantize()
    return np.asarray(host_values(value)).astype(dtype, copy=False)


def _float_dtype(model: Transformer, path: str, node, dtype):
    """The dtype a float leaf is written in: f32 for a sigmoid router and its correction bias (rlx
    computes routing in f32 from f32 weights, so a server must see the same bits), else ``dtype``."""
    moe = model.config.moe
    if isinstance(node, CorrectionBias) or (
            moe is not None and moe.router == "sigmoid" and path.endswith("/mlp/router")):
        return np.float32
    return dtype


def _merge(model: Transformer, path: str, value: np.ndarray) -> np.ndarray:
    """The weight at ``path`` (``value``, f32, rlx layout) with its adapter merged: plus LoRA's
    ``(alpha / r) A @ B``, or OFT's rotation folded in (``R W``); as it is without an adapter."""
    owner_path, _, leaf = path.rpartition("/")
    owner = node_at(model, owner_path) if owner_path else model
    lo = owner.lora if leaf == "kernel" else getattr(owner, f"{leaf.removesuffix('_proj')}_lora", None)
    if isinstance(lo, OFT):
        return _np(lo.fold(value))
    if not isinstance(lo, LoRA):
        return value
    return value + np.matmul(_np(lo.lora_a[...]), _np(lo.lora_b[...])) * np.float32(lo.scaling)


def completes(src: ParamSource) -> bool:
    """Whether the weight ``src`` maps completes its HF tensors: not the first (even) half of a
    fused, interleaved tensor, whose second (odd) half comes next in ``param_map``."""
    return src.layout != "even"


def _hf_named(model: Transformer, weights: Iterator[tuple[str, np.ndarray]]
              ) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named tensors of ``(rlx path, value in rlx layout)`` pairs, in HF layout; the two halves
    of a fused, interleaved tensor (gpt-oss ``gate_up_proj``, whose gate and up come one after
    the other) come out once, whole."""
    sources, pending = param_map(model.config), {}
    for path, value in weights:
        src = sources[path]
        put_hf_layout(src, value, pending)
        if completes(src):
            yield from pending.items()
            pending = {}


def merged_tensors(model: Transformer, dtype=np.float32, progress: Callable[[int], None] | None = None
                   ) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named float tensors of base (dequantized) + merged adapters, one rlx weight at a time
    (a host holds one weight's tensors at once, not the model); ``progress(1)`` once each weight's
    tensors were taken."""
    model = unrolled(model)

    def weights():
        for path in param_map(model.config):
            node = node_at(model, path)
            value = _value(node, np.float32)
            value = _merge(model, path, value)
            yield path, value.astype(_float_dtype(model, path, node, dtype), copy=False)
            if progress is not None:
                progress(1)

    return _hf_named(model, weights())


def merged_state_dict(model: Transformer, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named float tensors of base (dequantized) + merged adapters."""
    return dict(merged_tensors(model, dtype))


def weight_count(model: Transformer) -> int:
    """How many rlx weights an export of ``model`` streams (its ``progress`` calls, one each)."""
    return len(param_map(model.config))


def write_shards(tensors: Iterator[tuple[str, np.ndarray]], path: str,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Stream ``tensors`` into safetensors shards in ``path`` (``ShardWriter``: at most one shard
    held). Returns the writer's accounting, which ``publish`` records in ``rlx_export.json``."""
    writer = ShardWriter(path, max_shard_bytes)
    for name, array in tensors:
        writer.add(name, array)
    files = writer.close()
    return {"shards": len(files), "bytes": writer.total_bytes, "peak_held_bytes": writer.peak_bytes,
            "max_shard_bytes": max_shard_bytes}


def write_config(tmp: str, model: Transformer, dtype, qc: dict | None = None) -> None:
    """``config.json`` of ``model`` in folder ``tmp`` (``torch_dtype``, optional quantization)."""
    hf_cfg = to_hf_config(model.config)
    hf_cfg["torch_dtype"] = np.dtype(dtype).name
    if qc:
        hf_cfg["quantization_config"] = qc
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)


def export_merged(model: Transformer, path: str, version: str, dtype=np.float32, *,
                  tokenizer=None, progress: Callable[[int], None] | None = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """A plain HF folder with the adapters merged into the dequantized base, written shard by
    shard as the weights stream (``merged_tensors``, ``write_shards``), with ``tokenizer``'s files
    when given; ``progress(1)`` per weight (``weight_count`` in all)."""
    def write(tmp: str) -> dict:
        write_config(tmp, model, dtype)
        shards = write_shards(merged_tensors(model, dtype, progress), tmp, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save(tmp)
        return {"dtype": np.dtype(dtype).name, **shards}

    return publish(path, version, "merged", write)


def base_tensors(model: Transformer, q: QuantConfig, dtype=np.float32,
                 progress: Callable[[int], None] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named tensors of the frozen base in ``q.serving``'s layout (adapters left out), one rlx
    weight at a time; ``progress(1)`` once each weight's tensors were taken."""
    model, pending = unrolled(model, nnx.Not(nnx.LoRAParam)), {}
    for path, src in param_map(model.config).items():
        node = node_at(model, path)
        if isinstance(node, nnx.Variable) or q.serving_spec.dequantized or src.layout == "copy":
            put_hf_layout(src, _value(node, _float_dtype(model, path, node, dtype)), pending)
            if completes(src):
                yield from pending.items()
                pending = {}
        else:
            leaves = {k: np.asarray(jax.device_get(v)) for k, v in node.leaves().items()}
            if src.layout == "T":
                yield from to_serving(leaves, src.hf_names[0][: -len(".weight")], q).items()
            else:
                for e, name in enumerate(src.hf_names):
                    yield from to_serving({k: v[e] for k, v in leaves.items()},
                                          name[: -len(".weight")], q).items()
        if progress is not None:
            progress(1)


def base_state_dict(model: Transformer, q: QuantConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named tensors of the frozen base in ``q.serving``'s layout (adapters left out)."""
    return dict(base_tensors(model, q, dtype))


def export_base(model: Transformer, q: QuantConfig, path: str, version: str, dtype=np.float32,
                gguf_file: str | None = None, *, progress: Callable[[int], None] | None = None,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """The frozen base as SGLang loads it (``q.serving``; see ``rlx.quant.serving``), written
    shard by shard as the weights stream (``base_tensors``, ``write_shards``)."""
    if q.serving_spec.source_file:
        if not gguf_file:
            raise QuantConfigError(f"serving={q.serving!r} exports the GGUF file the base was "
                                   "loaded from; pass gguf_file")

        def write_gguf(tmp: str) -> dict:
            shutil.copyfile(gguf_file, os.path.join(tmp, os.path.basename(gguf_file)))
            return {"serving": q.serving, "file": os.path.basename(gguf_file)}

        return publish(path, version, "base", write_gguf)

    def write(tmp: str) -> dict:
        write_config(tmp, model, dtype, quantization_config(q))
        shards = write_shards(base_tensors(model, q, dtype, progress), tmp, max_shard_bytes)
        return {"serving": q.serving, "format": q.format, **shards}

    return publish(path, version, "base", write)


def value_head_tensors(head: dict) -> dict[str, np.ndarray]:
    """PPO's value head (``{"kernel": [D], "bias": []}``) as HF's token-classification head with
    one label: ``score.weight`` [1, D] and ``score.bias`` [1] (what ``config.critic.path`` reads)."""
    return {"score.weight": _np(head["kernel"]).reshape(1, -1),
            "score.bias": _np(head["bias"]).reshape(1)}


def export_critic(critic: Transformer, head: dict, path: str, version: str,
                  lora: LoraConfig | None = None, base_model_name_or_path: str | None = None,
                  dtype=np.float32) -> str:
    """PPO's critic, apart from the policy, as transformers' ``AutoModelForTokenClassification``
    with one label reads it (its ``score`` layer is the value head; its logit at position t is
    rlx's value at t + 1, ``rlx.learner.critic``):

    - ``lora`` (LoRA mode): ``critic`` is the policy's frozen base with the critic's adapter; a
      PEFT folder of that adapter (``export_peft``, task ``TOKEN_CLS``) with the head as
      ``modules_to_save``, loaded on the policy's base with ``num_labels=1``;
    - else (full mode): a HF folder of the critic model (adapters merged, as ``export_merged``)
      with ``score.weight`` / ``score.bias`` beside its weights, which a later run can take as
      ``config.critic.path``.
    """
    score = value_head_tensors(head)
    if lora is not None:
        return export_peft(critic, lora, path, version, base_model_name_or_path, head=score)

    def write(tmp: str) -> dict:
        write_config(tmp, critic, dtype)
        head = ((k, v.astype(dtype)) for k, v in score.items())
        shards = write_shards(itertools.chain(merged_tensors(critic, dtype), head), tmp)
        return {"dtype": np.dtype(dtype).name, "value_head": "score", **shards}

    return publish(path, version, "critic", write)


__all__ = ["MAX_SHARD_BYTES", "publish", "read_version", "export_peft", "export_base", "export_merged",
           "export_critic", "value_head_tensors", "peft_state", "merged_tensors", "merged_state_dict",
           "base_tensors", "base_state_dict", "dense_adapters", "weight_count", "write_shards"]
