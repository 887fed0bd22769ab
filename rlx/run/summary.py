"""Build the mesh and the model from a validated config and describe them (param count, bytes).

The model is the run's base (``rlx.quant.load_base``): ``quant.format="shipped"`` loads a
quantized checkpoint as it is stored, int8 / int4 / ... quantize a float one while reading it."""

from __future__ import annotations

import math
import time

import jax
from flax import nnx

from rlx.config import RunConfig
from rlx.mesh import make_mesh
from rlx.models import param_bytes_per_device
from rlx.quant import GGUFTensor, QTensor, QuantWeight, load_base
from rlx.run.multihost import initialize_from


def build_and_summarize(cfg: RunConfig) -> str:
    from rlx.run.checks import check_before_build, with_warm_start

    cfg = with_warm_start(cfg)  # a PEFT folder's adapter is checked as the run would take it
    initialize_from(cfg.distributed)
    check_before_build(cfg, jax.device_count())
    mesh = make_mesh(cfg.mesh)
    start = time.perf_counter()
    loaded, quant = load_base(cfg.model, cfg.quant, mesh, seed=cfg.seed)
    seconds = time.perf_counter() - start
    model = loaded.model
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    n_quant = quantized_values(model)
    per_device = param_bytes_per_device(model, (nnx.Param, QuantWeight))
    c = model.config
    lines = [
        f"model      {c.architecture} from {loaded.format} {loaded.source}",
        f"base       {quant.format}" + (f" ({cfg.quant.format})" if cfg.quant.format != quant.format
                                         else "") + (f", {n_quant:,} quantized values"
                                                     if n_quant else "")
        + f"; loaded in {seconds:.1f} s",
        f"params     {n_params + n_quant:,} ({(n_params + n_quant) * 1e-6:.1f}M); layers {c.num_layers}, hidden "
        f"{c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}, vocab {c.vocab_size}"
        + (f", experts {c.moe.num_experts} top-{c.moe.top_k}" if c.moe else ""),
        f"mesh       {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} devices",
        f"bytes/dev  max {max(per_device.values()) / 2**20:.2f} MiB, "
        f"min {min(per_device.values()) / 2**20:.2f} MiB, total {sum(per_device.values()) / 2**20:.2f} MiB",
        f"tokenizer  {'yes, vocab ' + str(loaded.tokenizer.vocab_size) if loaded.tokenizer else 'none'}",
    ]
    return "\n".join(lines)


def quantized_values(model: nnx.Module) -> int:
    """How many values the quantized matrices of ``model`` (``QTensor``, ``GGUFTensor``) hold."""
    return sum(math.prod(node.shape) for _, node in nnx.iter_graph(model)
               if isinstance(node, (QTensor, GGUFTensor)))
