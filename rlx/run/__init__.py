"""The run: ``build`` assembles it from a validated config (``rlx.build``), ``loop`` holds ``Run``
and its ``step()``, ``rollouts`` the batches of rollouts in flight ahead of the learner
(``train.max_staleness``, ``rollout.partial``), ``learn`` the learner's side of a step,
``engines`` makes the rollout engine a config names, ``hosts`` and ``multihost`` split the work of
a multi-host job, ``lifecycle`` checkpoints, resumes and stops on signals, ``checks`` reads a
``lora.init_from`` folder's adapter into the config and refuses what cannot work before any weight
is read, ``summary`` describes a model for ``--dry_run``, ``evaluation`` and ``exporting``
score and write a run's checkpoint (``rlx.eval``, ``rlx.export``).

May import every stage (``rlx.models``, ``rlx.quant``, ``rlx.learner``, ``rlx.rewards``,
``rlx.data``, ``rlx.envs``, ``rlx.rollout``), ``rlx.io``, ``rlx.config``, ``rlx.platform``, ``rlx.kernels`` and the foundation
(``rlx.types``, ``rlx.errors``, ``rlx.mesh``); only ``rlx.launch``, the benchmarks and notebooks
import it
(and ``rlx.eval``, ``rlx.export``: command lines only).
"""
