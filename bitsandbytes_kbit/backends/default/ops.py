"""The default backend: every k-bit op in plain PyTorch, on any device.

This file is the executable specification of the flat format (DESIGN.md section 3); the CUDA
kernels are tested bit for bit against it.

- A is flattened; block i holds elements [32 i, 32 i + 32). A tail block is padded with
  zeros, and the index bits of the padded positions are 0.
- absmax: the block's max |x|, stored as E4M4 (uint8), float16 or float32. The stored value,
  decoded, is the block's scale s, and quantization normalizes by s, so dequantize multiplies
  by exactly what quantize divided by (for E4M4 the scale is within 1/32 of max |x|; elements
  above s take the top codebook entry).
- index(x) = the codebook entry nearest to x / s in float32 (ties to the lower index;
  a block with s == 0 uses x / s := 0).
- packed: k int32 words per block, block i at [i k, i k + k); word b holds bit b of the 32
  indices, element j of the block in bit j.
- value = float32(codebook[index] * s), then cast to the output dtype (round to nearest even).
"""

import torch

from ..._ops import (
    BLOCKSIZE,
    check_dequantize_args,
    check_dequantize_out_args,
    check_dequantize_tiled_args,
    check_gemm_args,
    check_gemm_out_args,
    check_quantize_args,
    check_repack_args,
    num_blocks,
    register_kernel,
    tiled_shapes,
)
from .tiled_layout import repack_kbit_reference, unrepack_kbit_reference

E4M4_BIAS = 11
_CHUNK_BLOCKS = 8192  # blocks per step of the nearest-entry search: 8192 x 32 x 32 floats = 32 MiB


def e4m4_table(device=None) -> torch.Tensor:
    """The 256 E4M4 values in code order (increasing): e = code >> 4, m = code & 15;
    e == 0: m * 2^-14, else 2^(e - 11) * (1 + m / 16). Every value is exact in float32."""
    code = torch.arange(256, device=device, dtype=torch.int32)
    e = code >> 4
    m = (code & 15).to(torch.float32)
    normal = torch.ldexp(1.0 + m / 16.0, (e - E4M4_BIAS).to(torch.float32))
    subnormal = m * 2.0**-14
    return torch.where(e == 0, subnormal, normal)


_E4M4_TABLES: dict[torch.device, torch.Tensor] = {}


def decode_absmax_e4m4(raw: torch.Tensor) -> torch.Tensor:
    if raw.device not in _E4M4_TABLES:  # built once per device: every dequantize decodes its scales
        _E4M4_TABLES[raw.device] = e4m4_table(raw.device)
    return _E4M4_TABLES[raw.device][raw.long()]


def encode_absmax_e4m4(absmax: torch.Tensor) -> torch.Tensor:
    """Nearest E4M4 code (ties to the lower code); a nonzero value never becomes 0, values
    past 31.0 saturate to 0xFF. Mirrors kbit::encode_e4m4 in csrc/kernels.cuh step for step."""
    a = absmax.to(torch.float32)
    table = e4m4_table(a.device)
    c = torch.searchsorted(table, a, right=True) - 1  # largest code with table[code] <= a
    c = c.clamp(min=0)
    lo = table[c]
    hi = table[(c + 1).clamp(max=255)]
    code = torch.where((c < 255) & (a - lo > hi - a), c + 1, c)
    code = torch.where((code == 0) & (a > 0), torch.ones_like(code), code)
    return code.to(torch.uint8)


def encode_scale(amax: torch.Tensor, absmax_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored absmax, the float32 scale it decodes to)."""
    if absmax_dtype == torch.uint8:
        stored = encode_absmax_e4m4(amax)
        return stored, decode_absmax_e4m4(stored)
    stored = amax.to(absmax_dtype)
    return stored, stored.to(torch.float32)


def decode_scale(absmax: torch.Tensor) -> torch.Tensor:
    if absmax.dtype == torch.uint8:
        return decode_absmax_e4m4(absmax)
    return absmax.to(torch.float32)


def nearest_index(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the codebook entry nearest to each element of xn [blocks, 32]; first (lowest)
    index on ties, as argmin guarantees. Chunked to bound memory on large weights."""
    out = torch.empty(xn.shape, dtype=torch.int64, device=xn.device)
    for start in range(0, xn.shape[0], _CHUNK_BLOCKS):
        chunk = xn[start : start + _CHUNK_BLOCKS]
        out[start : start + _CHUNK_BLOCKS] = (chunk.unsqueeze(-1) - codebook).abs().argmin(dim=-1)
    return out


