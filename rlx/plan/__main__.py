"""``python -m rlx.plan --config configs/X.py [...]``: the memory planner's command line."""

import sys

from rlx.plan.planner import main

if __name__ == "__main__":
    sys.exit(main())
