"""The environment that holds every kernel library of a process to what a CPU with AVX2 only (no AVX-512,
VNNI or AMX: an AMD EPYC of the Zen 2/3 kind, say) runs, on whatever CPU runs it. The trained fixtures,
int8, packed weights, HTML placement and the parity tests must pass there too; `make test-avx2` (run by CI
after `make test`) and `make planted-bugs` use it, and the benchmarks measure those kernels with it.

    python -m tserve.testing.avx2_only -m pytest tests/model    # python, run with that environment
    python -m tserve.testing.avx2_only bench/int8_linear.py
"""

from __future__ import annotations

import os
import sys
import tempfile

AVX2_ONLY = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's own vectorised kernels (read once, at import)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (mkldnn) GEMMs and convolutions
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL, float32 matrix products
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # fbgemm, the int8 GEMM: pairs summed in saturating int16
    # torch.compile's kernels apart from those compiled for this CPU's own ISA: inductor's cache would hand
    # kernels built for AVX-512 to an AVX2 process, whose outputs are then NaN.
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor-avx2-{os.getuid()}"),
}

if __name__ == "__main__":
    os.execve(sys.executable, [sys.executable, *sys.argv[1:]], {**os.environ, **AVX2_ONLY})
