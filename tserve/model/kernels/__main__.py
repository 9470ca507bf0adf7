"""`python -m tserve.model.kernels [--require]`: build the CPU kernels now (`make setup`, the Docker image); with
--require, fail where they cannot be built."""

import logging
import sys

from tserve.model.kernels import cpu

logging.basicConfig(level=logging.INFO, format="%(message)s")
built = cpu.available()
print("CPU kernels:", "built" if built else "not built (PyTorch's paths serve)")
sys.exit(1 if "--require" in sys.argv[1:] and not built else 0)
