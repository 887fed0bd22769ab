"""rlx: RL post-training of LLMs on JAX/XLA (full-parameter, or a frozen low-precision base + LoRA).

``rlx.build(config) -> Run`` assembles a run from a config (a ``configs/*.py`` ``get_config()``
result, a dict, or a parsed ``RunConfig``); ``run.step()``, ``run.train(n)``, ``run.evaluate()``,
``run.generate(texts)``, ``run.metrics``, ``run.close()``. Importing rlx loads nothing heavy.
"""

from __future__ import annotations


def build(config, **kwargs):
    """Assemble a ``rlx.run.loop.Run`` from ``config`` (see ``rlx.run.build.build``)."""
    from rlx.run.build import build as _build

    return _build(config, **kwargs)


__all__ = ["build"]
