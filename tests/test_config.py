"""Config parsing and validation: every error names the field and the fix."""

import ml_collections
import pytest

from rlx.config import RunConfig, parse_config
from rlx.errors import ConfigError


def _base(tmp_path) -> dict:
    return {"model": {"path": str(tmp_path)}, "mesh": {"data": 1}, "seed": 3}


def test_valid_config_becomes_frozen_dataclasses(tmp_path):
    cfg = parse_config(ml_collections.ConfigDict(_base(tmp_path)))
    assert isinstance(cfg, RunConfig) and cfg.seed == 3 and cfg.model.path == str(tmp_path)
    with pytest.raises(Exception):
        cfg.seed = 4  # frozen


@pytest.mark.parametrize("patch,needle", [
    ({"model": {"path": "/definitely/not/here"}}, "config.model.path"),
    ({"model": {"path": ""}}, "config.model.path is empty"),
    ({"model": {"dtype": "f16"}}, "config.model.dtype='f16' is not one of"),
    ({"model": {"moe_impl": "loop"}}, "config.model.moe_impl"),
    ({"mesh": {"tensor": 0}}, "config.mesh.tensor=0 must be >= 1"),
    ({"mesh": {"data": "two"}}, "config.mesh.data='two' has type str, expected int"),
    ({"mesh": {"data": True}}, "config.mesh.data=True has type bool"),
    ({"modle": {}}, "unknown key config.modle"),
    ({"model": {"pth": "x"}}, "unknown key config.model.pth"),
    # a benchmark's fixed-length rollouts are SamplingParams(ignore_eos=True), not a run setting
    ({"rollout": {"ignore_eos": True}}, "unknown key config.rollout.ignore_eos"),
    ({"distributed": {"enabled": True, "num_processes": 2, "process_id": 5}}, "config.distributed.process_id=5"),
])
def test_bad_values_name_the_field(tmp_path, patch, needle):
    d = _base(tmp_path)
    for section, values in patch.items():
        d.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_mesh_product_must_match_devices(tmp_path):
    cfg = parse_config({"model": {"path": str(tmp_path)}, "mesh": {"data": 2, "tensor": 2}})
    cfg.mesh.check_devices(4)
    with pytest.raises(ConfigError, match=r"2\*1\*2\*1 = 4, but 8 devices .* product is 8"):
        cfg.mesh.check_devices(8)


def test_package_path_resolves_and_missing_package_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="package 'no_such_pkg_xyz' is not installed"):
        parse_config({"model": {"path": "package://no_such_pkg_xyz/model.gguf"}})
    cfg = parse_config({"model": {"path": "package://rlx/config.py"}})  # any file inside a package
    assert cfg.model.resolved_format == "hf"
