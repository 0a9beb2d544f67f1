"""`python -m eagle3.plan` runs the planner's command line, as `python -m eagle3 plan` does."""

import sys

from eagle3.plan.cli import main

sys.exit(main())
