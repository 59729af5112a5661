"""The error-minimizing quantizer (scale_method="mse") and the fitted codebooks: against a brute-force
per-block search written here, never worse than the absmax rule, round trips, defaults, bad input."""

import pytest
import torch
from conftest import seeded

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.backends.default import ops as ref
from bitsandbytes_kbit.scale_search import fit_codebook

KS = (2, 3, 4, 5)


def sample(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "gauss":
        return torch.randn(n, generator=g) * 0.02
    if kind == "t4":  # Student-t, nu = 4: normal / sqrt(chi2_4 / 4)
        chi2 = (torch.randn(4, n, generator=g) ** 2).sum(0)
        return torch.randn(n, generator=g) / (chi2 / 4).sqrt() * 0.02
    return torch.rand(n, generator=g) * 2 - 1  # uniform


def sq_err(x: torch.Tensor, packed, absmax, cb, k: int) -> torch.Tensor:
    """Squared error per block of 32 (x a multiple of 32 long)."""
    deq = F.dequantize_kbit(packed, absmax, cb, k, x.numel(), dtype=torch.float32)
    return ((deq - x.float()) ** 2).view(-1, 32).sum(1)


def brute_force_block(block: list[float], cb: list[float], codes) -> float:
    """The least squared error over the given E4M4 codes, nearest level per element, in plain Python."""
    best = float("inf")
    for code in codes:
        s = float(F.decode_absmax_e4m4(torch.tensor([code], dtype=torch.uint8)))
        err = 0.0
        for x in block:
            err += min((c * s - x) ** 2 for c in cb)
        best = min(best, err)
    return best


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("codebook", ["nf", None])
def test_mse_close_to_brute_force(k, codebook):
    g = seeded("brute", k, codebook)
    x = sample("t4", 4 * 32, g)
    packed, absmax, cb = F.quantize_kbit(x, k=k, codebook=codebook)
    got = sq_err(x, packed, absmax, cb, k)
    cbl = cb.tolist()
    below = 12 if k == 2 else 6  # the documented window: codes down to ~0.5 x (k = 2) / ~0.7 x absmax
    for i in range(4):
        block = x[32 * i : 32 * i + 32]
        best = brute_force_block(block.tolist(), cbl, range(256))
        centre = int(F.encode_absmax_e4m4(block.abs().max().reshape(1) / cb.abs().max()))
        window = brute_force_block(block.tolist(), cbl, range(max(1, centre - below), min(255, centre + 1) + 1))
        assert best <= float(got[i]) * (1 + 1e-5) + 1e-12  # nothing beats the exhaustive search
        assert float(got[i]) <= window * (1 + 1e-5) + 1e-12, (i, float(got[i]), window)  # the window's optimum


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["gauss", "t4", "uniform"])
@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16", "fp32"])
@pytest.mark.parametrize("codebook", ["nf", "uniform", None])
def test_mse_never_worse_than_absmax(k, kind, absmax_format, codebook):
    g = seeded("never-worse", k, kind, absmax_format, codebook)
    x = sample(kind, 257 * 32, g)
    p0, a0, cb = F.quantize_kbit(x, k=k, codebook=codebook, absmax_format=absmax_format, scale_method="absmax")
    p1, a1, cb1 = F.quantize_kbit(x, k=k, codebook=codebook, absmax_format=absmax_format)
    assert torch.equal(cb, cb1)
    assert a1.dtype == a0.dtype and a1.shape == a0.shape and p1.shape == p0.shape
    e0, e1 = sq_err(x, p0, a0, cb, k), sq_err(x, p1, a1, cb, k)
    assert bool((e1 <= e0 * (1 + 1e-6) + 1e-20).all()), "a block got worse than the absmax rule"
    assert float(e1.sum()) < float(e0.sum()), "the search found nothing better anywhere"


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", [1, 31, 33, 1000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mse_round_trip_and_padding(k, n, dtype):
    g = seeded("round-trip", k, n, dtype)
    x = sample("gauss", n, g).to(dtype)
    packed, absmax, cb = F.quantize_kbit(x, k=k)
    nb = (n + 31) // 32
    assert packed.dtype == torch.int32 and packed.numel() == nb * k and absmax.dtype == torch.uint8
    idx = ref.unpack_bitplanes(packed, k).view(-1)
    assert bool((idx[n:] == 0).all()), "padded positions carry index bits 0"
    assert int(idx.max()) < cb.numel()
    # every element decodes to the level nearest to x / s under its block's stored scale
    s = F.decode_absmax_e4m4(absmax).repeat_interleave(32)[:n]
    xf = x.float()
    deq = F.dequantize_kbit(packed, absmax, cb, k, n, dtype=torch.float32)
    dist = ((cb.view(1, -1) * s.view(-1, 1) - xf.view(-1, 1)) ** 2).min(1).values
    assert torch.allclose((deq - xf) ** 2, dist, rtol=1e-4, atol=1e-12)
    # and re-quantizing the decoded values with the same stored scale reproduces them
    rel = (deq - xf).norm() / xf.norm().clamp_min(1e-30)
    assert float(rel) < {2: 0.45, 3: 0.25, 4: 0.12, 5: 0.07}[k]


