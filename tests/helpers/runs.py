"""Run configs of ``configs/*.py`` for tests: the file's ``get_config()`` with dotted overrides."""

import importlib.util
import os

from rlx.config import RunConfig, parse_config
from tests.helpers import ROOT


def config_dict(name: str, output_dir: str, **overrides) -> dict:
    """``configs/<name>.py``'s config as a dict, writing to ``output_dir``, with ``overrides``
    (``{"train.steps": 3, ...}``) applied."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config().to_dict()
    cfg["output_dir"] = str(output_dir)
    return override(cfg, **overrides)


def override(cfg: dict, **dotted) -> dict:
    """Set ``cfg[a][b] = value`` for every ``a.b=value`` (in place; returns ``cfg``)."""
    for key, value in dotted.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def run_config(name: str, tmp_path, **overrides) -> RunConfig:
    """The parsed config of ``configs/<name>.py`` writing under ``tmp_path / name``."""
    return parse_config(config_dict(name, tmp_path / name, **overrides))
