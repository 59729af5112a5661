"""Pure-PyTorch mirror of the tiled k-bit weight layout read by the fused GEMM (csrc/kbit_gemm.cuh).

The flat (checkpoint) format: block i = 32 consecutive k of one row n (block id (n*K_dim + k) // 32),
packed words [i*k, i*k+k), word b holds bit b of the 32 indices (element j in bit j); one absmax per
block (uint8 E4M4 or float16).

The tiled format (owned by the repack kernel; its constants live in bitsandbytes_kbit/_format.py):
  * N is padded to a multiple of UNIT_ROWS = 16 and K_dim to UNIT_K = 128; padding gets index 0 and
    absmax 0 (so it contributes 0).
  * unit (n16, kstep) = rows [16*n16, +16) x k [128*kstep, +128); units are stored n16-major:
    unit = n16 * k_steps + kstep; unit words = 64 * k, unit absmax = 64.
  * inside a unit, lane = 4*g + t (g = 0..7, t = 0..3) of the GEMM warp owns rows g and g+8 and, of
    each of the 4 quantization blocks, 32 "pairs" q = 4*u + j with u = 2*blk + s, j in 0..3: row
    g + 8*(j & 1), pair p = 2*s + (j >> 1) = elements (8p+2t, 8p+2t+1) of the block (the k of the MMA
    register fragment slots that hold them).
  * a lane's 2*k words, read as one 64k-bit little-endian stream (word w = bits 32w .. 32w+31), hold
    pair q's LUT index e at stream bits [2k*q, 2k*q + 2k) (for k = 3, 5 a field may straddle two
    words). e = lo | hi << lo_field_bits: lo = the lo_bits_per_elem (2 for k = 2, 3; 4 for k = 4, 5)
    low index bits of element 0, then of element 1; hi (k = 3, 5) = the top index bit of element 0
    (bit 0), then of element 1.
  * the lane's words sit in the unit as uint4 chunks (lane word lw < 4*NV4 at (lw//4)*128 + lane*4 + lw%4)
    then one uint2 chunk (NV4*128 + lane*2 + lw - 4*NV4) when 2*k % 4 == 2.
  * absmax of a unit: [g 0..7][half 0..1][blk 0..3], row g + 8*half, block blk.
"""

import functools

import torch

from ..._format import BLOCKSIZE as BLOCK_ELEMS
from ..._format import UNIT_ABSMAX, UNIT_BLOCKS, UNIT_K, UNIT_ROWS, tiled_sizes  # noqa: F401  (tiled_sizes: re-exported)

LANES = 32


def _format(k: int):
    """(lo_bits_per_elem, lo_field_bits, lane_words) of TiledFormat<k>."""
    lo_bits_per_elem = 4 if k >= 4 else 2
    return lo_bits_per_elem, 2 * lo_bits_per_elem, 2 * k


