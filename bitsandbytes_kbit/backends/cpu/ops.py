"""The CPU backend: ``dequantize_kbit`` through the native CPU kernels (``bitsandbytes_kbit._cpu``),
bit-identical to the default backend and about 10x faster. Other ops, and builds without the CPU library,
use the default backend."""

import torch

from ... import _cpu
from ..._ops import BLOCKSIZE, check_dequantize_args, check_dequantize_out_args, num_blocks, register_kernel
from ..default.ops import check_indices_in_codebook, dequantize_kbit_impl

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # float16: float32 values, then cast (the same rounding)


def _dequantize(packed, absmax, codebook, k: int, n: int, dtype: torch.dtype, out: torch.Tensor | None):
    check_indices_in_codebook("dequantize_kbit", packed, codebook, k)
    if not _cpu.AVAILABLE:
        result = dequantize_kbit_impl(packed, absmax, codebook, k, n, dtype)
        return result if out is None else out.copy_(result)
    blocks = num_blocks(n)
    native = dtype if dtype in _NATIVE_DTYPES else torch.float32
    # The kernel writes whole blocks: straight into out when n fills them, else into a buffer.
    direct = out is not None and native == dtype and n == blocks * BLOCKSIZE
    whole = out if direct else torch.empty(blocks * BLOCKSIZE, dtype=native)
    packed, absmax, codebook = packed.contiguous(), absmax.contiguous(), codebook.contiguous()
    _cpu.dequantize_rows(packed, absmax, codebook, k, BLOCKSIZE, 0, blocks, whole)
    if direct:
        return out
    result = whole[:n].to(dtype)
    return result if out is None else out.copy_(result)


@register_kernel("bitsandbytes::dequantize_kbit", "cpu")
def _(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    return _dequantize(packed, absmax, codebook, k, n, dtype, None)


@register_kernel("bitsandbytes::dequantize_kbit.out", "cpu")
def _(packed, absmax, codebook, k: int, n: int, dtype: torch.dtype, out: torch.Tensor) -> None:
    check_dequantize_out_args(packed, absmax, codebook, k, n, dtype, out)
    _dequantize(packed, absmax, codebook, k, n, dtype, out)
