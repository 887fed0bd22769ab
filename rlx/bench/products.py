"""``python -m rlx.bench products``: the bare matrix products of one decode step, XLA vs PyTorch.

A ceiling under every engine on a machine: one decode step multiplies a ``[batch, d_in]``
activation by every projection of every layer (q, k, v, o, gate, up, down) and by the LM head.
Each side here does only that, with the model's shapes and random f32 weights (no attention,
norms, KV cache or sampling), so ``batch / step time`` bounds the tokens/s of any decoder built
on that side's matrix products:

* ``xla``: activations ``[batch, d_in]`` times weights ``[d_in, d_out]`` (rlx's layout), the
  layers as a compiled ``lax.scan``, as rlx's decode step runs them;
* ``xla-feature-major``: weights ``[d_out, d_in]`` times activations ``[d_in, batch]``, the same
  products with the other operand order (XLA:CPU picks other kernels);
* ``xla-out-in``: activations ``[batch, d_in]`` times weights stored ``[d_out, d_in]`` (the layout
  of a torch ``nn.Linear`` and of HF / GGUF files), contracted over ``d_in``;
* ``xla-in-out-features``: weights ``[d_in, d_out]`` (rlx's) and activations ``[d_in, batch]``;
* ``xla-engine``: what rlx's built-in engine runs on a CPU (``rlx.models.mixed.matmul_out_in``):
  weights ``[d_out, d_in]``, activations ``[batch, d_in]`` transposed around each product behind
  optimization barriers (so XLA keeps the feature-major kernel);
* ``xla-fused``: rlx's layout with q/k/v as one ``[d_in, q + 2 kv]`` product and gate/up as one
  ``[d_in, 2 f]`` product (five products a layer instead of seven);
* ``torch``: ``torch.matmul`` in a Python loop over the layers, ``[batch, d_in] x [d_in, d_out]``
  (what HF ``generate`` calls), torch's default threads.

Each side runs ``--steps`` decode steps per repetition in its own worker process, interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from rlx.bench.harness import OMP_DEFAULT_ENV, Side, interleave, markdown_table, write_json
from rlx.bench.workloads import MODELS

SIDES = ("xla", "xla-feature-major", "xla-out-in", "xla-in-out-features", "xla-engine", "xla-fused",
         "torch")
HEADER = ["side", "ms per step", "GFLOP/s", "tokens/s ceiling", "vs torch"]


@dataclasses.dataclass(frozen=True)
class Shapes:
    """A Llama block's projection widths, the layer count and the LM head (JSON-able)."""

    layers: int
    hidden: int
    q_width: int
    kv_width: int
    intermediate: int
    vocab: int

    def linears(self) -> list[tuple[str, int, int]]:
        h, q, kv, f = self.hidden, self.q_width, self.kv_width, self.intermediate
        return [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, f),
                ("up", h, f), ("down", f, h)]

    def flops(self, batch: int) -> float:
        per_layer = sum(i * o for _, i, o in self.linears())
        return 2.0 * batch * (self.layers * per_layer + self.hidden * self.vocab)


def model_shapes(name: str) -> Shapes:
    """The shapes of ``smollm2`` (its GGUF header) or ``tiny`` (``configs/tiny.py``'s shrink)."""
    from rlx.bench.workloads import smollm2_config, tiny_model
    from rlx.models import from_hf_config

    hf = smollm2_config()
    c = tiny_model(hf).config if name == "tiny" else from_hf_config(hf)
    return Shapes(c.num_layers, c.hidden_size, c.num_heads * c.head_dim,
                  c.num_kv_heads * c.head_dim, c.intermediate_size, c.vocab_size)


