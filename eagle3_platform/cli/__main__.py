"""`python -m eagle3_platform.cli ...`: the `eagle3` command, where the console script is not on PATH
(subprocesses of tests, assets and the launcher run it with their own interpreter)."""
import sys

from eagle3_platform.cli import main

if __name__ == "__main__":
    sys.exit(main())
