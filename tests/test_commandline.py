"""Every field of the run config can be overridden on the command line of every ``configs/*.py``,
whatever the file lists (``rlx.commandline.with_defaults``); an unknown field is one line on
stderr naming the closest field, exit status 2. Read in process through the parser that
``rlx.launch`` and ``rlx.eval`` hand to ``absl.app.run`` (``absl_flags_parser``); the commands
themselves in tests/test_launch.py."""

from __future__ import annotations

import glob
import os

import pytest

from rlx.commandline import absl_flags_parser, config_from_argv, load_config_file
from rlx.config import schema_fields
from tests.helpers import ROOT

CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
FIELDS = schema_fields()
EXAMPLE = {str: "zz", int: 7, float: 0.375}  # an optional field's value, by its inner type


def _other(tp, value):
    """A value of the field's type that differs from ``value`` (None: an optional field)."""
    if value is None:
        (inner,) = [a for a in tp.__args__ if a is not type(None)]
        return EXAMPLE[inner]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + (2 if isinstance(value, int) else 0.25)
    if isinstance(value, str):
        return value + "x"
    return (*value, "zz")  # a tuple of strings


def _argument(field: str, value) -> str:
    if isinstance(value, bool):
        return f"--config.{field}={str(value).lower()}"
    return f"--config.{field}={value!r}" if isinstance(value, tuple) else f"--config.{field}={value}"


def _get(cfg, field: str):
    for key in field.split("."):
        cfg = cfg[key]
    return cfg


def test_the_schema_is_walked():
    assert len(FIELDS) > 100 and {"train.steps", "optim.learning_rate", "model.shrink.enabled",
                                  "rollout.sglang.urls", "rollout.jax.batching"} <= set(FIELDS)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_field_of_every_section_can_be_overridden(path):
    """All fields at once on one command line: each ends as the new value, of its field's type,
    also those the file does not list (``train.advantage`` in tiny.py)."""
    base, _ = config_from_argv(["--config", path])
    wanted = {field: _other(tp, _get(base, field)) for field, (tp, _) in FIELDS.items()}
    cfg, rest = config_from_argv(["--config", path, *(_argument(f, v) for f, v in wanted.items())])
    assert rest == []
    for field, value in wanted.items():
        got = _get(cfg, field)
        assert got == value and type(got) is type(value), (field, got, value)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
@pytest.mark.parametrize("override,closest", [
    ("train.stepz=3", "train.steps"),  # a near spelling in its own section
    ("train.lr=-1", "learning_rate"),  # by initials
    ("train.temperature=0.5", "rollout.temperature"),  # the same name in another section
])
def test_an_unknown_field_is_one_line_naming_the_closest(path, override, closest, capsys):
    parse = absl_flags_parser("rlx")
    with pytest.raises(SystemExit) as e:
        parse(["rlx", "--config", path, f"--config.{override}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    dotted = override.split("=")[0]
    if closest == "learning_rate":  # the critic's and the optimizer's: those the file lists, or both
        listed = load_config_file(path)
        named = [f"{s}.learning_rate" for s in ("critic", "optim")
                 if "learning_rate" in listed.get(s, {})]
        closest = " or config.".join(named if len(named) == 1 else
                                     ["critic.learning_rate", "optim.learning_rate"])
    assert err.splitlines() == [f"rlx: config error: unknown key config.{dotted} "
                                f"(--config.{dotted}): no such field; the closest is "
                                f"config.{closest}"], err


def test_a_file_that_is_not_there_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        absl_flags_parser("rlx")(["rlx", "--config", "configs/nope.py"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "rlx: config error: --config configs/nope.py: no file 'configs/nope.py'; name a "
        "configs/*.py file"]


def test_an_int_in_the_file_is_read_as_its_float_field(tmp_path):
    """``lora.alpha = 8`` in a file: ``--config.lora.alpha=8.5`` is a float field's value."""
    path = tmp_path / "ints.py"
    path.write_text("def get_config():\n    return {'lora': {'alpha': 8}}\n")
    cfg, _ = config_from_argv(["--config", str(path), "--config.lora.alpha=8.5"])
    assert cfg.lora.alpha == 8.5
