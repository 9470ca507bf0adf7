"""Our own kernels: the Triton ones of the `flash` attention backends (CUDA; imported only when asked for) and the
C++ decode-attention kernel of `cpu-decode` (built on first use)."""
