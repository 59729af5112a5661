"""The CPU kernels of ``LinearKbit`` (libbitsandbytes_kbit_cpu.so, csrc/cpu/kbit_cpu.cpp), through ctypes.

The build makes the library whenever a C++ compiler is present; without it ``is_available()`` is False and
LinearKbit uses the PyTorch path (dequantize, then multiply). Neither path keeps a float copy of the weight:

- few input rows (decode): one fused kernel reads the packed bit-planes, looks the codebook up and
  multiplies, with float32 accumulation;
- many rows (prefill, perplexity): a few hundred weight rows at a time are dequantized into a buffer of
  at most 4 MiB and multiplied by torch's matmul.

``isa`` is the instruction set the kernels use (0 portable C++, 1 AVX2, 2 AVX-512), the best this CPU
runs; every path gives the same results, and tests lower it to check the others.
"""

from __future__ import annotations

import ctypes as ct
import functools
from pathlib import Path

import torch

LIBRARY_NAME = "libbitsandbytes_kbit_cpu.so"
ISA_NAMES = ("portable", "avx2", "avx512")
# At most this many input rows go through the fused kernel; more use the blocked dequantize + matmul,
# where torch's GEMM makes up for dequantizing (the crossover on a Zen 4 core, 1 and 2 threads).
FUSED_MAX_ROWS = 16
# float32 elements of the dequantized weight tile of the blocked path (4 MiB: few tiles, so few thread-pool
# rounds per call, which matters on a busy machine)
TILE_ELEMENTS = 1 << 20

_ABSMAX_TYPES = {torch.uint8: 0, torch.float16: 1, torch.float32: 2}
_IO_TYPES = {torch.float32: 0, torch.bfloat16: 1}


def find_library(name: str) -> Path:
    """The package's native library ``name``: beside this file, or, when imported from a source checkout
    (python -m ... in the repository root) while the built wheel is installed, the installed distribution's.
    The path beside this file when neither exists."""
    beside = Path(__file__).resolve().parent / name
    if beside.is_file():
        return beside
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        installed = Path(distribution("bitsandbytes-kbit").locate_file(f"bitsandbytes_kbit/{name}"))
        if installed.is_file():
            return installed
    except (ImportError, PackageNotFoundError):
        pass
    return beside


def library_path() -> Path:
    return find_library(LIBRARY_NAME)


@functools.cache
def _lib() -> ct.CDLL | None:
    path = library_path()
    if not path.is_file():
        return None
    try:
        lib = ct.CDLL(str(path))
    except OSError:
        return None
    i64, i32, p = ct.c_int64, ct.c_int, ct.c_void_p
    lib.kbit_cpu_gemm.argtypes = [p, i64, i32, i64, p, p, i32, p, i64, i32, i64, i64, i64, p, p, i64, i32, i32, i32]
    lib.kbit_cpu_gemm.restype = i32
    lib.kbit_cpu_dequantize.argtypes = [p, p, i32, p, i64, i32, i64, i64, p, i32, i32, i32]
    lib.kbit_cpu_dequantize.restype = i32
    lib.kbit_cpu_best_isa.restype = i32
    return lib


def is_available() -> bool:
    return _lib() is not None


# Read once: forward checks a plain attribute (torch.compile folds it; it would not trace the file lookup).
AVAILABLE = is_available()
isa = _lib().kbit_cpu_best_isa() if AVAILABLE else 0
_gemm = _lib().kbit_cpu_gemm if AVAILABLE else None


def _check(rc: int, op: str) -> None:
    if rc != 0:
        raise RuntimeError(f"bitsandbytes-kbit: the CPU kernel {op} refused its arguments (return code {rc})")


