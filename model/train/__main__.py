"""`python -m model.train train|eval ...`."""

from __future__ import annotations

import sys

from model.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
