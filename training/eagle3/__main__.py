"""`python -m eagle3 ...`"""

import sys

from eagle3.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
