"""The memory planner: per-device bytes of a run before anything is loaded or compiled.

Owns ``PlanSpec`` (``spec``: what is planned, built abstractly), the byte counts (``memory``: exact
state sizes, the calibrated step model, XLA's own analysis), the verdict with its advice
(``planner``; ``python -m rlx.plan``) and XLA:TPU's figures compiled ahead of time for a TPU
topology (``aot``; ``--aot``). May import ``rlx.config`` (a config file's sections read as a
run's ``RunConfig``), ``rlx.commandline`` (the command line), ``rlx.models``, ``rlx.quant``,
``rlx.learner``, ``rlx.rollout`` (the built-in engine's generate step, compiled by ``aot``),
``rlx.platform``, ``rlx.kernels``, ``rlx.mesh``, ``rlx.types`` and ``rlx.errors``; nothing of a
run (``rlx.run``).
"""

from rlx.plan.planner import Plan, format_plan, load_config_file, main, nodes_needed, plan, spec_from_config

__all__ = ["Plan", "format_plan", "load_config_file", "main", "nodes_needed", "plan", "spec_from_config"]
