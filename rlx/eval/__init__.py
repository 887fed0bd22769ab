"""``python -m rlx.eval --config X [--checkpoint DIR | --adapter DIR] --k 8 --temperature 0.7``:
pass@1, pass@k and the mean reward of a policy on the held-out split of the config's data, with
a progress bar, ``report.json`` and the per-problem results as ``problems.jsonl``. The command
line only; the work is ``rlx.run.evaluation``.

May import ``rlx.config``, ``rlx.commandline`` (the command line), ``rlx.run`` and the
foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""
