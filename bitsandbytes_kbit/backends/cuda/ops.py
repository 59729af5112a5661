"""CUDA registrations of the k-bit ops: check what the kernels assume, allocate the outputs and
call the C ABI on the tensor's device and current stream. No math here."""

import ctypes as ct
import functools

import torch

from ..._ops import (
    SUPPORTED_K,
    check_dequantize_args,
    check_out,
    check_quantize_args,
    num_blocks,
    register_kernel,
)
from ...cextension import get_lib
from ..default.ops import check_finite

_DTYPE_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_ABSMAX_NAME = {torch.uint8: "u8abs", torch.float16: "fp16abs", torch.float32: "fp32abs"}

# The ctypes signatures, one table (upstream's _setup_ctypes); every entry returns a cudaError_t.
_SIGNATURES = {
    # (A, codebook, codebook_len, packed, absmax, n, stream)
    "cquantize_kbit_{dtype}_{absmax}_k{k}": [ct.c_void_p, ct.c_void_p, ct.c_int, ct.c_void_p, ct.c_void_p, ct.c_longlong, ct.c_void_p],
    # (packed, absmax, codebook, codebook_len, out, n, stream)
    "cdequantize_kbit_{dtype}_{absmax}_k{k}": [ct.c_void_p, ct.c_void_p, ct.c_void_p, ct.c_int, ct.c_void_p, ct.c_longlong, ct.c_void_p],
}


def entry_point_names() -> list[str]:
    """Every C symbol this backend may call (for the build test)."""
    return [
        template.format(dtype=d, absmax=a, k=k)
        for template in _SIGNATURES
        for d in _DTYPE_NAME.values()
        for a in _ABSMAX_NAME.values()
        for k in SUPPORTED_K
    ]


@functools.cache
def _entry(template: str, **names) -> ct._CFuncPtr:
    lib = get_lib()
    fn = getattr(lib, template.format(**names))
    fn.argtypes = _SIGNATURES[template]
    fn.restype = ct.c_int
    return fn


def _ptr(t: torch.Tensor) -> ct.c_void_p:
    return ct.c_void_p(t.data_ptr())


def _stream(t: torch.Tensor) -> ct.c_void_p:
    return ct.c_void_p(torch._C._cuda_getCurrentRawStream(t.device.index))


def _call(op: str, fn, *args) -> None:
    err = fn(*args)
    if err != 0:
        lib = get_lib()
        lib.ckbit_error_string.restype = ct.c_char_p
        raise RuntimeError(f"{op}: CUDA error {err}: {lib.ckbit_error_string(err).decode()}")


@register_kernel("bitsandbytes::quantize_kbit", "cuda")
def _(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_args(A, codebook, k, absmax_dtype)
    check_finite("quantize_kbit", "A", A)
    fn = _entry("cquantize_kbit_{dtype}_{absmax}_k{k}", dtype=_DTYPE_NAME[A.dtype], absmax=_ABSMAX_NAME[absmax_dtype], k=k)
    A = A.contiguous()
    codebook = codebook.contiguous()
    nb = num_blocks(A.numel())
    packed = torch.empty(nb * k, dtype=torch.int32, device=A.device)
    absmax = torch.empty(nb, dtype=absmax_dtype, device=A.device)
    with torch.cuda.device(A.device):
        _call(
            "quantize_kbit", fn, _ptr(A), _ptr(codebook), codebook.numel(), _ptr(packed), _ptr(absmax),
            A.numel(), _stream(A),
        )
    return packed, absmax


def _dequantize(packed, absmax, codebook, k, n, dtype, out) -> None:
    fn = _entry("cdequantize_kbit_{dtype}_{absmax}_k{k}", dtype=_DTYPE_NAME[dtype], absmax=_ABSMAX_NAME[absmax.dtype], k=k)
    packed = packed.contiguous()
    absmax = absmax.contiguous()
    codebook = codebook.contiguous()
    with torch.cuda.device(packed.device):
        _call(
            "dequantize_kbit", fn, _ptr(packed), _ptr(absmax), _ptr(codebook), codebook.numel(), _ptr(out), n,
            _stream(packed),
        )


@register_kernel("bitsandbytes::dequantize_kbit", "cuda")
def _(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    _dequantize(packed, absmax, codebook, k, n, dtype, out)
    return out


@register_kernel("bitsandbytes::dequantize_kbit.out", "cuda")
def _(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    n: int,
    dtype: torch.dtype,
    out: torch.Tensor,
) -> None:
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    check_out("dequantize_kbit", out, (n,), dtype, packed.device)
    _dequantize(packed, absmax, codebook, k, n, dtype, out)
