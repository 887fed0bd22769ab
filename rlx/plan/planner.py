"""Memory planner: ``python -m rlx.plan --config configs/X.py[:VARIANT] [--config.FIELD=VALUE ...]
[--mesh data=1,fsdp=8] [--hbm-gb 192 --devices 8] [--mode full|lora] [--compiled]``.

Prints bytes per device for the frozen base, trainable params, gradients, AdamW state, full
mode's frozen reference copy of the params (``loss.kl_coef > 0`` or DPO), PPO's critic and its
AdamW state (``critic.enabled``), the frozen reward model (``train.reward="reward_model"``, sized
from its folder's config.json), activations (with the remat choice), log-prob chunks, the batch,
the built-in engine's own weights (it shares the frozen base) and KV cache, and
the load transient; whether the peaks of the train step, of sampling and of loading fit the
device memory; and, when they do not, which knob to turn (remat, micro-batches, chunk size,
rollout shape) or how many nodes of ``--devices`` devices the run needs (FSDP over more devices).

Everything is computed from abstract shapes (``jax.eval_shape``); no weights are read. Small
models can also be compiled (``--compiled``) and XLA's memory analysis is printed beside.

The config file's ``get_config()`` supplies ``model.hf_config`` (a transformers ``config.json``
dict; or ``model.path`` to a folder holding one, or naming an ``rlx.models.presets`` entry),
``mesh.*``, ``quant.*``, ``lora.*`` and a ``plan`` section with the remaining ``PlanSpec`` fields
(mode, dtypes, rows, seq_len, ...). Every section but ``plan`` is read as the run's own
(``rlx.config.read_config``: a ``RunConfig``, its defaults where the file is silent). A run config
(no ``plan`` section) is planned as the run it describes (``run_plan_fields``); ``--hbm-gb`` and
``--devices`` then name the machine. The config file, its variant and its overrides are read as
``python -m rlx.launch`` reads them (``rlx.commandline.config_from_argv``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from rlx.commandline import HELP, config_from_argv, load_config_file
from rlx.config import RunConfig, read_config
from rlx.errors import ConfigError
from rlx.learner.batching import micro_rows
from rlx.learner.state import MODES
from rlx.mesh import MESH_AXES, MeshShape, batch_shards
from rlx.models import from_hf_config
from rlx.models.classifier import read_classifier_config
from rlx.models.loading import resolve_path, shrunk
from rlx.models.presets import PRESETS, find_preset, preset_config
from rlx.plan.memory import compiled_bytes, state_bytes, step_bytes
from rlx.plan.spec import PlanSpec
from rlx.platform.policy import policy_for
from rlx.rollout.jax.decode_layout import resolve_layout

GB = 1e9
RESERVE = 0.08  # of device memory kept for the runtime, collectives and fragmentation
# the built-in engine's own weights ("engine": an asynchronous run's copy of the trainable
# variables; it shares the frozen base, and a synchronous run's trainable variables too)
# live through the whole run: one-step-off sampling reads them while the learner updates
TRAIN_KEYS = ("frozen", "trainable", "optimizer", "reference", "critic", "critic_optimizer",
              "engine", "reward_model", "grads", "activations", "fsdp_gather", "logprob_chunks",
              "batch")
SAMPLE_KEYS = ("frozen", "trainable", "optimizer", "reference", "critic", "critic_optimizer",
               "engine", "reward_model", "kv_cache", "decode_temp")
# building the run: the base streamed in tensor by tensor, adapters attached, one tensor in flight
LOAD_KEYS = ("frozen", "trainable", "load_tensor")
# a weight sync: the engine places its new copy (resharded on the devices) before it lets the
# old one go, between generate calls and after the update (no step transient alive)
SYNC_KEYS = ("frozen", "trainable", "optimizer", "reference", "critic", "critic_optimizer",
             "engine", "reward_model", "engine_sync")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes by category, the phases' peaks (train, sample, load, weight sync), and
    the verdict."""

    spec: PlanSpec
    bytes: dict[str, int]
    hbm_bytes: float

    @property
    def train_peak(self) -> int:
        return sum(self.bytes[k] for k in TRAIN_KEYS)

    @property
    def sample_peak(self) -> int:
        return sum(self.bytes[k] for k in SAMPLE_KEYS)

    @property
    def load_peak(self) -> int:
        return sum(self.bytes[k] for k in LOAD_KEYS)

    @property
    def sync_peak(self) -> int:
        return sum(self.bytes[k] for k in SYNC_KEYS)

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.sample_peak, self.load_peak, self.sync_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm_bytes * (1 - RESERVE)


