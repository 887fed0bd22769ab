"""One rollout-engine protocol (``rlx.types.RolloutEngine``): both engines implement it, and the
run asks an engine for nothing else."""

import ast
import inspect
import os

from rlx.rollout.jax.engine import JaxEngine
from rlx.rollout.sglang.policy import SGLangPolicy
from rlx.types import RolloutEngine
from tests.helpers import ROOT
from tests.helpers.steps import tiny_model

METHODS = ("generate", "score", "update_weights", "close")
ATTRIBUTES = ("name", "weight_version")


def test_the_protocol_is_what_the_run_calls():
    members = {n for n in dir(RolloutEngine) if not n.startswith("_")} | set(
        RolloutEngine.__annotations__)
    assert members == set(METHODS + ATTRIBUTES)


def test_both_engines_have_the_protocols_methods_with_its_parameters():
    for cls in (JaxEngine, SGLangPolicy):
        for name in METHODS:
            want = list(inspect.signature(getattr(RolloutEngine, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, f"{cls.__name__}.{name}{got} vs the protocol's {want}"
        assert isinstance(cls.name, str)
    assert isinstance(SGLangPolicy.__dict__["weight_version"], property)


def test_a_built_in_engine_is_a_rollout_engine():
    engine = JaxEngine(tiny_model(0))
    assert isinstance(engine, RolloutEngine) and engine.name == "jax" and engine.weight_version == 0
    engine.close()


def _engine_attributes(path: str) -> set[str]:
    """Attributes read from anything named ``engine`` (``self.engine.x``, ``engine.x``)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if name == "engine":
                out.add(node.attr)
    return out


def test_the_run_and_the_stages_call_only_the_protocol():
    used = set()
    for folder in ("run", "data", "envs"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, "rlx", folder)):
            used |= {a for f in files if f.endswith(".py")
                     for a in _engine_attributes(os.path.join(dirpath, f))}
    assert used and used <= set(METHODS + ATTRIBUTES), used - set(METHODS + ATTRIBUTES)
