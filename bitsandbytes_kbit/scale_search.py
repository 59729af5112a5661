"""Error-minimizing block quantization into the flat k-bit format, on any device.

The op ``torch.ops.bitsandbytes.quantize_kbit`` stores each block's absmax (rounded to the scale
format) and the nearest codebook index. Both choices are legal but not the most accurate: a scale
slightly below absmax clips one element and resolves the other 31 more finely. ``quantize_blocks_mse``
tries, per block, the stored scales around absmax / max |level| (E4M4 codes, or a fine grid for
float16 / float32), assigns the nearest entry under each, keeps the one with the least squared
error, then tries the least-squares refit of that assignment; the result is packed with the
reference packer, so it dequantizes with the same kernels.

``fit_codebook`` is Lloyd-Max (1-D k-means) on block-normalized values, alternated with the scale
search; ``create_codebook("lloyd", k)`` is its result on Gaussian blocks (see ``data_free_levels``).
"""

from __future__ import annotations

import torch

from ._ops import BLOCKSIZE, num_blocks
from .backends.default.ops import e4m4_table, encode_absmax_e4m4, pack_bitplanes

SCALE_METHODS = ("mse", "absmax")
# E4M4 codes tried below the rounded absmax (a code step is 1/32 .. 1/16 of the value): down to ~0.7 x absmax,
# ~0.5 x at k = 2, where clipping an outlier pays most (MiniLM: +0.2 dB at k = 2, nothing at k >= 3)
_E4M4_BELOW = {2: 12, 3: 6, 4: 6, 5: 6}
_E4M4_ABOVE = 1
# float16 / float32 scales: target x (1 - j / 64) for j = -_FLOAT_ABOVE .. _FLOAT_BELOW, 1.03 .. 0.69 x
_FLOAT_BELOW, _FLOAT_ABOVE = 20, 2
_FLOAT_STEPS = torch.tensor([1.0 - j / 64 for j in range(-_FLOAT_ABOVE, _FLOAT_BELOW + 1)])


def mse_candidate_range(k: int, absmax_dtype: torch.dtype) -> tuple[int, int]:
    """(below, above): how many candidate scales the search tries below and above the rounded absmax (E4M4 codes,
    or steps of 1/64 for float16 / float32 scales); the native kernels take them from here."""
    if absmax_dtype == torch.uint8:
        return _E4M4_BELOW[k], _E4M4_ABOVE
    return _FLOAT_BELOW, _FLOAT_ABOVE


_STEPS_ON: dict[torch.device, torch.Tensor] = {}


def _float_steps(device: torch.device) -> torch.Tensor:
    """_FLOAT_STEPS on ``device``, copied once (a host-to-device copy per chunk would sync the host each time)."""
    steps = _STEPS_ON.get(device)
    if steps is None:
        steps = _STEPS_ON[device] = _FLOAT_STEPS.to(device)
    return steps


# blocks per step: 16384 x ~24 candidates x 32 x 16 bytes ~ 200 MiB at most; 16x that on a GPU, where fewer,
# larger steps keep the kernel launches from dominating
_CHUNK = {"cpu": 16384}
_CHUNK_GPU = 2**18


