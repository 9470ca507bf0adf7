"""Our C++ kernels for the CPU, built on first use by PyTorch's extension builder (g++ and ninja, about 40 s once:
`make setup` does it) into `TORCH_EXTENSIONS_DIR` (default ~/.cache/torch_extensions), in a directory named by a
hash of the sources, the flags, torch's version and Python's: checkouts of the same sources share one build, and a
build that is there is imported as it is (no compiler needed: the Docker image ships one). Where they cannot be
built (no compiler) a warning says why and the PyTorch paths serve instead.

- `paged_decode.cpp`: one-token attention straight from the paged KV cache. A decode step of `sdpa` first
  gathers every running row's self-attention blocks into one tensor (a copy of the keys and values, every
  layer) and then runs PyTorch's CPU flash kernel, built for blocks of queries: with one query per row it reads
  at a third of the memory bandwidth (docs/BENCHMARKS.md). This kernel reads each row's positions through its
  block table, all heads of a position as one contiguous run, in one pass over the keys and one over the values:
  float32, one row at a time (a row's result does not depend on the batch). It is the `cpu-decode` attention
  backend (`model.attention`), what `auto` is on the CPU where it builds.
- `int8_rows.cpp`: the per-row mapping around an int8 GEMM (`model.quantize.Int8Linear`) in one pass in and one
  out, bitwise equal to the chain of PyTorch calls it replaces.
- `int8_gemm.cpp`: a whole int8 layer with 8-bit activations, exact on AVX2 (int32 pair sums, `vpmaddwd`), where
  PyTorch's int8 GEMM would saturate (CPUs without VNNI): `--int8-activations full` there.
- `block_quant.cpp`: linear layers on llama.cpp's Q8_0 / Q4_0 blocks (`model.block_quant`, `--quantize q8_0` /
  `q4_0`), AVX-512 VNNI and AVX2 paths compiled for their own instruction sets (function attributes) and chosen at
  run time; only on x86-64 (`block_isas()` is empty elsewhere).
- `decode_layers.cpp`: a language model's one-token decode step through every layer in one call
  (`model.fused_decode`): the products on the layers' own kernels, everything between them in loops over the rows.
- `dense_rows.cpp`: a float32 linear layer for a decode step's few rows, reading the weight as `nn.Linear` stores it
  (the fused step's float32 products and output layer).
- `argmax_rows.cpp`: each row's argmax in two vectorised passes (`argmax`), where PyTorch's CPU argmax over a
  vocabulary took longer than a small model's output layer.
- `prefill_attention.cpp` (tiles in `prefill_tiles.h`): the attention of a prompt's positions, or an encoder's
  (`prefill_attention`: `cpu-decode`'s prefill), grouped kv heads read in place, AVX-512 and AVX2 paths; PyTorch's
  CPU flash attention took half a long prompt's prefill on a small model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import math
import os
import platform
import sysconfig
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from tserve.model.device_inputs import to_device

log = logging.getLogger("tserve.kernels")

_SOURCES = [Path(__file__).with_name(name)
            for name in ("cpu_module.cpp", "paged_decode.cpp", "int8_rows.cpp", "int8_gemm.cpp", "block_quant.cpp",
                         "decode_layers.cpp", "argmax_rows.cpp", "dense_rows.cpp", "prefill_attention.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("int8_row_range.h", "kernel_entries.h", "linear_args.h",
                                                              "step_team.h", "vector_math.h", "prefill_tiles.h")]


def _flags() -> list[str]:
    # AVX2 and FMA: every x86-64 CPU this serves has them; the loops vectorise to 8 floats. No contraction into
    # fused multiply-adds: int8_rows.cpp must round as the PyTorch calls it replaces do. OpenMP: `at::parallel_for`
    # is a header template that runs on one thread unless it is compiled with it; the library it links is
    # PyTorch's own libgomp (already loaded, same soname), so the kernels share PyTorch's threads and their count.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    return flags + (["-mavx2", "-mfma"] if platform.machine() in ("x86_64", "AMD64") else [])


def _build_name(flags: list[str]) -> str:
    # What the library depends on, and nothing else (not where the sources lie): checkouts and virtual environments
    # of the same sources, flags, torch and Python share one build.
    python = sysconfig.get_config_var("EXT_SUFFIX")
    digest = hashlib.sha256(f"{' '.join(flags)}|{torch.__version__}|{python}".encode())
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    return f"tserve_cpu_kernels_{digest.hexdigest()[:16]}"


def _import_built(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def extension() -> ModuleType | None:
    """The built kernels, or None (logged once) where they cannot be built."""
    flags = _flags()
    name = _build_name(flags)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    directory = Path(root) / name
    library = directory / f"{name}.so"
    if library.is_file():
        try:
            return _import_built(name, library)
        except ImportError:  # a build cut short: build it again
            pass
    from torch.utils import cpp_extension  # noqa: PLC0415 (the builder, only when needed)

    try:
        directory.mkdir(parents=True, exist_ok=True)
        log.info("building the CPU kernels (once)", extra={"directory": str(directory)})
        return cpp_extension.load(name, [str(s) for s in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the PyTorch paths serve instead
        log.warning("the CPU kernels could not be built; decode steps use sdpa and int8 layers PyTorch's calls",
                    extra={"error": f"{type(exc).__name__}: {exc}"[:500]})
        return None


def available() -> bool:
    """Whether the kernels are built (building them now if needed)."""
    return extension() is not None


@functools.cache
def kernel_isa() -> str | None:
    """The kernels' path in this process: "avx512" (AVX-512 with VNNI) or "avx2", as far as PyTorch's own kernels
    go (`ATEN_CPU_CAPABILITY`: `tserve.testing.avx2_only` holds them to AVX2, and so these); None (said once in the
    log) where the kernels are not built or not compiled for this CPU, or PyTorch is held below AVX2. The block
    kernels (`model.block_quant`) and the attention over a float32 cache take this path."""
    ext = extension()
    supported = ext.block_isas() if ext is not None else []
    capability = torch.backends.cpu.get_cpu_capability()
    isa = next((i for i in ("avx512", "avx2") if i in supported and capability in _CAPABILITIES[i]), None)
    if isa is None:
        log.warning("the Q8_0 / Q4_0 kernels do not run here; PyTorch's statement of the same maths serves "
                    "(the same numbers, slower)",
                    extra={"built": ext is not None, "compiled_for": supported, "pytorch_capability": capability})
    return isa


_CAPABILITIES = {"avx512": ("AVX512",), "avx2": ("AVX2", "AVX512")}  # torch.backends.cpu.get_cpu_capability()


def paged_decode(q: Tensor, k_blocks: Tensor, v_blocks: Tensor, tables: Tensor, lengths: Tensor,
                 bound: int | None = None, window: int | None = None, *, isa: str | None = None) -> Tensor:
    """q (B, H, 1, D); k/v blocks (num_blocks, KV, block_len, D), views of the flat cache (positions, KV, D);
    tables (B, W) block ids; lengths (B,): row b attends over its positions [0, lengths[b]), or only the last
    `window` of them. -> (B, H, 1, D). (`bound`, an upper bound of the lengths, is for kernels that size their
    launch by it.) `isa`: the path of a float32 cache ("avx512", "avx2"; default `kernel_isa()`)."""
    ext = extension()
    if ext is None:
        raise RuntimeError("the CPU kernels are not built")
    B, H, _, D = q.shape
    block_len, KV = k_blocks.size(2), k_blocks.size(1)
    flat = lambda t: t.transpose(1, 2).reshape(-1, KV, D)  # noqa: E731 - the cache itself: a view, no copy
    out = ext.paged_decode(q.reshape(B, H, D).contiguous().float(), flat(k_blocks), flat(v_blocks),
                           tables, lengths, block_len, 1.0 / math.sqrt(D), window or 0,
                           (isa if isa is not None else kernel_isa()) or "")
    return out.view(B, H, 1, D).to(q.dtype)


def argmax(scores: Tensor, excluded: list[list[int]] | None = None) -> Tensor:
    """`scores.argmax(dim=-1)` of (rows, n) scores: our kernel's on float32 CPU tensors where it is built (the same
    result, the first of equal maxima, the first NaN), PyTorch's elsewhere. `excluded`: per row, ids it may not take,
    written -inf into `scores` in place first (the caller hands them over), as the logits pipeline's bans would be."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2 and scores.size(1) and \
            (excluded is None or scores.is_contiguous()):
        ext = extension()
        if ext is not None:
            return ext.argmax_rows(scores, excluded or [])
    if excluded is not None and any(excluded):
        rows, ids = zip(*((r, i) for r, row in enumerate(excluded) for i in row), strict=True)
        dev = scores.device
        if scores.is_inference() and not torch.is_inference_mode_enabled():
            scores = scores.clone()  # inference-mode logits take no writes outside it
        scores.index_put_((to_device(rows, dev), to_device(ids, dev)), to_device(float("-inf"), dev, scores.dtype))
    return scores.argmax(dim=-1)


