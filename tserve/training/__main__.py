"""`python -m tserve.training train|eval ...`."""

from __future__ import annotations

import sys

from tserve.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