def plan(spec: PlanSpec, hbm_gb: float) -> Plan:
    """The analytic plan of ``spec`` on devices of ``hbm_gb`` GB each."""
    state = state_bytes(spec)
    # the reshard transient of a weight sync: the engine's new copy beside the old one
    return Plan(spec, {**state, **step_bytes(spec, state["trainable"]),
                       "engine_sync": state["engine"]}, hbm_gb * GB)


def nodes_needed(spec: PlanSpec, hbm_gb: float, max_nodes: int = 256) -> int | None:
    """Smallest k such that ``spec`` with FSDP over k times its devices fits (None: none <= max)."""
    for k in range(1, max_nodes + 1):
        mesh = dataclasses.replace(spec.mesh, fsdp=spec.mesh.fsdp * k)
        if plan(spec.replace(mesh=mesh), hbm_gb).fits:
            return k
    return None


def advice(p: Plan, devices_per_node: int) -> list[str]:
    """Knobs that shrink the biggest categories, most effective first."""
    if p.fits:
        return []
    s, b, tips = p.spec, p.bytes, []
    if p.train_peak >= p.sample_peak:
        if s.remat == "none" and b["activations"] > 0.1 * p.peak:
            tips.append("set plan.remat='layer' (keeps one layer's activations at a time)")
        if b["activations"] > 0.2 * p.peak and s.micro_rows > 1:
            tips.append(f"raise plan.micro_batches (now {s.micro_batches}) or lower plan.seq_len")
        elif b["activations"] > 0.2 * p.peak and s.mesh.tensor * s.mesh.expert > 1:
            tips.append("split each sequence over context-parallel devices (mesh.context, taken "
                        "from mesh.tensor or mesh.expert)")
        if b["logprob_chunks"] > 0.1 * p.peak:
            tips.append(f"lower plan.logprob_chunk (now {s.logprob_chunk})")
    elif b["kv_cache"] > 0.1 * p.peak:
        tips.append("lower plan.rollout_rows or plan.rollout_len (KV cache), or use SGLang")
    if s.mode == "full" and b["optimizer"] + b["trainable"] > 0.3 * p.peak:
        tips.append("train LoRA adapters on a frozen base (plan.mode='lora', quant.format='int4')")
    k = nodes_needed(s, p.hbm_bytes / GB)
    if k and k > 1:
        n = k * s.mesh.num_devices
        tips.append(f"or use {k}x the devices: mesh fsdp={s.mesh.fsdp * k}, {n} devices = "
                    f"{math.ceil(n / devices_per_node)} nodes of {devices_per_node}")
    elif k is None:
        tips.append("does not fit even on 256 nodes; shrink the model or the batch")
    return tips