def prefill_path(q: Tensor, k: Tensor, isa: str | None = None) -> str | None:
    """The path `prefill_attention` takes these queries and keys ((B, H, Tq, D), (B, KV, Tk, D)) on, or None where it
    does not take them: float32 CPU tensors, each head's channels contiguous, KV dividing H, D a multiple of the
    path's lanes (16 on "avx512"; a head of 8 or 24 channels on an AVX-512 CPU takes "avx2", 8 lanes), the kernels
    built for this CPU (`isa`: the CPU's path, default `kernel_isa()`)."""
    isa = isa if isa is not None else kernel_isa()
    if isa is None or q.device.type != "cpu" or not q.dtype == k.dtype == torch.float32 or \
            q.stride(-1) != 1 or k.stride(-1) != 1 or q.size(1) % k.size(1):
        return None
    D = q.size(-1)
    if isa == "avx512" and D % 16:
        isa = "avx2"
    return isa if D % 8 == 0 else None


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, *, starts: Tensor | None = None,
                      isa: str | None = None) -> Tensor:
    """Attention of q (B, H, Tq, D) over k, v (B, KV, Tk, D), KV dividing H (query head h reads kv head h // (H /
    KV)), scaled by 1 / sqrt(D); causal: row b's queries are positions starts[b], starts[b] + 1, ... (default: the
    last Tq of the Tk positions), each attending to the keys up to its own. -> (B, H, Tq, D), a view of a (B, Tq, H,
    D) tensor (what the output projection reads). `isa`: "avx512" or "avx2", default `prefill_path`'s."""
    ext = extension()
    isa = isa if isa is not None else prefill_path(q, k)
    if ext is None or isa is None:
        raise RuntimeError("the CPU kernels are not built for this CPU or do not take these tensors")
    out = ext.prefill_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal,
                                1.0 / math.sqrt(q.size(-1)), isa, starts)
    return out.transpose(1, 2)
