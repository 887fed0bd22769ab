"""The model layer: one decoder family (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3 with multi-head latent attention, GLM-4.5), each family described by its spec
(``rlx.models.families``), its checkpoint I/O (HF safetensors, GGUF), the tokenizer and chat
templates, and the ``config.model`` section (``loading.ModelSection``).

May import ``rlx.platform``, ``rlx.kernels`` and the foundation (``rlx.types``, ``rlx.errors``,
``rlx.mesh``); every other package above them builds on this one.
"""

from rlx.models.config import (MLAConfig, ModelConfig, ModelConfigError, MoEConfig, RopeConfig,
                               from_hf_config, to_hf_config)
from rlx.models.decoder import Precision, Transformer
from rlx.models.hf import from_hf, hf_state_dict, load_model, param_bytes_per_device, to_hf
from rlx.models.loading import LoadedModel, from_gguf, load_from_section
from rlx.models.safetensors_io import CheckpointError

__all__ = [
    "ModelConfig", "ModelConfigError", "MoEConfig", "MLAConfig", "RopeConfig", "from_hf_config",
    "to_hf_config", "Precision", "Transformer", "from_hf", "to_hf", "load_model", "hf_state_dict",
    "param_bytes_per_device", "CheckpointError", "from_gguf", "LoadedModel", "load_from_section",
]
