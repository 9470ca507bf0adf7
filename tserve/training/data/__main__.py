"""`python -m tserve.training.data [--force]`: fetch and prepare every data set, print a summary."""

from __future__ import annotations

import json
import logging
import sys

from tserve.training.data import prepare_all

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(prepare_all(force="--force" in sys.argv), indent=2))