def _nearest(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted codebook, ties to the lower index (the op's rule)."""
    mids = (codebook[1:] + codebook[:-1]) * 0.5
    return torch.bucketize(xn, mids, out_int32=True, right=False)


def _assign(blocks: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, valid: torch.Tensor = None):
    """blocks [B, 32], scales [B, C] -> (indices [B, C, 32], squared error [B, C]); ``valid`` [B, 32]
    (optional, 0 / 1) leaves the zero padding of a tail block out of the error."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    xn = torch.where(scales.unsqueeze(-1) > 0, blocks.unsqueeze(1) / safe, torch.zeros_like(safe))
    idx = _nearest(xn, codebook)
    # errors in units of 2^exponent(block amax): exact (a power of two) and far from float32 overflow, whose inf
    # (and inf * 0 = NaN at a masked tail) would tie every candidate of blocks above ~1e19
    unit = torch.exp2(-torch.frexp(blocks.abs().amax(dim=1)).exponent.clamp(-100, 127).to(blocks.dtype))
    d = (codebook[idx] * scales.unsqueeze(-1) - blocks.unsqueeze(1)) * unit[:, None, None]
    sq = d * d
    err = (sq if valid is None else sq * valid.unsqueeze(1)).sum(-1)
    return idx, err


def _candidates(amax: torch.Tensor, top: torch.Tensor, absmax_dtype: torch.dtype, k: int, refit: torch.Tensor = None):
    """(stored [B, C], decoded float32 scales [B, C]) around amax / top (or around ``refit`` [B])."""
    target = amax / top if refit is None else refit
    if absmax_dtype == torch.uint8:
        table = e4m4_table(amax.device)
        centre = encode_absmax_e4m4(target.clamp(max=table[-1])).long()  # a tensor bound: no host sync
        lo, hi = (_E4M4_BELOW[k], _E4M4_ABOVE) if refit is None else (1, 1)
        codes = (centre.unsqueeze(1) + torch.arange(-lo, hi + 1, device=amax.device)).clamp(1, 255)
        codes = torch.where((amax > 0).unsqueeze(1), codes, torch.zeros_like(codes))
        return codes.to(torch.uint8), table[codes]
    steps = _float_steps(amax.device) if refit is None else torch.ones(1, device=amax.device)
    # clamped to the largest finite scale: a codebook with a tiny max |level| must not store inf (NaN values)
    stored = (target.unsqueeze(1) * steps).clamp(max=torch.finfo(absmax_dtype).max).to(absmax_dtype)
    return stored, stored.to(torch.float32)


def _best_blocks(blocks: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype, refit: bool, valid):
    """(indices [B, 32], stored scale [B], squared error [B]) with the least error per block."""
    amax = blocks.abs().amax(dim=1)
    top = codebook.abs().max()  # a 0-d tensor on the codebook's device: no host sync
    top = torch.where(top > 0, top, torch.ones_like(top))  # an all-zero codebook: any scale decodes to 0; not inf
    stored, scales = _candidates(amax, top, absmax_dtype, k)
    idx, err = _assign(blocks, scales, codebook, valid)
    best = err.argmin(dim=1, keepdim=True)  # first on ties: the lowest candidate scale
    pick = best.unsqueeze(-1).expand(-1, 1, BLOCKSIZE)
    idx, err = idx.gather(1, pick).squeeze(1), err.gather(1, best).squeeze(1)
    stored = stored.gather(1, best).squeeze(1)
    if refit:
        # least-squares scale for the chosen assignment: <x, q> / <q, q>, then the stored values next to it
        q = codebook[idx] if valid is None else codebook[idx] * valid
        ls = (blocks * q).sum(1) / (q * q).sum(1).clamp_min(1e-30)
        ls = torch.where(ls > 0, ls, amax / top)
        st2, sc2 = _candidates(amax, top, absmax_dtype, k, refit=ls)
        idx2, err2 = _assign(blocks, sc2, codebook, valid)
        b2 = err2.argmin(dim=1, keepdim=True)
        e2 = err2.gather(1, b2).squeeze(1)
        better = e2 < err
        idx = torch.where(
            better.unsqueeze(1), idx2.gather(1, b2.unsqueeze(-1).expand(-1, 1, BLOCKSIZE)).squeeze(1), idx
        )
        stored = torch.where(better, st2.gather(1, b2).squeeze(1), stored)
        err = torch.where(better, e2, err)
    return idx, stored, err


def quantize_blocks_mse(
    A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype, refit: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat format of ``A`` (packed int32 [blocks * k], stored absmax [blocks]) with each block's
    scale chosen for the least squared error. ``codebook``: sorted float32 on A's device (checked by
    the caller). The result is never worse than the absmax rule on the same codebook (absmax's own
    stored scale is among the candidates) and dequantizes with ``dequantize_kbit`` unchanged."""
    n = A.numel()
    nb = num_blocks(n)
    flat = A.reshape(-1)
    packed = torch.empty(nb * k, dtype=torch.int32, device=A.device)
    stored = torch.empty(nb, dtype=absmax_dtype, device=A.device)
    chunk = _CHUNK.get(A.device.type, _CHUNK_GPU)
    lowest = torch.searchsorted(codebook, codebook).to(torch.int32)  # index -> lowest index of the same level
    for start in range(0, nb, chunk):
        stop = min(nb, start + chunk)
        x = flat[start * BLOCKSIZE : stop * BLOCKSIZE].to(torch.float32)
        if x.numel() < (stop - start) * BLOCKSIZE:  # the zero-padded tail block
            x = torch.cat([x, x.new_zeros((stop - start) * BLOCKSIZE - x.numel())])
        blocks = x.view(-1, BLOCKSIZE)
        valid = None
        if stop == nb and n < nb * BLOCKSIZE:
            valid = (torch.arange((stop - start) * BLOCKSIZE, device=A.device) < n - start * BLOCKSIZE).float()
            valid = valid.view(-1, BLOCKSIZE)
        idx, st, _ = _best_blocks(blocks, codebook, k, absmax_dtype, refit, valid)
        idx = lowest[idx]  # a duplicated level: its lowest index, as the format's rule says (same value and error)
        if stop == nb and n < nb * BLOCKSIZE:
            idx.view(-1)[n - start * BLOCKSIZE :] = 0  # padded positions carry index bits 0
        packed[start * k : stop * k] = pack_bitplanes(idx, k)
        stored[start:stop] = st
    return packed, stored


def block_normalize(x: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values / their block's error-minimizing scale (float32, continuous), weights = scale^2):
    the points Lloyd's update averages, each weighted by the squared scale it is multiplied back by."""
    blocks = x.reshape(-1, BLOCKSIZE).to(torch.float32)
    amax = blocks.abs().amax(dim=1)
    keep = amax > 0
    blocks, amax = blocks[keep], amax[keep]
    scales = (amax / float(codebook.abs().max())).unsqueeze(1) * _FLOAT_STEPS.to(x.device)
    _, err = _assign(blocks, scales, codebook)
    s = scales.gather(1, err.argmin(dim=1, keepdim=True))
    return (blocks / s).reshape(-1), (s * s).expand(-1, BLOCKSIZE).reshape(-1)


def fit_codebook(
    samples: torch.Tensor, k: int, zero: bool = False, iters: int = 40, init: torch.Tensor = None
) -> torch.Tensor:
    """Lloyd-Max levels (2^k, sorted, float32, max |level| = 1) for ``samples`` (any shape, a multiple
    of 32 elements) quantized in blocks of 32: alternately choose each block's scale for the least
    error and move each level to the weighted mean of the block-normalized values assigned to it.
    ``zero=True`` pins one level at exactly 0 (sparse or near-zero weights decode exactly)."""
    if samples.numel() % BLOCKSIZE or samples.numel() == 0:
        raise ValueError(f"fit_codebook: samples has {samples.numel()} elements; expected a positive multiple of 32")
    levels = 2**k
    if init is None:
        init = torch.special.ndtri((torch.arange(levels, dtype=torch.float64) + 0.5) / levels)
        init = (init / init.abs().max()).to(torch.float32)
    cb = init.to(samples.device, torch.float32).clone()
    zi = None
    if zero:
        zi = int((cb.abs()).argmin())
        cb[zi] = 0.0
    for _ in range(iters):
        xn, w = block_normalize(samples, cb)
        idx = _nearest(xn, cb)
        num = torch.zeros(levels, dtype=torch.float64, device=cb.device).index_add_(0, idx, (xn * w).double())
        den = torch.zeros(levels, dtype=torch.float64, device=cb.device).index_add_(0, idx, w.double())
        new = torch.where(den > 0, num / den.clamp_min(1e-300), cb.double()).float()
        if zi is not None:
            new[zi] = 0.0
        cb = torch.sort(new / new.abs().max()).values
        if zi is not None:
            zi = int(cb.abs().argmin())
    return cb


def data_free_levels(k: int, zero: bool) -> torch.Tensor:
    """How the built-in ``"lloyd"`` / ``"lloyd-zero"`` tables were made: ``fit_codebook`` on 2^14
    blocks of N(0, 1) samples (CPU generator seeded 0) and their negatives (so the levels come out
    symmetric up to the pinned zero), 40 iterations. Gaussian blocks fitted best
    on real weights (all-MiniLM-L6-v2) among the distributions tried (Gaussian, Student-t)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2**14 * BLOCKSIZE, generator=g)
    return fit_codebook(torch.cat([x, -x]), k, zero=zero)


if __name__ == "__main__":  # print the tables as functional.py holds them
    for zero in (False, True):
        for k in range(2, 6):
            print(
                f"    ({'lloyd-zero' if zero else 'lloyd'!r}, {k}): {[round(v, 7) for v in data_free_levels(k, zero).tolist()]},"
            )
