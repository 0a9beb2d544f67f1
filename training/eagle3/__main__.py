"""`python -m eagle3 ...`"""

import sys

from eagle3.cli import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    # eagle3.distributed is imported by `train` only (the planner and the other commands stay torch-free).
    distributed = sys.modules.get("eagle3.distributed")
    if distributed is not None and distributed.joined_process_group():
        distributed.exit_process(code)  # a rank of a torchrun run: see exit_process for why
    sys.exit(code)
