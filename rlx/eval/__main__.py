"""``python -m rlx.eval --config configs/X.py [--config.a.b=v ...] [--checkpoint DIR | --adapter
DIR] [--k 8] [--n N] [--temperature 0.7] [--problems N] [--out DIR]``.

Scores the config's model (with a run's checkpoint or a PEFT adapter) on the held-out split of
its data source and on each named set of ``data.eval_sources`` (e.g.
``--config.data.eval_sources='("mmath:math500", "mmath:aime24")'``, each in ``<out>/<name>/``):
pass@1, pass@k and the mean reward, printed and written to ``<out>/report.json``
with one line per problem in ``<out>/problems.jsonl`` (``out`` defaults to
``<config.output_dir>/eval``). A bad config or option: one line, exit status 2, nothing written.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "A run's output folder, its checkpoints/ "
                                  "folder or one step's folder: evaluate its trained parameters.")
_ADAPTER = flags.DEFINE_string("adapter", "", "A PEFT LoRA folder to evaluate on the base.")
_K = flags.DEFINE_integer("k", 8, "pass@k (and pass@1).")
_N = flags.DEFINE_integer("n", 0, "Samples per problem (>= k); 0: k.")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature; default: "
                                  "config.rollout.temperature.")
_PROBLEMS = flags.DEFINE_integer("problems", 0, "Held-out problems; 0: config.data.eval_size.")
_BATCH = flags.DEFINE_integer("batch", 16, "Problems per engine call.")
_OUT = flags.DEFINE_string("out", "", "Output folder; default <config.output_dir>/eval.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv) -> None:
    """``argv``: (the config with its overrides, the positional arguments), from
    ``rlx.commandline.absl_flags_parser``."""
    config, _ = argv
    logging.set_verbosity(logging.WARNING)
    from rlx.config import parse_config
    from rlx.errors import ConfigError
    from rlx.run.evaluation import EvalOptions, run_eval

    try:
        cfg = parse_config(config)
        opts = EvalOptions(k=_K.value, n=_N.value, temperature=_TEMPERATURE.value,
                           problems=_PROBLEMS.value, batch=_BATCH.value,
                           checkpoint=_CHECKPOINT.value, adapter=_ADAPTER.value, out=_OUT.value,
                           progress=_PROGRESS.value)
        report = run_eval(cfg, opts)
    except ConfigError as e:
        print(f"rlx.eval: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError) as e:  # each names its own fix
        print(f"rlx.eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    k = opts.k
    for name, figures in ({"": report} | report["sets"]).items():
        if figures["problems"]:
            print(f"{name + ': ' if name else ''}{figures['problems']} problems x {report['n']} samples (temperature "
                  f"{report['temperature']}): pass@1 {figures['pass@1']:.4f}  pass@{k} "
                  f"{figures[f'pass@{k}']:.4f}  mean reward {figures['mean_reward']:.4f}")


if __name__ == "__main__":
    from rlx.commandline import absl_flags_parser, end_output

    sys.exit(end_output(lambda: app.run(main, flags_parser=absl_flags_parser("rlx.eval"))))
