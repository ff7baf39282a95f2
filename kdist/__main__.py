"""`python -m kdist launch ...`: the `kdist` command (see `kdist.launch.cli`)."""

import sys

from kdist.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
