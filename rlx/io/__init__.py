"""I/O of a run: orbax checkpoints (``checkpoint``; what one holds and whether a run may restore
it: ``fingerprint``), exports for serving and for other tools (``export``: HF, quantized serving
layouts, PEFT, merged), metrics (``metrics``: tensorboard, JSONL, console, progress bar) and the
experiment trackers beside them (``trackers``: wandb, MLflow).

May import ``rlx.models``, ``rlx.quant``, ``rlx.learner`` (the train state it checkpoints),
``rlx.platform``, ``rlx.kernels`` and the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``); nothing of the run or the stages.
"""