def format_plan(p: Plan, compiled: dict[str, int] | None = None, devices_per_node: int = 8) -> str:
    s, m = p.spec, p.spec.mesh
    lines = [f"model      {s.model.architecture}, {s.model.num_params() / 1e9:.2f}B params; mode "
             f"{s.mode}" + (f", base {s.quant.format} + LoRA r{s.lora.rank}" if s.mode == "lora" else
                            f", {s.param_dtype} + AdamW"),
             "mesh       " + ", ".join(f"{a}={v}" for a, v in zip(MESH_AXES, m.sizes))
             + f" ({m.num_devices} devices), remat={s.remat}, rows={s.rows}x{s.seq_len}, "
             f"micro_batches={s.micro_batches}",
             "per device (GB)"]
    for key in dict.fromkeys(TRAIN_KEYS + SAMPLE_KEYS + LOAD_KEYS + SYNC_KEYS):
        if (key.startswith("critic") and not s.critic or key == "reference" and not p.bytes[key]
                or key == "reward_model" and not s.reward_model):
            continue
        lines.append(f"  {key:15s} {p.bytes[key] / GB:10.3f}")
    lines.append(f"  {'train peak':15s} {p.train_peak / GB:10.3f}")
    lines.append(f"  {'sample peak':15s} {p.sample_peak / GB:10.3f}")
    lines.append(f"  {'load peak':15s} {p.load_peak / GB:10.3f}")
    lines.append(f"  {'sync peak':15s} {p.sync_peak / GB:10.3f}")
    if compiled:
        lines.append(f"  {'XLA compiled':15s} {compiled['total'] / GB:10.3f}  (train step: "
                     f"arguments {compiled['argument'] / GB:.3f}, temp {compiled['temp'] / GB:.3f})")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"verdict    {verdict}: peak {p.peak / GB:.1f} GB of {p.hbm_bytes / GB:.0f} GB "
                 f"({RESERVE:.0%} reserved)")
    lines += [f"knob       {t}" for t in advice(p, devices_per_node)]
    return "\n".join(lines)


def _section(cfg: Any, name: str) -> dict[str, Any]:
    sub = cfg.get(name) if hasattr(cfg, "get") else None
    if sub is None:
        return {}
    return dict(sub.to_dict() if hasattr(sub, "to_dict") else sub)


def _hf_config(model: dict[str, Any]) -> dict[str, Any]:
    """``model.hf_config``, the ``config.json`` of the folder ``model.path``, the header of the
    ``.gguf`` file it names (``package://`` too), or the architecture preset that path names
    (``rlx.models.presets``; no download)."""
    if model.get("hf_config"):
        return dict(model["hf_config"])
    path = model.get("path", "")
    if path.endswith(".gguf"):
        from rlx.models.gguf import read_gguf

        return dict(read_gguf(resolve_path(path, hub=False)).hf_config)
    cfg_json = os.path.join(os.path.expanduser(path), "config.json") if path else ""
    if cfg_json and os.path.exists(cfg_json):
        with open(cfg_json) as f:
            return json.load(f)
    preset = find_preset(path) if path else None
    if preset is None:
        raise ValueError("the planner needs config.model.hf_config (a config.json dict), "
                         "config.model.path pointing at a folder with config.json, or a path "
                         f"naming one of the presets {sorted(PRESETS)}")
    return preset_config(preset)