def dequantize_rows(packed, absmax, codebook, k: int, K_pad: int, n0: int, n1: int, out: torch.Tensor) -> None:
    """Rows [n0, n1) of the flat weight [N, K_pad] into out (contiguous float32 or bfloat16, at least
    (n1 - n0) * K_pad elements), value = float32(codebook[index] * scale) cast to out's dtype."""
    kb = K_pad // 32
    rc = _lib().kbit_cpu_dequantize(
        packed.data_ptr(),
        absmax.data_ptr(),
        _ABSMAX_TYPES[absmax.dtype],
        codebook.data_ptr(),
        codebook.numel(),
        k,
        n0 * kb,
        n1 * kb,
        out.data_ptr(),
        _IO_TYPES[out.dtype],
        torch.get_num_threads(),
        isa,
    )
    _check(rc, "kbit_cpu_dequantize")


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    N: int,
    K: int,
    K_pad: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for W [N, K] stored flat (rows padded to K_pad); float32 accumulation, the
    result in x's dtype. All tensors on the CPU; packed, absmax and codebook as
    ``quantize_kbit`` makes them (absmax uint8 / float16 / float32, codebook float32)."""
    # Kept lean: in decoding this runs once per layer and token, and its Python overhead adds up.
    xc = x if x.dtype in _IO_TYPES else x.to(torch.float32)
    xc = xc.contiguous()
    packed, absmax, codebook = packed.contiguous(), absmax.contiguous(), codebook.contiguous()
    M = xc.numel() // K if K else 0
    if bias is not None:
        # bound to a name: a temporary's memory could be freed before the call reads it
        bias = (bias if bias.dtype == xc.dtype else bias.to(xc.dtype)).contiguous()
    if M <= FUSED_MAX_ROWS:
        y = torch.empty((*x.shape[:-1], N), dtype=xc.dtype)
        io = _IO_TYPES[xc.dtype]
        rc = _gemm(
            xc.data_ptr(),
            K,
            io,
            M,
            packed.data_ptr(),
            absmax.data_ptr(),
            _ABSMAX_TYPES[absmax.dtype],
            codebook.data_ptr(),
            codebook.numel(),
            k,
            N,
            K,
            K_pad,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            N,
            io,
            torch.get_num_threads(),
            isa,
        )
        if rc:
            _check(rc, "kbit_cpu_gemm")
        return y if y.dtype == x.dtype else y.to(x.dtype)
    # Many rows: weight tiles of about TILE_ELEMENTS dequantized in turn, each multiplied by torch.mm into
    # the rows of y^T it produces (contiguous), so no float copy of the whole weight exists at any time.
    xf = xc.view(M, K).to(torch.float32)
    if K_pad != K:
        xf = torch.nn.functional.pad(xf, (0, K_pad - K))
    xt = xf.t()
    yt = torch.empty((N, M), dtype=torch.float32)
    rows = max(1, min(N, TILE_ELEMENTS // K_pad))
    tile = torch.empty(rows * K_pad, dtype=torch.float32)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        dequantize_rows(packed, absmax, codebook, k, K_pad, n0, n1, tile)
        torch.mm(tile[: (n1 - n0) * K_pad].view(n1 - n0, K_pad), xt, out=yt[n0:n1])
    y = yt.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


# The same computation as an opaque op for torch.compile (Dynamo cannot trace the ctypes call). Eager
# callers use ``linear`` directly: the dispatcher's overhead would be a sizeable part of a decode step.
@torch.library.custom_op("bitsandbytes_kbit::cpu_linear", mutates_args=(), device_types="cpu")
def linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    N: int,
    K: int,
    K_pad: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return linear(x, packed, absmax, codebook, k, N, K, K_pad, bias)


@linear_op.register_fake
def _(x, packed, absmax, codebook, k, N, K, K_pad, bias):
    return x.new_empty((*x.shape[:-1], N))


def linear_any(x, packed, absmax, codebook, k: int, N: int, K: int, K_pad: int, bias) -> torch.Tensor:
    """``linear`` in eager mode, the op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return linear_op(x, packed, absmax, codebook, k, N, K, K_pad, bias)
    return linear(x, packed, absmax, codebook, k, N, K, K_pad, bias)
