"""Custom GPU kernels (Triton): imported only when the `flash` attention backend is asked for."""
