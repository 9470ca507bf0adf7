"""tserve: an HTTP inference service for transformer models, in one package.

- :mod:`tserve.model`: pure PyTorch (configs, layers, attention backends, kernels, KV cache, checkpoints and
  importers, decoding); no web code.
- :mod:`tserve.service`: the FastAPI service (routes, engines, tasks, settings, the command line).
- :mod:`tserve.training`: data preparation, trainers, evaluation and model cards.
- :mod:`tserve.testing`: tiny checkpoints and a server process for tests and benchmarks; the three above never
  import it.

`python -m tserve` is the `tserve` command.
"""

import os as _os

# PyTorch's CPU allocator asks the kernel for transparent huge pages for tensors of 2 MB and more when this is set
# (read once, at the first such allocation, so before anything large is made). A step's large temporaries are new
# memory on every step (an output layer's logits: NLLB's 128 beams x 256k columns, 131 MB), faulted in and zeroed
# 4 KiB at a time without it: half of that layer's time (docs/benchmarks/nllb.md). The environment's own
# value wins (`THP_MEM_ALLOC_ENABLE=0`: off).
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
