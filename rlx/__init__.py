"""rlx: RL post-training of LLMs on JAX/XLA (full-parameter, or a frozen low-precision base + LoRA).

``rlx.build(config) -> Run`` assembles a run from a config (``rlx.load_config("configs/X.py")``, a
``get_config()`` result, a dict, or a parsed ``RunConfig``); ``run.step()``, ``run.train(n)``,
``run.evaluate()``, ``run.generate(texts)``, ``run.metrics``, ``run.close()``. Importing rlx loads
nothing heavy.
"""

from __future__ import annotations


def load_config(spec: str):
    """The ``ConfigDict`` of ``configs/X.py`` (``get_config()``) or ``configs/X.py:VARIANT``
    (``get_config("VARIANT")``), as the command line reads it (``rlx.commandline.load_config_file``):
    a relative path is also looked up in the source tree rlx runs from, so ``configs/...`` works
    from any folder."""
    from rlx.commandline import load_config_file

    return load_config_file(spec)


def build(config, **kwargs):
    """Assemble a ``rlx.run.loop.Run`` from ``config`` (see ``rlx.run.build.build``)."""
    from rlx.run.build import build as _build

    return _build(config, **kwargs)


__all__ = ["build", "load_config"]
