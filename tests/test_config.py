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
    with pytest.raises(ConfigError, match=r"2\*1\*1\*2\*1 = 4, but 8 devices .* product is 8"):
        cfg.mesh.check_devices(8)


def test_package_path_resolves_and_missing_package_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="package 'no_such_pkg_xyz' is not installed"):
        parse_config({"model": {"path": "package://no_such_pkg_xyz/model.gguf"}})
    cfg = parse_config({"model": {"path": "package://rlx/config.py"}})  # any file inside a package
    assert cfg.model.resolved_format == "hf"


# --- the command line: --config FILE[:VARIANT] and --config.FIELD=VALUE (rlx.commandline.config_from_argv)

VARIANT_FILE = '''
import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in ("", "long"):
        raise ValueError(f"no variant {variant!r}; this file has '' and 'long'")
    c = ml_collections.ConfigDict()
    c.data = ml_collections.ConfigDict({"max_prompt_tokens": 512, "template": "{prompt}"})
    c.rollout = ml_collections.ConfigDict({"max_new_tokens": 30720 if variant else 1536,
                                           "temperature": 1.0})
    c.lora = ml_collections.ConfigDict({"targets": ("q", "v"), "experts": True})
    return c
'''


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "recipe.py"
    path.write_text(VARIANT_FILE)
    return str(path)


def test_command_line_reads_the_file_its_variant_and_overrides(config_file):
    """Each override is read as the type of the file's value (ml_collections' config_flags);
    arguments that are not about the config are left, in order, for the command's parser."""
    from rlx.commandline import config_from_argv

    cfg, rest = config_from_argv(["--config", config_file, "--dry_run",
                                  "--config.rollout.max_new_tokens=6144", "--aot", "tpu7x:2x2x2",
                                  "--config.rollout.temperature", "0.5", "--nocconfig.x",
                                  "--config.lora.targets=('q', 'k', 'o')",
                                  "--config.lora.experts=false"])
    assert rest == ["--dry_run", "--aot", "tpu7x:2x2x2", "--nocconfig.x"]
    assert cfg.rollout.max_new_tokens == 6144 and cfg.rollout.temperature == 0.5
    assert cfg.lora.targets == ("q", "k", "o") and cfg.lora.experts is False
    assert cfg.data.max_prompt_tokens == 512  # not overridden
    assert cfg.train.steps == 100  # not in the file: the run config's default
    long, _ = config_from_argv([f"--config={config_file}:long"])
    assert long.rollout.max_new_tokens == 30720  # get_config("long")
    assert config_from_argv(["--help"]) == (None, ["--help"])  # the command's parser says more


@pytest.mark.parametrize("args,needle", [
    (["--config.data.max_tokens=9"], "unknown key config.data.max_tokens (--config.data.max_tokens"
                                     "): no such field; the closest is config.data.max_prompt_tokens"),
    (["--config.datum.x=9"], "unknown key config.datum"),
    (["--config.data.max_prompt_tokens=1.5"],
     "flag --config.data.max_prompt_tokens=1.5: invalid literal for int()"),
    (["--config.lora.experts=maybe"], "config.lora.experts is True (bool)"),
    (["--config.data.max_prompt_tokens.x=9"], "config.data.max_prompt_tokens is no section"),
    (["--config.data=9"], "config.data is a section; override its fields"),
])
def test_a_bad_override_is_one_line_naming_the_field(config_file, args, needle):
    from rlx.commandline import config_from_argv

    with pytest.raises(ConfigError) as e:
        config_from_argv(["--config", config_file, *args])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_bad_file_or_variant_is_one_line(config_file, tmp_path):
    from rlx.commandline import config_from_argv

    with pytest.raises(ConfigError, match="no variant 'short'; this file has '' and 'long'"):
        config_from_argv(["--config", f"{config_file}:short"])  # the file's own refusal
    plain = tmp_path / "plain.py"
    plain.write_text("def get_config():\n    return {'a': 1}\n")
    with pytest.raises(ConfigError, match="has no variants .* drop ':long'"):
        config_from_argv(["--config", f"{plain}:long"])
    with pytest.raises(ConfigError, match="no file"):
        config_from_argv(["--config", str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match="overrides need the file"):
        config_from_argv(["--config.a=2"])
