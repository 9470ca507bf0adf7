"""`python -m training train|eval ...`."""

from __future__ import annotations

import sys

from training.cli import main

if __name__ == "__main__":
    sys.exit(main())
