"""Build the mesh and the model from a validated config and describe them (param count, bytes)."""

from __future__ import annotations

import jax
from flax import nnx

from rlx.config import RunConfig
from rlx.mesh import make_mesh
from rlx.models import load_from_section, param_bytes_per_device
from rlx.run.multihost import initialize_from


def build_and_summarize(cfg: RunConfig) -> str:
    initialize_from(cfg.distributed)
    from rlx.run.checks import check_before_build

    check_before_build(cfg, jax.device_count())
    mesh = make_mesh(cfg.mesh)
    loaded = load_from_section(cfg.model, mesh)
    model = loaded.model
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    per_device = param_bytes_per_device(model)
    c = model.config
    lines = [
        f"model      {c.architecture} from {loaded.format} {loaded.source}",
        f"params     {n_params:,} ({n_params * 1e-6:.1f}M); layers {c.num_layers}, hidden "
        f"{c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}, vocab {c.vocab_size}"
        + (f", experts {c.moe.num_experts} top-{c.moe.top_k}" if c.moe else ""),
        f"mesh       {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} devices",
        f"bytes/dev  max {max(per_device.values()) / 2**20:.2f} MiB, "
        f"min {min(per_device.values()) / 2**20:.2f} MiB, total {sum(per_device.values()) / 2**20:.2f} MiB",
        f"tokenizer  {'yes, vocab ' + str(loaded.tokenizer.vocab_size) if loaded.tokenizer else 'none'}",
    ]
    return "\n".join(lines)
