"""tserve: an HTTP inference service for transformer models, in one package.

- :mod:`tserve.model`: pure PyTorch (configs, layers, attention backends, kernels, KV cache, checkpoints and
  importers, decoding); no web code.
- :mod:`tserve.service`: the FastAPI service (routes, engines, tasks, settings, the command line).
- :mod:`tserve.training`: data preparation, trainers, evaluation and model cards.
- :mod:`tserve.testing`: tiny checkpoints and a server process for tests and benchmarks; the three above never
  import it.

`python -m tserve` is the `tserve` command.
"""