def test_zero_block_and_exact_zero():
    x = torch.zeros(64)
    x[40] = 0.5
    packed, absmax, cb = F.quantize_kbit(x, k=4)  # lloyd-zero: zeros decode exactly
    assert int(absmax[0]) == 0
    deq = F.dequantize_kbit(packed, absmax, cb, 4, 64, dtype=torch.float32)
    assert float(deq[:32].abs().max()) == 0.0
    assert float(deq[32:40].abs().max()) == 0.0 and float(deq[41:].abs().max()) == 0.0
    assert abs(float(deq[40]) - 0.5) < 0.5 / 16


@pytest.mark.parametrize("k", KS)
def test_builtin_fitted_codebooks(k):
    for kind in ("lloyd", "lloyd-zero"):
        cb = F.create_codebook(kind, k)
        assert cb.dtype == torch.float32 and cb.numel() == 2**k
        assert bool((cb[1:] > cb[:-1]).all()) and float(cb.abs().max()) == 1.0
        assert (float(cb.abs().min()) == 0.0) == (kind == "lloyd-zero")
    assert torch.equal(F.resolve_codebook(None, k, "cpu"), F.create_codebook(F.DEFAULT_CODEBOOK[k], k))
    # the codebook fitted to Gaussian blocks beats the normal-float one on fresh Gaussian weights (both searched)
    x = sample("gauss", 4096 * 32, seeded("fitted-beats-nf", k))
    errs = {}
    for cbk in ("nf", "lloyd"):
        p, a, cb = F.quantize_kbit(x, k=k, codebook=cbk)
        errs[cbk] = float(sq_err(x, p, a, cb, k).sum())
    assert errs["lloyd"] < errs["nf"]


def test_fit_codebook_beats_its_start():
    g = seeded("fit")
    x = sample("t4", 1024 * 32, g)
    init = F.create_codebook("nf", 3)
    cb = fit_codebook(x, 3, iters=8, init=init)
    cbz = fit_codebook(x, 3, zero=True, iters=8, init=init)
    assert float(cbz.abs().min()) == 0.0 and cb.numel() == 8
    errs = []
    for c in (init, cb):
        p, a, c2 = F.quantize_kbit(x, k=3, codebook=c)
        errs.append(float(sq_err(x, p, a, c2, 3).sum()))
    assert errs[1] < errs[0]
    with pytest.raises(ValueError, match="multiple of 32"):
        fit_codebook(torch.zeros(33), 3)


def test_bad_scale_method():
    with pytest.raises(ValueError, match="scale_method='best'"):
        F.quantize_kbit(torch.zeros(32), k=4, scale_method="best")
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize_kbit(torch.tensor([float("nan")] * 32), k=4, absmax_format="fp32")


