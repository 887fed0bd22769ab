"""DeepSeek-V4 in the run: ``rlx.models.from_hf`` and the run's model loading read a
``DeepseekV4ForCausalLM`` folder as rlx's ``DeepseekV4`` (logits against transformers 5.25 within
1e-4 relative, f32, also placed on a 4-device mesh). The tiny random model is
``tests.models.test_deepseek_v4``'s, where every feature binds."""

import json

import jax
import numpy as np
import pytest

from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf, from_hf_config
from rlx.models.deepseek_v4.model import DeepseekV4
from rlx.models.hparams import ModelConfigError
from rlx.models.loading import ModelSection, load_from_section
from tests.helpers.deepseek_v4 import TOL, hf_logits, ids_of, logits, make_v4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_v4(str(tmp_path_factory.mktemp("v4run")))


def test_from_hf_and_the_run_load_the_v4_folder(tiny):
    """``from_hf`` (on a 4-device fsdp x tensor mesh) and ``load_from_section`` give a
    ``DeepseekV4`` with transformers' logits; ``from_hf_config`` (the ``ModelConfig`` reader)
    names ``from_hf`` instead of calling the class unsupported."""
    mesh = make_mesh(MeshShape(fsdp=2, tensor=2), jax.devices()[:4])
    model = from_hf(tiny, mesh=mesh)
    assert isinstance(model, DeepseekV4)
    assert len(model.embed[...].sharding.device_set) == 4
    ids = ids_of()
    ref = hf_logits(tiny, ids)
    assert np.abs(logits(model, ids) - ref).max() <= TOL * np.abs(ref).max()
    assert isinstance(load_from_section(ModelSection(path=tiny), None).model, DeepseekV4)
    with open(f"{tiny}/config.json") as f:
        hf = json.load(f)
    with pytest.raises(ModelConfigError, match="DeepseekV4ForCausalLM has a decoder of its own"):
        from_hf_config(hf)
