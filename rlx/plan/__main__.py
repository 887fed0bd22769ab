"""``python -m rlx.plan --config configs/X.py [...]``: the memory planner's command line;
with ``--aot TOPOLOGY`` the planner beside XLA:TPU's compiled figures (``rlx.plan.aot``)."""

import sys

from rlx.commandline import end_output

if __name__ == "__main__":
    if any(a == "--aot" or a.startswith("--aot=") for a in sys.argv[1:]):
        from rlx.plan.aot import main
    else:
        from rlx.plan.planner import main
    sys.exit(end_output(main))