@functools.cache  # pure function of k; rebuilding it dominated small repacks
def _unit_bit_sources(k: int):
    """For every (unit word offset, bit): (row in unit, k in unit, index bit). Shapes [64k, 32]."""
    lo_bpe, lo_fb, lane_words = _format(k)
    field_bits = 2 * k
    nv4 = lane_words // 4
    unit_words = 32 * lane_words
    src_row = torch.zeros(unit_words, 32, dtype=torch.long)
    src_k = torch.zeros(unit_words, 32, dtype=torch.long)
    src_bit = torch.zeros(unit_words, 32, dtype=torch.long)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for lw in range(lane_words):
            off = (lw // 4) * 128 + lane * 4 + lw % 4 if lw < 4 * nv4 else nv4 * 128 + lane * 2 + (lw - 4 * nv4)
            for bit in range(32):
                q, x = divmod(32 * lw + bit, field_bits)  # pair field, bit of its LUT index
                if x < lo_fb:
                    elem, ibit = x // lo_bpe, x % lo_bpe
                else:
                    elem, ibit = x - lo_fb, lo_bpe
                u, j = q // 4, q % 4
                blk, s = u // 2, u % 2
                half, pair = j & 1, 2 * s + (j >> 1)
                src_row[off, bit] = g + 8 * half
                src_k[off, bit] = blk * BLOCK_ELEMS + 8 * pair + 2 * t + elem
                src_bit[off, bit] = ibit
    return src_row, src_k, src_bit


@functools.cache
def _unit_absmax_sources():
    off = torch.arange(UNIT_ABSMAX)
    g, half, blk = off // 8, (off // 4) % 2, off % 4
    return g + 8 * half, blk  # row in unit, block in unit


def _flat_to_indices(packed_flat: torch.Tensor, k: int, N: int, K_dim: int) -> torch.Tensor:
    words = packed_flat.reshape(-1, k).to(torch.int64) & 0xFFFFFFFF  # [blocks, k]
    j = torch.arange(32, device=words.device)
    bits = (words[:, :, None] >> j[None, None, :]) & 1  # [blocks, k, 32]
    idx = (bits << torch.arange(k, device=words.device)[None, :, None]).sum(1)  # [blocks, 32]
    return idx.reshape(N, K_dim)


def _indices_to_flat(idx: torch.Tensor, k: int) -> torch.Tensor:
    blocks = idx.reshape(-1, 32).to(torch.int64)
    b = torch.arange(k, device=idx.device)
    bits = (blocks[:, None, :] >> b[None, :, None]) & 1  # [blocks, k, 32]
    words = (bits << torch.arange(32, device=idx.device)[None, None, :]).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(-1).to(torch.int32)


def repack_kbit_reference(packed_flat: torch.Tensor, absmax_flat: torch.Tensor, k: int, N: int, K_dim: int):
    """Flat -> tiled, bit-exact with the CUDA ckbit_repack. Returns (B_packed int32, B_absmax same dtype)."""
    assert K_dim % BLOCK_ELEMS == 0, f"K_dim={K_dim} is not a multiple of {BLOCK_ELEMS}"
    dev = packed_flat.device
    n16, k_steps = (N + UNIT_ROWS - 1) // UNIT_ROWS, (K_dim + UNIT_K - 1) // UNIT_K
    n_pad, k_pad = n16 * UNIT_ROWS, k_steps * UNIT_K
    idx = torch.zeros(n_pad, k_pad, dtype=torch.int64, device=dev)
    idx[:N, :K_dim] = _flat_to_indices(packed_flat, k, N, K_dim)
    tiles = idx.reshape(n16, UNIT_ROWS, k_steps, UNIT_K).permute(0, 2, 1, 3)  # [n16, ks, 16, 128]
    src_row, src_k, src_bit = (x.to(dev) for x in _unit_bit_sources(k))
    shifts = torch.arange(32, device=dev)
    out = []
    for i in range(n16):  # chunked to bound memory
        bits = (tiles[i][:, src_row, src_k] >> src_bit) & 1  # [ks, 64k, 32]
        out.append((bits << shifts).sum(-1))
    words = torch.stack(out).reshape(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    ab = torch.zeros(n_pad, k_pad // BLOCK_ELEMS, dtype=absmax_flat.dtype, device=dev)
    ab[:N, : K_dim // BLOCK_ELEMS] = absmax_flat.reshape(N, K_dim // BLOCK_ELEMS)
    ab_tiles = ab.reshape(n16, UNIT_ROWS, k_steps, UNIT_BLOCKS).permute(0, 2, 1, 3)  # [n16, ks, 16, 4]
    a_row, a_blk = (x.to(dev) for x in _unit_absmax_sources())
    B_absmax = ab_tiles[:, :, a_row, a_blk].reshape(-1).contiguous()
    return words, B_absmax


def unrepack_kbit_reference(B_packed: torch.Tensor, B_absmax: torch.Tensor, k: int, N: int, K_dim: int):
    """Tiled -> flat (inverse of repack_kbit_reference). Returns (packed_flat int32, absmax_flat)."""
    dev = B_packed.device
    n16, k_steps = (N + UNIT_ROWS - 1) // UNIT_ROWS, (K_dim + UNIT_K - 1) // UNIT_K
    words = (B_packed.to(torch.int64) & 0xFFFFFFFF).reshape(n16, k_steps, 64 * k)
    src_row, src_k, src_bit = (x.to(dev) for x in _unit_bit_sources(k))
    idx = torch.zeros(n16, k_steps, UNIT_ROWS, UNIT_K, dtype=torch.int64, device=dev)
    bits = (words[:, :, :, None] >> torch.arange(32, device=dev)) & 1  # [n16, ks, 64k, 32]
    contrib = bits << src_bit
    flat_pos = (src_row * UNIT_K + src_k).reshape(-1)
    idx.view(n16, k_steps, -1).index_add_(2, flat_pos, contrib.reshape(n16, k_steps, -1))
    full = idx.permute(0, 2, 1, 3).reshape(n16 * UNIT_ROWS, k_steps * UNIT_K)[:N, :K_dim]
    packed_flat = _indices_to_flat(full, k)

    a_row, a_blk = (x.to(dev) for x in _unit_absmax_sources())
    ab = torch.zeros(n16, k_steps, UNIT_ROWS, UNIT_BLOCKS, dtype=B_absmax.dtype, device=dev)
    ab[:, :, a_row, a_blk] = B_absmax.reshape(n16, k_steps, UNIT_ABSMAX)
    absmax_flat = ab.permute(0, 2, 1, 3).reshape(n16 * UNIT_ROWS, k_steps * UNIT_BLOCKS)[:N, : K_dim // BLOCK_ELEMS]
    return packed_flat, absmax_flat.reshape(-1).contiguous()