def pack_bitplanes(idx: torch.Tensor, k: int) -> torch.Tensor:
    """idx [blocks, 32] -> int32 [blocks * k]: word b of block i = bit b of its 32 indices."""
    weights = torch.ones(1, dtype=torch.int64, device=idx.device) << torch.arange(BLOCKSIZE, device=idx.device)
    words = torch.stack([(((idx >> b) & 1) * weights).sum(dim=1) for b in range(k)], dim=1)  # [blocks, k] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).reshape(-1)


def unpack_bitplanes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [blocks * k] -> indices int64 [blocks, 32]."""
    words = packed.reshape(-1, k).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(BLOCKSIZE, device=packed.device)
    idx = torch.zeros(words.shape[0], BLOCKSIZE, dtype=torch.int64, device=packed.device)
    for b in range(k):
        idx |= ((words[:, b : b + 1] >> shifts) & 1) << b
    return idx


_INDEX_CHECK_BLOCKS = 1 << 16  # blocks per step of max_index


def max_index(packed: torch.Tensor, k: int) -> int:
    """The largest codebook index that flat packed words hold (one sync; chunked to bound memory)."""
    words = packed.reshape(-1, k)
    top = 0
    for start in range(0, words.shape[0], _INDEX_CHECK_BLOCKS):
        idx = unpack_bitplanes(words[start : start + _INDEX_CHECK_BLOCKS].reshape(-1), k)
        if idx.numel():
            top = max(top, int(idx.max()))
    return top


def check_indices_in_codebook(op: str, packed: torch.Tensor, codebook: torch.Tensor, k: int) -> None:
    """A codebook shorter than 2^k must have an entry for every stored index (data-dependent: one sync)."""
    if codebook.numel() < 2**k and packed.numel():
        top = max_index(packed, k)
        if top >= codebook.numel():
            raise ValueError(
                f"{op}: codebook has {codebook.numel()} entries but packed holds index {top}; expected the codebook "
                "quantize_kbit returned (an entry for every stored index)"
            )


def check_finite(op: str, name: str, t: torch.Tensor) -> None:
    # Data-dependent (one sync): run by the backends, not by the fake.
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{op}: {name} contains NaN or Inf; expected finite values")


def quantize_kbit_impl(
    A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    n = A.numel()
    nb = num_blocks(n)
    x = torch.zeros(nb * BLOCKSIZE, dtype=torch.float32, device=A.device)
    x[:n] = A.reshape(-1).to(torch.float32)
    blocks = x.view(nb, BLOCKSIZE)
    stored, scale = encode_scale(blocks.abs().amax(dim=1), absmax_dtype)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    xn = torch.where((scale > 0).unsqueeze(1), blocks / safe.unsqueeze(1), torch.zeros_like(blocks))
    idx = nearest_index(xn, codebook)
    idx.view(-1)[n:] = 0  # padded positions carry index bits 0
    return pack_bitplanes(idx, k), stored


_SPREAD_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def spread_table(k: int, device: torch.device) -> torch.Tensor:
    """int64 [k * 256]: entry b * 256 + v has bit j of the byte v in bit b of its byte j. One byte of
    bit-plane b (8 elements' bit b) looks up, in one step, those 8 elements' bit b placed in one byte each."""
    key = (k, device)
    if key not in _SPREAD_TABLES:
        v = torch.arange(256, dtype=torch.int64, device=device)
        j = torch.arange(8, dtype=torch.int64, device=device)
        spread = (((v.unsqueeze(1) >> j) & 1) << (8 * j)).sum(dim=1)
        _SPREAD_TABLES[key] = torch.cat([spread << b for b in range(k)])
    return _SPREAD_TABLES[key]


def unpack_bitplanes_bytes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of unpack_bitplanes as uint8 [blocks, 32], by table lookup on bytes of the planes (8
    elements per lookup instead of one shift per element and plane). Byte q of a little-endian int32 word
    holds bits 8q..8q+7, that is elements 8q..8q+7; byte j of the int64 result is element 8q + j."""
    planes = packed.reshape(-1, k).contiguous().view(torch.uint8).view(-1, k, 4)
    table = spread_table(k, packed.device)
    acc = table.index_select(0, planes[:, 0].reshape(-1).to(torch.int32))
    for b in range(1, k):
        acc |= table.index_select(0, planes[:, b].reshape(-1).to(torch.int32) + 256 * b)
    return acc.view(torch.uint8).view(-1, BLOCKSIZE)


def dequantize_kbit_impl(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    # value = dtype(float32(codebook[index] * s)): the block's table of float32(codebook * s), cast to
    # dtype, holds exactly those values, so one gather per element gives them in the output dtype.
    idx = unpack_bitplanes_bytes(packed, k)
    table = (codebook * decode_scale(absmax).unsqueeze(1)).to(dtype)  # [blocks, codebook entries]
    return table.gather(1, idx.to(torch.int64)).reshape(-1)[:n]


@register_kernel("bitsandbytes::quantize_kbit", "default")
def _(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_args(A, codebook, k, absmax_dtype)
    check_finite("quantize_kbit", "A", A)
    return quantize_kbit_impl(A, codebook, k, absmax_dtype)


@register_kernel("bitsandbytes::dequantize_kbit", "default")
def _(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    check_indices_in_codebook("dequantize_kbit", packed, codebook, k)
    return dequantize_kbit_impl(packed, absmax, codebook, k, n, dtype)


@register_kernel("bitsandbytes::dequantize_kbit.out", "default")
def _(packed, absmax, codebook, k: int, n: int, dtype: torch.dtype, out: torch.Tensor) -> None:
    check_dequantize_out_args(packed, absmax, codebook, k, n, dtype, out)
    check_indices_in_codebook("dequantize_kbit", packed, codebook, k)
    out.copy_(dequantize_kbit_impl(packed, absmax, codebook, k, n, dtype))


# ---------------------------------------------------------------- repack + GEMM (reference)


@register_kernel("bitsandbytes::repack_kbit", "default")
def _(packed: torch.Tensor, absmax: torch.Tensor, k: int, N: int, K_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_repack_args(packed, absmax, k, N, K_dim)
    words_shape, absmax_shape = tiled_shapes(k, N, K_dim)
    B_packed, B_absmax = repack_kbit_reference(packed.reshape(-1), absmax.reshape(-1), k, N, K_dim)
    return B_packed.reshape(words_shape), B_absmax.reshape(absmax_shape)


def dequantize_tiled(
    B_packed: torch.Tensor, B_absmax: torch.Tensor, codebook: torch.Tensor, k: int, N: int, K_dim: int
):
    """The float32 weight W[N, K_dim] that a repacked (tiled) weight holds."""
    packed, absmax = unrepack_kbit_reference(B_packed.reshape(-1), B_absmax.reshape(-1), k, N, K_dim)
    return dequantize_kbit_impl(packed, absmax, codebook, k, N * K_dim, torch.float32).view(N, K_dim)


def kbit_gemm_impl(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias) -> torch.Tensor:
    """C = A @ W^T (+ bias) in float32 on the dequantized weight, cast to A's dtype."""
    W = dequantize_tiled(B_packed, B_absmax, codebook, k, N, K_dim)
    C = A.reshape(-1, K_dim).to(torch.float32) @ W.t()
    if bias is not None:
        C += bias.to(torch.float32)
    return C.to(A.dtype).reshape(*A.shape[:-1], N)


@register_kernel("bitsandbytes::kbit_gemm", "default")
def _(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias=None) -> torch.Tensor:
    check_gemm_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias)
    return kbit_gemm_impl(A, B_packed, B_absmax, codebook, k, N, K_dim, bias)


@register_kernel("bitsandbytes::kbit_gemm.out", "default")
def _(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias, out: torch.Tensor) -> None:
    check_gemm_out_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias, out)
    out.copy_(kbit_gemm_impl(A, B_packed, B_absmax, codebook, k, N, K_dim, bias))


@register_kernel("bitsandbytes::dequantize_kbit_tiled", "default")
def _(B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, dtype) -> torch.Tensor:
    check_dequantize_tiled_args(B_packed, B_absmax, codebook, k, N, K_dim, dtype)
    return dequantize_tiled(B_packed, B_absmax, codebook, k, N, K_dim).to(dtype)