@pytest.mark.cuda
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
def test_cuda_mse_matches_cpu(k, absmax_format):
    g = seeded("cuda-mse", k, absmax_format)
    x = sample("t4", 100_003, g)
    p0, a0, cb = F.quantize_kbit(x, k=k, absmax_format=absmax_format)
    p1, a1, cb1 = F.quantize_kbit(x.cuda(), k=k, absmax_format=absmax_format)
    e0 = sq_err(torch.cat([x, x.new_zeros(29)]), p0, a0, cb, k)
    e1 = sq_err(torch.cat([x, x.new_zeros(29)]).cuda(), p1, a1, cb1, k).cpu()
    # same search on both devices; float rounding may flip a near-tie between two candidates
    assert float((e1 - e0).abs().sum()) <= 1e-6 * float(e0.sum())
    assert float((p1.cpu() != p0).float().mean()) < 1e-3


def _block_err64(x, packed, absmax, cb, k):
    """float64 squared error per block over the real elements of x (any length)."""
    deq = F.dequantize_kbit(packed, absmax, cb, k, x.numel(), dtype=torch.float32).double()
    sq = (deq - x.double()) ** 2
    return torch.cat([sq, sq.new_zeros(-x.numel() % 32)]).view(-1, 32).sum(1)


@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16", "fp32"])
def test_mse_duplicate_levels_take_the_lowest_index(absmax_format):
    """A duplicated level is stored as its lowest index, the format's tie rule (found by the idempotence property:
    the search's bucketize took the highest)."""
    cb = torch.tensor([-1.0, -0.25, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0])
    x = torch.randn(32 * 64, generator=seeded("dup", absmax_format))
    packed, _, cb_used = F.quantize_kbit(x, k=3, codebook=cb, absmax_format=absmax_format)
    idx = ref.unpack_bitplanes(packed, 3).reshape(-1)
    lowest = torch.searchsorted(cb_used, cb_used)
    assert torch.equal(lowest[idx], idx) and bool((idx == 2).any()) and bool((idx == 5).any())


@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16", "fp32"])
@pytest.mark.parametrize("levels", [[0.0], [-3e-8, 0.0, 2.4e-8]], ids=["zeros", "tiny"])
def test_mse_codebook_with_a_tiny_top_stores_finite_scales(absmax_format, levels):
    """max |level| = 0 or 2.4e-8: the search's amax / max |level| is inf or past fp16's range; the stored scales stay
    finite and every value too (they were inf and NaN)."""
    x = torch.randn(32 * 8, generator=seeded("tiny", absmax_format, len(levels))) * 0.05
    packed, absmax, cb = F.quantize_kbit(x, k=2, codebook=torch.tensor(levels), absmax_format=absmax_format)
    values = F.dequantize_kbit(packed, absmax, cb, 2, x.numel(), dtype=torch.float32)
    assert bool(torch.isfinite(values).all())
    if absmax_format != "e4m4":
        assert bool(torch.isfinite(absmax.float()).all())


def test_mse_is_never_worse_than_absmax_for_huge_values():
    """fp32 scales for values around 1e19..1e37, where squared errors overflow float32: the search still keeps the
    least-error scale, never worse than the absmax rule (the squared errors were inf, the masked tail NaN, and the
    first candidate won)."""
    g = seeded("huge")
    x = torch.randn(32 * 50 - 5, generator=g) * torch.logspace(19, 37, 32 * 50 - 5).float()
    for k in KS:
        mse = F.quantize_kbit(x, k=k, absmax_format="fp32")
        rule = F.quantize_kbit(x, k=k, absmax_format="fp32", scale_method="absmax")
        e_mse, e_rule = _block_err64(x, *mse, k), _block_err64(x, *rule, k)
        assert bool(torch.isfinite(e_mse).all()) and bool((e_mse <= e_rule * (1 + 1e-6)).all()), k