def _weights(s: Shapes, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    layers = {n: (0.02 * rng.standard_normal((s.layers, i, o))).astype(np.float32)
              for n, i, o in s.linears()}
    return layers, (0.02 * rng.standard_normal((s.hidden, s.vocab))).astype(np.float32)


def _fuse(layers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """q/k/v and gate/up concatenated along their outputs (the same products, fewer calls)."""
    return {"qkv": np.concatenate([layers[n] for n in ("q", "k", "v")], axis=-1),
            "gu": np.concatenate([layers["gate"], layers["up"]], axis=-1),
            "o": layers["o"], "down": layers["down"]}


def _fused_layer(x, lw, q_width: int):
    import jax
    import jax.numpy as jnp

    qkv = x @ lw["qkv"]
    q, kv = qkv[:, :q_width], qkv[:, q_width:]
    x = x + 0.01 * (q @ lw["o"]) + 0.01 * jnp.sum(kv)
    gate, up = jnp.split(x @ lw["gu"], 2, axis=1)
    return x + 0.01 * ((jax.nn.silu(gate) * up) @ lw["down"])


# layout -> (weights stored [d_out, d_in]?, activations [d_in, batch]?, einsum of one product)
LAYOUTS = {"in-out": (False, False, "bi,io->bo"), "out-in-features": (True, True, "oi,ib->ob"),
           "out-in": (True, False, "bi,oi->bo"), "in-out-features": (False, True, "io,ib->ob"),
           "engine": (True, False, "")}  # rlx.models.mixed.matmul_out_in


def xla_side(shapes: dict, batch: int, steps: int, layout: str = "in-out",
             fused: bool = False, seed: int = 0):
    """Worker factory: the products of ``steps`` decode steps as one compiled scan per step, in
    one of ``LAYOUTS`` (``fused`` with ``in-out`` only)."""
    import jax
    import jax.numpy as jnp

    s = Shapes(**shapes)
    out_in, features, spec = LAYOUTS[layout]
    layers, head = _weights(s, seed)
    if out_in:  # weights stored [d_out, d_in]
        layers = {n: np.ascontiguousarray(w.transpose(0, 2, 1)) for n, w in layers.items()}
        head = np.ascontiguousarray(head.T)
    if fused:
        layers = _fuse(layers)
    w, head = jax.device_put(layers), jax.device_put(head)
    if layout == "engine":
        from rlx.models.mixed import matmul_out_in

        def mul(w, x):
            return matmul_out_in(x, w, jnp.float32)
    elif features:
        def mul(w, x):
            return jnp.einsum(spec, w, x)
    else:
        def mul(w, x):
            return jnp.einsum(spec, x, w)
    width = 0 if features else 1  # the feature axis of activations

    def step(w, head, x):
        def layer(x, lw):
            if fused:
                return _fused_layer(x, lw, s.q_width), None
            q, k, v = mul(lw["q"], x), mul(lw["k"], x), mul(lw["v"], x)
            x = x + 0.01 * mul(lw["o"], q)  # k, v feed no product: keep them alive via the sum
            x = x + 0.01 * (jnp.sum(k) + jnp.sum(v))
            m = jax.nn.silu(mul(lw["gate"], x)) * mul(lw["up"], x)
            return x + 0.01 * mul(lw["down"], m), None

        x, _ = jax.lax.scan(layer, x, w)
        return jnp.argmax(mul(head, x), axis=width)

    run_step = jax.jit(step)
    shape = (s.hidden, batch) if features else (batch, s.hidden)
    x = jax.device_put(np.random.default_rng(seed + 1).standard_normal(shape).astype(np.float32))
    run_step(w, head, x).block_until_ready()  # compile in setup

    def run() -> dict:
        t = time.perf_counter()
        for _ in range(steps):
            out = run_step(w, head, x)
        out.block_until_ready()
        return {"steps": float(steps), "seconds": time.perf_counter() - t}

    return run


def torch_side(shapes: dict, batch: int, steps: int, seed: int = 0):
    """Worker factory: the same products with ``torch.matmul``, no autograd."""
    import torch

    s = Shapes(**shapes)
    layers, head = _weights(s, seed)
    per_layer = [{n: torch.from_numpy(w[i]) for n, w in layers.items()} for i in range(s.layers)]
    head_t = torch.from_numpy(head)
    x0 = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal(
        (batch, s.hidden)).astype(np.float32))

    @torch.no_grad()
    def step():
        x = x0
        for lw in per_layer:
            q, k, v = x @ lw["q"], x @ lw["k"], x @ lw["v"]
            x = x + 0.01 * (q @ lw["o"]) + 0.01 * (k.sum() + v.sum())
            m = torch.nn.functional.silu(x @ lw["gate"]) * (x @ lw["up"])
            x = x + 0.01 * (m @ lw["down"])
        return torch.argmax(x @ head_t, dim=1)

    step()

    def run() -> dict:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        return {"steps": float(steps), "seconds": time.perf_counter() - t}

    return run


def build_sides(names, shapes: Shapes, batch: int, steps: int) -> list[Side]:
    kw = {"shapes": dataclasses.asdict(shapes), "batch": batch, "steps": steps}
    targets = {"xla": ("rlx.bench.products:xla_side", {}),
               "xla-feature-major": ("rlx.bench.products:xla_side", {"layout": "out-in-features"}),
               "xla-out-in": ("rlx.bench.products:xla_side", {"layout": "out-in"}),
               "xla-in-out-features": ("rlx.bench.products:xla_side", {"layout": "in-out-features"}),
               "xla-engine": ("rlx.bench.products:xla_side", {"layout": "engine"}),
               "xla-fused": ("rlx.bench.products:xla_side", {"fused": True}),
               "torch": ("rlx.bench.products:torch_side", {})}
    return [Side(n, targets[n][0], {**kw, **targets[n][1]}, OMP_DEFAULT_ENV if n == "torch" else {})
            for n in names]


def table_rows(results, labels, shapes: Shapes, batch: int) -> list[list]:
    """Per side: ms per step, GFLOP/s, batch / step time, speed relative to torch."""
    per_step = {n: 1.0 / results.rate(n, "steps") for n in labels}
    rows = []
    for n in labels:
        t = per_step[n]
        ratio = f"{per_step['torch'] / t:.2f}x" if "torch" in per_step else "-"
        rows.append([n, t * 1e3, shapes.flops(batch) / t / 1e9, batch / t, ratio])
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlx.bench products", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=MODELS)
    p.add_argument("--batch", type=int, default=16, help="rows per decode step")
    p.add_argument("--steps", type=int, default=20, help="decode steps per repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {SIDES}")
    p.add_argument("--json", default="", help="write every figure to this file")
    return p


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    names = tuple(n.strip() for n in a.sides.split(",") if n.strip())
    bad = [n for n in names if n not in SIDES]
    if bad or not names:
        raise SystemExit(f"--sides: {bad or a.sides!r} not in {SIDES}")
    if min(a.batch, a.steps, a.repeats) < 1:
        raise SystemExit("--batch, --steps and --repeats must all be >= 1")
    shapes = model_shapes(a.model)
    results = interleave(build_sides(names, shapes, a.batch, a.steps), a.repeats, a.warmup)
    rows = table_rows(results, names, shapes, a.batch)
    print(f"\n### matrix products of one decode step: {a.model}, batch {a.batch}, "
          f"{shapes.flops(a.batch) / 1e9:.2f} GFLOP per step\n")
    print(markdown_table(HEADER, rows))
    write_json(a.json or None, {"benchmark": "products", "model": a.model, "batch": a.batch,
                                "shapes": dataclasses.asdict(shapes), "header": HEADER,
                                "rows": rows, **results.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
