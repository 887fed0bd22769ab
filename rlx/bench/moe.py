"""One MoE layer, forward + backward, on the 8-device CPU mesh: dense path vs token dispatch.

Rows: the one-device ragged path (all experts on one device), and on each mesh the dense path
(every expert on every token, experts split over ``expert`` by GSPMD) and token dispatch
(``rlx.models.moe_dispatch``) dropless and with a capacity factor. Columns: median seconds of a
jitted step computing the gradients of every parameter, and XLA's compiled FLOPs summed over the
devices (``cost_analysis``). XLA:CPU counts (and runs) ``ragged_dot`` as a masked product over
every group of the device, so the CPU FLOPs of the ragged rows are E (one device) or E/P (a
device's share) times the routed rows; with libtpu installed a last column gives XLA:TPU's FLOPs
for a v5p 2x2x2 topology (compiled ahead of time, no TPU needed), whose ``ragged_dot`` counts
the routed rows.

The 8 CPU devices share the host's cores: times compare the programs, not a real 8-chip mesh.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

MESHES = {"expert=8": dict(expert=8), "expert=4 x fsdp=2": dict(fsdp=2, expert=4)}
# (label, impl, capacity factor)
PATHS = (("dense", "dense", None), ("dispatch, dropless", "ragged", None),
         ("dispatch, capacity 1.25", "ragged", 1.25))


def _layer(args, impl: str):
    import jax.numpy as jnp
    from flax import nnx

    from rlx.models.hparams import MoEConfig
    from rlx.models.moe import SparseMoE

    m = MoEConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.ffn,
                  norm_topk_prob=True)
    return SparseMoE(args.hidden, m, dtype=jnp.float32, param_dtype=jnp.float32,
                     rngs=nnx.Rngs(0), impl=impl)


def _step(layer):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params = nnx.split(layer)

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) * x)

    return jax.jit(jax.grad(loss)), params


def _place(layer, mesh, capacity_factor):
    from flax import nnx

    from rlx.mesh import TRAIN_RULES, shard_variables
    from rlx.models.moe import expert_parallel

    if mesh is not None:
        shard_variables(layer, nnx.Param, mesh, TRAIN_RULES)
    return expert_parallel(layer, mesh, TRAIN_RULES, capacity_factor)


def measure(args, mesh_sizes: dict | None, impl: str, capacity_factor) -> dict:
    """Median seconds of ``args.repeats`` steps after one warm-up, and compiled FLOPs (all
    devices)."""
    import jax

    from rlx.mesh import MeshShape, batch_sharding, make_mesh

    shape = MeshShape(**(mesh_sizes or {}))
    mesh = make_mesh(shape, jax.devices()[:shape.num_devices]) if mesh_sizes else None
    layer = _place(_layer(args, impl), mesh, capacity_factor)
    step, params = _step(layer)
    x = jax.random.normal(jax.random.key(1), (args.tokens // 8, 8, args.hidden))
    if mesh is not None:
        x = jax.device_put(x, batch_sharding(mesh, 3))
    flops = step.lower(params, x).compile().cost_analysis()["flops"] * shape.num_devices
    jax.block_until_ready(step(params, x))
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(params, x))
        times.append(time.perf_counter() - t)
    out = {"seconds": statistics.median(times), "cpu_flops": flops}
    tpu = _tpu_flops(args, mesh_sizes, impl, capacity_factor)
    if tpu is not None:
        out["tpu_flops"] = tpu
    return out


def _tpu_flops(args, mesh_sizes, impl, capacity_factor) -> float | None:
    """XLA:TPU's FLOPs on a v5p 2x2x2 topology, or None without libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import topologies

    from rlx.mesh import TRAIN_RULES, MeshShape, batch_sharding, make_mesh, named_sharding
    from rlx.models.moe import expert_parallel

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices
    shape = MeshShape(**(mesh_sizes or {}))
    mesh = make_mesh(shape, list(devices)[:shape.num_devices])
    layer = nnx.eval_shape(lambda: _layer(args, impl))
    step, params = _step(expert_parallel(layer, mesh, TRAIN_RULES, capacity_factor))
    abstract = jax.tree.map(
        lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=named_sharding(
            mesh, v.get_metadata().get("logical_axes"), TRAIN_RULES, v.shape))),
        params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    x = jax.ShapeDtypeStruct((args.tokens // 8, 8, args.hidden), jnp.float32,
                             sharding=batch_sharding(mesh, 3))
    return step.lower(abstract, x).compile().cost_analysis()["flops"] * shape.num_devices


def run(args) -> list[tuple[str, str, dict]]:
    rows = [("one device", "ragged", measure(args, None, "ragged", None))]
    for mesh_name, sizes in MESHES.items():
        for label, impl, cf in PATHS:
            rows.append((mesh_name, label, measure(args, sizes, impl, cf)))
    return rows


def markdown(rows) -> str:
    from rlx.bench.harness import markdown_table

    tpu = all("tpu_flops" in r for _, _, r in rows)
    header = ["mesh", "path", "fwd+bwd s", "XLA:CPU GFLOP"] + (["XLA:TPU v5p GFLOP"] if tpu else [])
    body = [[mesh, label, f"{r['seconds']:.4f}", f"{r['cpu_flops'] / 1e9:.2f}"]
            + ([f"{r['tpu_flops'] / 1e9:.2f}"] if tpu else []) for mesh, label, r in rows]
    return markdown_table(header, body)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rlx.bench moe", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the batch (a multiple of 64)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="", help="write the figures to this file")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:  # the 8-device CPU mesh (the flag must precede jax's import)
        flag = "--xla_force_host_platform_device_count=8"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    from rlx.bench.harness import write_json

    if jax.device_count() < 8:
        raise SystemExit("rlx.bench moe needs 8 devices: run it with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    rows = run(args)
    print(markdown(rows))
    write_json(args.json or None, {"benchmark": "moe", "args": vars(args),
                                   "rows": [dict(mesh=m, path=lb, **r) for m, lb, r in rows]})
    return 0
