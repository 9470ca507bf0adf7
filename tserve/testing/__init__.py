"""Tiny checkpoints and a server process for tests and benchmarks.

- :mod:`tserve.testing.checkpoints`: small tokenizers trained on an inline corpus (:mod:`tserve.testing.corpus`),
  in our layout and opus-mt's, and a Hugging Face checkpoint's tokenizer and config without its weights.
- :mod:`tserve.testing.server`: `tserve serve` as a process of its own on a free port.
- :mod:`tserve.testing.avx2_only`: runs Python with every kernel library held to what an AVX2-only CPU runs.

The service, the model library and the training never import this package.
"""