def _gguf_types(model: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Each tensor's GGUF type in the header of the ``.gguf`` file ``model.path`` names."""
    from rlx.models.gguf import read_gguf

    path = model.get("path", "")
    if not path.endswith(".gguf"):
        raise ValueError(f"config.quant.format='gguf' keeps a GGUF file's blocks; config.model."
                         f"path={path!r} names no .gguf file")
    return tuple(sorted(read_gguf(resolve_path(path, hub=False)).tensor_types.items()))


def run_sections(cfg: Any) -> RunConfig:
    """The run sections of a ``get_config()`` (all but ``plan`` and ``model.hf_config``) as
    ``rlx.config`` reads them (``read_config``: known keys, types, each section's checks; nothing
    is looked up on this machine)."""
    raw = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    raw.pop("plan", None)
    if "model" in raw:
        raw["model"] = {k: v for k, v in dict(raw["model"]).items() if k != "hf_config"}
    return read_config(raw)


def run_plan_fields(run: RunConfig) -> dict[str, Any]:
    """``PlanSpec`` fields of a run config (one without a ``plan`` section): one optimizer
    update's rows (``prompts_per_step x group_size / minibatches``) of ``max_prompt_tokens +
    max_new_tokens`` tokens, the train section's mode, micro-batches, log-prob chunk and remat,
    whether the built-in engine copies the trainable variables (``engine_copies_trainables``),
    and the built-in engine decoding the whole batch at once (KV cache in the compute dtype).
    With ``train.tokens_per_micro_batch`` the update's rows and micro-batches are those of its
    worst case (``budget_fields``)."""
    data, rollout, train = run.data, run.rollout, run.train
    rows = data.prompts_per_step * rollout.group_size
    length = data.max_prompt_tokens + rollout.max_new_tokens
    fields = {"mode": train.mode, "micro_batches": train.micro_batches,
              "logprob_chunk": train.logprob_chunk, "remat": train.remat,
              "engine_copies_trainables": run.engine_copies_trainables, "rollout_rows": rows,
              "rows": rows // train.minibatches, "seq_len": length, "rollout_len": length,
              "rollout_prompt": data.max_prompt_tokens,
              "kv_dtype": run.model.dtype, "batching": rollout.jax.batching,
              "page_size": rollout.jax.page_size, "kv_pages": rollout.jax.kv_pages,
              "rollout_group": rollout.group_size,
              # weight_layout="auto" as a TPU run resolves it (XLA:CPU's out_in holds a
              # transposed copy of every trainable kernel: plan a CPU run with
              # --config.rollout.weight_layout=out_in)
              "decode_layout": resolve_layout(rollout.weight_layout, policy_for("tpu"))}
    if train.tokens_per_micro_batch:
        fields.update(budget_fields(rows // train.minibatches, length, run))
    return fields


def budget_fields(rows: int, length: int, run: RunConfig) -> dict[str, int]:
    """An update's ``rows``, ``seq_len`` and ``micro_batches`` under the token budget
    ``train.tokens_per_micro_batch`` (``rlx.learner.batching.batch_layout``), at its worst: every
    rollout ``length`` tokens long. Packed rows of the budget (or of ``length`` when longer) hold
    as many whole rollouts as fit, one row per data-parallel shard per micro-batch; padded rows
    go as many per shard as fit the budget."""
    tokens, shards = run.train.tokens_per_micro_batch, batch_shards(run.mesh)
    seq = max(tokens, length) if run.train.pack else length
    packed_rows = -(-rows // (seq // length))  # rows of seq tokens holding whole rollouts
    per_micro = shards * (1 if run.train.pack else micro_rows(length, tokens))
    micro = -(-packed_rows // per_micro)
    return {"rows": per_micro * micro, "seq_len": seq, "micro_batches": micro}


def spec_from_config(cfg: Any) -> PlanSpec:
    """Build a ``PlanSpec`` from a ``get_config()`` ConfigDict (or nested dict): the architecture
    (``_hf_config``), the run's sections as ``rlx.config`` reads them (``run_sections``), and the
    ``plan`` section's fields or, for a run config, those of the run it describes."""
    fields = {f.name for f in dataclasses.fields(PlanSpec)}
    plan_section = _section(cfg, "plan")
    unknown = set(plan_section) - fields - {"hbm_gb", "devices_per_node"}
    if unknown:
        raise ValueError(f"unknown key config.plan.{sorted(unknown)[0]}; known: {sorted(fields)}")
    model = _section(cfg, "model")
    arch = from_hf_config(_hf_config(model), text_only=bool(model.get("text_only", False)))
    run = run_sections(cfg)
    if run.model.shrink.enabled:  # the run's random shrunken copy of that architecture
        arch = shrunk(arch, run.model.shrink)
    extra = ({k: v for k, v in plan_section.items() if k in fields} if plan_section
             else run_plan_fields(run))  # a run config: the plan of the run it describes
    for key in ("dtype", "param_dtype", "moe_impl", "moe_capacity_factor", "scan_layers"):
        extra.setdefault(key, getattr(run.model, key))
    extra.setdefault("critic", run.critic.enabled)  # PPO's critic, as the run would build it
    extra.setdefault("reference", run.loss.kl_coef > 0 or run.train.algorithm == "dpo")
    if run.train.reward == "reward_model" and run.reward_model.path:  # its config.json's sizes
        rm = read_classifier_config(resolve_path(run.reward_model.path))
        extra.setdefault("reward_model", rm.body)
        extra.update(reward_model_labels=rm.num_labels, reward_model_dtype=run.reward_model.dtype)
    if run.quant.spec.keeps_file_blocks:  # the GGUF file's blocks, by the types in its header
        extra.setdefault("gguf_types", _gguf_types(_section(cfg, "model")))
    return PlanSpec(model=arch, quant=run.quant, lora=run.lora, mesh=run.mesh, **extra)


def parse_mesh(text: str) -> MeshShape:
    """``data=1,fsdp=8`` -> MeshShape; axes not named are 1."""
    sizes = {a: 1 for a in MESH_AXES}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in sizes:
            raise ValueError(f"--mesh axis {name!r} is not one of {MESH_AXES}")
        sizes[name] = int(value)
    return MeshShape(**sizes)


def command_line(argv, parser: argparse.ArgumentParser) -> tuple[Any, argparse.Namespace]:
    """The config of ``--config configs/X.py[:VARIANT] [--config.FIELD=VALUE ...]``, read as
    ``python -m rlx.launch`` reads it (``rlx.commandline.config_from_argv``; a bad file or override
    raises its ``ConfigError``), and ``parser``'s options from the other arguments; ``--help``
    prints the parser's help whatever else is given."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP for a in argv):
        parser.parse_args(["--help"])
    cfg, rest = config_from_argv(argv)
    args = parser.parse_args(rest)
    if cfg is None:
        parser.error("the config file is required: --config configs/X.py")
    return cfg, args


CONFIG_HELP = ("configs/*.py file with get_config(); configs/X.py:VARIANT calls "
               "get_config('VARIANT'); --config.FIELD=VALUE overrides a field as in rlx.launch")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlx.plan", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", metavar="configs/X.py[:VARIANT]", help=CONFIG_HELP)
    p.add_argument("--mesh", default="", help="override the mesh, e.g. data=1,fsdp=8")
    p.add_argument("--hbm-gb", type=float, default=None, help="memory per device (default: "
                   "config.plan.hbm_gb or 80)")
    p.add_argument("--devices", type=int, default=None, help="devices per node (default: the "
                   "mesh size); a mesh without --mesh becomes fsdp=DEVICES")
    p.add_argument("--mode", choices=tuple(MODES), default=None, help="override config.plan.mode")
    p.add_argument("--compiled", action="store_true", help="also compile the train step on "
                   "local devices and print XLA's memory analysis (small models)")
    p.add_argument("--aot", metavar="TOPOLOGY", help="instead compile the real train and generate "
                   "steps for a TPU topology (e.g. tpu7x:2x2x2) on this host and print XLA:TPU's "
                   "memory per device beside the plan (rlx.plan.aot; needs libtpu: pip install -e "
                   "'.[tpu-aot]'); its own options: --aot TOPOLOGY --help")
    return p


def main(argv=None) -> int:
    try:
        cfg, args = command_line(argv, _parser())
    except ConfigError as e:
        print(f"rlx.plan: config error: {e}", file=sys.stderr)
        return 2
    try:
        spec = spec_from_config(cfg)
        if args.mode:
            spec = spec.replace(mode=args.mode)
        if args.mesh:
            spec = spec.replace(mesh=parse_mesh(args.mesh))
        elif args.devices and args.devices != spec.mesh.num_devices:
            spec = spec.replace(mesh=MeshShape(fsdp=args.devices))
    except (ValueError, TypeError, OSError) as e:  # OSError: a model file that is not there
        print(f"rlx.plan: {e}", file=sys.stderr)
        return 2
    extra = _section(cfg, "plan")
    hbm = args.hbm_gb or extra.get("hbm_gb", 80.0)
    per_node = args.devices or extra.get("devices_per_node", spec.mesh.num_devices)
    p = plan(spec, hbm)
    compiled = compiled_bytes(spec) if args.compiled else None
    print(format_plan(p, compiled, per_node))
    return 0 if p.fits else 1
