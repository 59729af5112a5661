"""The public k-bit API. After ``import bitsandbytes`` the same callables are also
``bitsandbytes.functional.<name>`` (attached by the ``bitsandbytes.backends`` entry point).

Quick start::

    packed, absmax, codebook = quantize_kbit(W, k=4)            # default codebook for k, error-minimizing scales
    W_hat = dequantize_kbit(packed, absmax, codebook, k=4, n=W.numel(), dtype=W.dtype).view_as(W)
"""

from __future__ import annotations

import math
import warnings

import torch

from . import _ops
from ._ops import GEMM_DTYPES, check_gemm_args, check_int, check_k, check_out, check_quantize_args, check_weight_args
from .backends.default.ops import check_finite as _check_finite
from .backends.default.ops import check_indices_in_codebook, e4m4_table
from .backends.default.ops import decode_absmax_e4m4 as _decode_e4m4
from .backends.default.ops import encode_absmax_e4m4 as _encode_e4m4
from .backends.default.ops import max_index as _max_index
from .backends.default.tiled_layout import unrepack_kbit_reference as _unrepack_reference
from .scale_search import SCALE_METHODS, mse_candidate_range, quantize_blocks_mse

__all__ = [
    "create_codebook",
    "create_normal_float_codebook",
    "decode_absmax_e4m4",
    "dequantize_kbit",
    "encode_absmax_e4m4",
    "kbit_gemm",
    "quantize_kbit",
    "repack_kbit",
]

CODEBOOK_KINDS = ("lloyd", "lloyd-zero", "nf", "uniform", "fp4")
# The codebook ``codebook=None`` means, per k: the best measured with the "mse" scale search (docs/usage.md): the
# exact zero costs up to 0.6 dB of weight SQNR at k = 2 but gives the best MiniLM embeddings at every k.
DEFAULT_CODEBOOK = {2: "lloyd-zero", 3: "lloyd-zero", 4: "lloyd-zero", 5: "lloyd-zero"}
# Lloyd-Max levels for Gaussian weights in blocks of 32 with error-minimizing scales, max |level| = 1.
# Made by ``python -m bitsandbytes_kbit.scale_search`` (scale_search.data_free_levels: fixed seed, CPU).
_LLOYD_LEVELS = {
    ("lloyd", 2): [-1.0, -0.2966192, 0.2966192, 1.0],
    ("lloyd", 3): [-1.0, -0.6012591, -0.330557, -0.1057229, 0.1057229, 0.330557, 0.6012591, 1.0],
    ("lloyd", 4): [
        -1.0,
        -0.7628108,
        -0.5935189,
        -0.4566639,
        -0.339897,
        -0.235325,
        -0.1384072,
        -0.0456541,
        0.0456559,
        0.138408,
        0.235325,
        0.339897,
        0.4566639,
        0.5935189,
        0.7628108,
        1.0,
    ],
    ("lloyd", 5): [
        -1.0,
        -0.8644214,
        -0.7532833,
        -0.6596463,
        -0.5785836,
        -0.5071611,
        -0.4425014,
        -0.3838842,
        -0.3300647,
        -0.2800396,
        -0.2328157,
        -0.1877557,
        -0.1443955,
        -0.1023668,
        -0.0612785,
        -0.0204442,
        0.0204497,
        0.0612806,
        0.102369,
        0.1443957,
        0.187756,
        0.2328143,
        0.2800357,
        0.3300568,
        0.3838762,
        0.442498,
        0.5071599,
        0.5785812,
        0.659642,
        0.7532787,
        0.8644084,
        0.9999969,
    ],
    ("lloyd-zero", 2): [-0.6877934, 0.0, 0.4315934, 1.0],
    ("lloyd-zero", 3): [-0.9183641, -0.5126179, -0.2365806, 0.0, 0.1820902, 0.3820797, 0.6299295, 1.0],
    ("lloyd-zero", 4): [
        -0.9916285,
        -0.7489533,
        -0.5752859,
        -0.4342742,
        -0.3128172,
        -0.2029101,
        -0.0997317,
        0.0,
        0.082526,
        0.1682471,
        0.2593418,
        0.3582261,
        0.469796,
        0.602002,
        0.7667697,
        1.0,
    ],
    ("lloyd-zero", 5): [
        -0.9997491,
        -0.8639963,
        -0.7526675,
        -0.6586831,
        -0.5774398,
        -0.5057337,
        -0.4409032,
        -0.3818331,
        -0.3271679,
        -0.2761425,
        -0.2276305,
        -0.180862,
        -0.135048,
        -0.0894965,
        -0.0446313,
        0.0,
        0.0366969,
        0.0737219,
        0.1118639,
        0.1513692,
        0.1926658,
        0.2360783,
        0.2820002,
        0.3311032,
        0.384294,
        0.4424454,
        0.5067516,
        0.5780381,
        0.6588292,
        0.7525901,
        0.863995,
        1.0,
    ],
}
ABSMAX_FORMATS = {"e4m4": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}
E4M4_MAX = float(e4m4_table()[-1])  # 31.0
E4M4_MIN_NORMAL = 2.0**-10  # below it the codes are 2^-14 apart (absolute), not 1/16 relative
_FP16_MAX = torch.finfo(torch.float16).max

_codebook_cache: dict[tuple[str, int, str], torch.Tensor] = {}


def _normal_float_levels(k: int) -> torch.Tensor:
    """2^k levels at the means of N(0, 1) over 2^k equiprobable bins, scaled to max |level| = 1.
    The mean of bin (a, b) is (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)), with cdf(b) - cdf(a) = 2^-k."""
    bins = 2**k
    edges = torch.special.ndtri(torch.arange(bins + 1, dtype=torch.float64, device="cpu") / bins)  # -inf .. +inf
    pdf = torch.exp(-0.5 * edges**2) / (2 * torch.pi) ** 0.5
    pdf = torch.where(torch.isfinite(edges), pdf, torch.zeros_like(pdf))
    levels = (pdf[:-1] - pdf[1:]) * bins
    return (levels / levels.abs().max()).to(torch.float32)


def _uniform_levels(k: int) -> torch.Tensor:
    """The symmetric integer grid -(2^(k-1) - 1) .. 2^(k-1) - 1, scaled to [-1, 1] (2^k - 1 levels, zero exact)."""
    half = 2 ** (k - 1) - 1
    return torch.arange(-half, half + 1, dtype=torch.float32, device="cpu") / half


def _fp4_e2m1_levels() -> torch.Tensor:
    """The 15 distinct FP4 E2M1 values (+0 and -0 are one), scaled by 1/6 to [-1, 1]."""
    # dtype and device explicit: transformers builds models under a default dtype and a meta default
    # device, and the built-in codebooks are cached
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32, device="cpu")
    return torch.cat([-magnitudes.flip(0)[:-1], magnitudes]) / 6.0


def create_codebook(kind: str = "nf", k: int = 4, device=None) -> torch.Tensor:
    """A built-in codebook: float32, sorted ascending, max |level| = 1, cached per (kind, k, device).

    Args:
        kind: one of

            - ``"lloyd"``: 2^k Lloyd-Max levels for Gaussian weights normalized by their block's
              error-minimizing scale (fitted jointly with the scale search; symmetric, no zero).
            - ``"lloyd-zero"``: the same fit with one level pinned at exactly 0 (2^k levels, one
              more on the positive side). The default for every k.
            - ``"nf"``: normal float, 2^k levels at the means of equiprobable N(0, 1) bins (the
              seed's codebook; no exact zero).
            - ``"uniform"``: the symmetric integer grid, 2^k - 1 levels, zero exact.
            - ``"fp4"``: the 15 FP4 E2M1 values, k = 4 only.
        k: bit width, 2..5.
        device: where the tensor lives (default CPU).

    The cached tensor is shared: clone it before modifying it.
    """
    check_k("create_codebook", k)
    if kind not in CODEBOOK_KINDS:
        raise ValueError(
            f"create_codebook: kind={kind!r} is not a built-in codebook; expected one of {CODEBOOK_KINDS}"
        )
    if kind == "fp4" and k != 4:
        raise ValueError(f"create_codebook: kind='fp4' is the 4-bit E2M1 grid; got k={k}, expected k=4")
    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (kind, k, str(device))
    if key not in _codebook_cache:
        if kind in ("lloyd", "lloyd-zero"):
            cb = torch.tensor(_LLOYD_LEVELS[kind, k], dtype=torch.float32)
        elif kind == "fp4":
            cb = _fp4_e2m1_levels()
        else:
            cb = {"nf": _normal_float_levels, "uniform": _uniform_levels}[kind](k)
        _codebook_cache[key] = cb.to(device=device, dtype=torch.float32)
    return _codebook_cache[key]


def create_normal_float_codebook(k: int, device=None) -> torch.Tensor:
    """The normal-float codebook for k bits: 2^k float32 levels, sorted, max |level| = 1, cached
    per (k, device). Same as ``create_codebook("nf", k, device)``."""
    return create_codebook("nf", k, device)


def encode_absmax_e4m4(absmax: torch.Tensor) -> torch.Tensor:
    """Encode non-negative scales to E4M4 bytes (4-bit exponent, 4-bit mantissa, bias 11):
    nearest code, ties to the lower one; nonzero values never encode to 0; values above 31.0
    saturate to 0xFF. Relative round-trip error <= 1/32 on [2^-10, 31]."""
    if not absmax.is_floating_point():
        raise ValueError(f"encode_absmax_e4m4: absmax has dtype {absmax.dtype}; expected a floating-point tensor")
    if absmax.numel() and not bool(((absmax >= 0) & torch.isfinite(absmax)).all()):
        raise ValueError("encode_absmax_e4m4: absmax has negative or non-finite entries; expected finite values >= 0")
    return _encode_e4m4(absmax)


def decode_absmax_e4m4(raw: torch.Tensor) -> torch.Tensor:
    """Decode E4M4 bytes to float32: e = raw >> 4, m = raw & 15; e == 0: m * 2^-14,
    else 2^(e - 11) * (1 + m / 16). Exact for all 256 codes."""
    if raw.dtype != torch.uint8:
        raise ValueError(f"decode_absmax_e4m4: raw has dtype {raw.dtype}; expected torch.uint8")
    return _decode_e4m4(raw)


def resolve_codebook(codebook: None | str | torch.Tensor, k: int, device) -> torch.Tensor:
    """None -> the default for k (``DEFAULT_CODEBOOK``); a string -> that built-in; a tensor -> checked
    (floating point, 1-D, finite, at most 2^k entries), converted to float32 and sorted."""
    check_k("quantize_kbit", k)
    if codebook is None:
        return create_codebook(DEFAULT_CODEBOOK[k], k, device)
    if isinstance(codebook, str):
        return create_codebook(codebook, k, device)
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(f"codebook: got {type(codebook).__name__}; expected None, one of {CODEBOOK_KINDS} or a tensor")
    if not codebook.is_floating_point():
        raise ValueError(f"codebook has dtype {codebook.dtype}; expected a floating-point tensor (stored as float32)")
    if codebook.dim() != 1 or not 1 <= codebook.numel() <= 2**k:
        raise ValueError(
            f"codebook has shape {tuple(codebook.shape)}; expected a 1-D tensor of 1..{2**k} entries for k={k}"
        )
    if not bool(torch.isfinite(codebook).all()):
        raise ValueError(f"codebook contains NaN or Inf: {codebook.tolist()}; expected finite values")
    return torch.sort(codebook.detach().to(device=device, dtype=torch.float32)).values.contiguous()


def quantize_kbit(
    A: torch.Tensor,
    k: int = 4,
    codebook: None | str | torch.Tensor = None,
    absmax_format: str = "e4m4",
    scale_method: str = "mse",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize A (float16, bfloat16 or float32, any shape) to k bits in blocks of 32 elements.

    Args:
        A: the tensor; it is flattened, and a tail block shorter than 32 is zero-padded.
        k: bits per element, 2..5.
        codebook: None (the default for k, ``DEFAULT_CODEBOOK[k]``: ``"lloyd-zero"`` for every k),
            a built-in name (see ``create_codebook``) or a tensor of up to 2^k levels (any order; it
            is sorted, and the sorted copy is returned).
        absmax_format: ``"e4m4"`` (1 byte per block, the default), ``"fp16"`` or ``"fp32"``.
        scale_method: ``"mse"`` (the default): each block's stored scale is the one, among those
            around absmax / max |level| and the least-squares refit, with the least squared error;
            ``"absmax"``: the block's absmax rounded to the format and the nearest entry (the
            ``quantize_kbit`` op, the CUDA kernel on CUDA). Both give the same format.

    Returns:
        (packed, absmax, codebook): packed int32 [ceil(n/32) * k] in bit-plane layout, absmax
        [ceil(n/32)] (uint8 E4M4, float16 or float32) and the float32 codebook used.
    """
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"quantize_kbit: A is a {type(A).__name__}; expected a torch.Tensor")
    if A.device.type == "meta":
        raise ValueError("quantize_kbit: A is on the meta device (it holds no values); expected a materialized tensor")
    if not isinstance(absmax_format, str) or absmax_format not in ABSMAX_FORMATS:
        raise ValueError(
            f"quantize_kbit: absmax_format={absmax_format!r} is not supported; expected one of {tuple(ABSMAX_FORMATS)}"
        )
    if scale_method not in SCALE_METHODS:
        raise ValueError(
            f"quantize_kbit: scale_method={scale_method!r} is not supported; expected one of {SCALE_METHODS}"
        )
    check_not_capturing("quantize_kbit", A)
    cb = resolve_codebook(codebook, k, A.device)
    limit = {"e4m4": E4M4_MAX, "fp16": _FP16_MAX}.get(absmax_format)
    # Data-dependent (one sync, the only one of an eager call), so not traced (compiled: the assert below). max |A| is
    # NaN or Inf when any element is (max propagates NaN), so it checks both.
    checked = A.numel() > 0 and A.is_floating_point() and not torch.compiler.is_compiling()
    if checked:
        amax = float(A.detach().abs().max())
        if not math.isfinite(amax):
            raise ValueError("quantize_kbit: A contains NaN or Inf; expected finite values")
        if limit is not None and amax > limit:
            raise ValueError(
                f"quantize_kbit: max |A| = {amax:g} exceeds the largest {absmax_format} absmax ({limit:g}); "
                "use absmax_format='fp32' (or 'fp16' up to 65504), or scale A down first"
            )
        if absmax_format == "e4m4" and 0 < amax < E4M4_MIN_NORMAL:
            warnings.warn(
                f"quantize_kbit: max |A| = {amax:g} is below the E4M4 normal range ({E4M4_MIN_NORMAL:g}); there the "
                "scale has an absolute step of 2^-14, and the error bound is the weaker one of docs/format.md. "
                "Use absmax_format='fp16' or 'fp32', or scale A up first",
                UserWarning,
                stacklevel=2,
            )
    elif A.numel() > 0 and A.is_floating_point() and torch.compiler.is_compiling():
        # Compiled, the host cannot read max |A|: an assert in the graph refuses NaN, Inf and values past the absmax
        # range instead (raised at run time; on CUDA a device-side assert, which ends the process's CUDA context).
        amax = A.detach().abs().amax()
        torch._assert_async(
            torch.isfinite(amax) if limit is None else amax <= limit,
            f"quantize_kbit: A contains NaN or Inf, or max |A| exceeds the largest {absmax_format} absmax ({limit})",
        )
    if scale_method == "mse":
        check_quantize_args(A, cb, k, ABSMAX_FORMATS[absmax_format])  # the op's own checks
        if not checked and not torch.compiler.is_compiling():  # data-dependent; skipped under compile as above
            _check_finite("quantize_kbit", "A", A)
        native = _mse_quantize.get(A.device.type)
        if native is not None and not torch.compiler.is_compiling():
            below, above = mse_candidate_range(k, ABSMAX_FORMATS[absmax_format])
            packed, absmax = native(A.detach(), cb, k, ABSMAX_FORMATS[absmax_format], below, above)
        else:
            packed, absmax = quantize_blocks_mse(A.detach(), cb, k, ABSMAX_FORMATS[absmax_format])
        return packed, absmax, cb
    eager = _eager_quantize.get(A.device.type) if checked else None
    if eager is not None:  # the op's checks without its finiteness check (done above): no second sync
        check_quantize_args(A, cb, k, ABSMAX_FORMATS[absmax_format])
        packed, absmax = eager(A, cb, k, ABSMAX_FORMATS[absmax_format])
        return packed, absmax, cb
    packed, absmax = torch.ops.bitsandbytes.quantize_kbit(A, cb, k, ABSMAX_FORMATS[absmax_format])
    return packed, absmax, cb


def check_not_capturing(op: str, A: torch.Tensor) -> None:
    """quantize checks its input's values on the host (max |A|: NaN, Inf, the absmax range), a sync that CUDA-graph
    capture forbids (it would invalidate the capture): refuse before anything is enqueued, the capture stays valid."""
    if A.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: called under CUDA-graph capture; it checks the values of A on the host (a sync, which capture "
            "forbids). Quantize before capturing (weights are quantized once) and capture the forward"
        )


# Eager absmax-rule quantize per device type, without the op's finiteness check (quantize_kbit checks max |A|
# first); filled by the CUDA backend.
_eager_quantize: dict = {}
# The mse rule in one native kernel per device type (scale_search.quantize_blocks_mse is its reference and the
# path everywhere else); filled by the CUDA backend.
_mse_quantize: dict = {}


def nan_padded_codebook(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """A codebook of fewer than 2^k levels extended to 2^k with NaN: where the indices cannot be checked (every call of
    a GEMM, CUDA-graph capture, torch.compile), an index past the levels then reads NaN, which propagates."""
    missing = 2**k - codebook.numel()
    if missing <= 0:
        return codebook
    return torch.cat([codebook, codebook.new_full((missing,), float("nan"))])


def dequantize_kbit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: None | str | torch.Tensor,
    k: int,
    n: int,
    dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize n elements (a flat tensor; ``.view(shape)`` it back). absmax may be uint8
    (E4M4), float16 or float32 and is dispatched on its dtype. With ``out`` (contiguous, [n],
    ``dtype``, same device) the result is written in place and nothing is allocated, which CUDA
    graphs need.

    A tensor codebook is sorted, as ``quantize_kbit`` sorts it (the indices refer to the sorted
    levels), so the codebook given to ``quantize_kbit`` and the one it returned give the same
    values. A codebook shorter than 2^k must have an entry for every stored index (else ValueError;
    checking it costs one sync on CUDA; a CUDA call under CUDA-graph capture or torch.compile does
    not check, and a missing entry reads NaN)."""
    check_int("dequantize_kbit", "n", n)
    if isinstance(codebook, torch.Tensor):
        check_k("dequantize_kbit", k)
        cb = torch.sort(codebook).values if codebook.dim() == 1 else codebook
    else:
        cb = resolve_codebook(codebook, k, packed.device)
    if isinstance(packed, torch.Tensor) and packed.device.type == "cuda" and cb.numel() < 2**k:
        # The default backend checks this in the op; the CUDA kernel would read 0.0 for a missing entry. Eager calls
        # check (one sync); under capture or compile, where the host cannot read the indices, a missing entry reads
        # NaN instead.
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            cb = nan_padded_codebook(cb, k)
        else:
            check_indices_in_codebook("dequantize_kbit", packed.reshape(-1), cb, k)
    if out is not None:
        torch.ops.bitsandbytes.dequantize_kbit.out(packed, absmax, cb, k, n, dtype, out)
        return out
    return torch.ops.bitsandbytes.dequantize_kbit(packed, absmax, cb, k, n, dtype)


def repack_kbit(
    packed: torch.Tensor, absmax: torch.Tensor, k: int, N: int, K: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rearrange a quantized weight W[N, K] (``quantize_kbit`` of an ``nn.Linear`` weight: flat
    format, E4M4 or float16 absmax) into the tiled layout ``kbit_gemm`` reads. Run once at load;
    the result is 2-D ([units, words] int32 and [units, 64] absmax), its layout the kernel's own.
    K must be a multiple of 32; N and K are padded inside as the kernel needs."""
    check_weight_args("repack_kbit", k, N, K)
    return torch.ops.bitsandbytes.repack_kbit(packed, absmax, k, N, K)


def unrepack_kbit(
    B_packed: torch.Tensor, B_absmax: torch.Tensor, k: int, N: int, K: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``repack_kbit``: the flat words (int32, 1-D) and absmax (1-D, the dtype of ``B_absmax``) of a
    tiled weight W[N, K], bit-exact. Pure PyTorch on the tensors' device; used to save a repacked weight flat."""
    _ops.check_weight_shape("unrepack_kbit", k, N, K)
    words, n_absmax = _ops.tiled_sizes(k, N, K)
    if B_packed.numel() != words or B_absmax.numel() != n_absmax:
        raise ValueError(
            f"unrepack_kbit: B_packed has {B_packed.numel()} words and B_absmax {B_absmax.numel()} entries; "
            f"expected {words} and {n_absmax} (the tiled layout of k={k}, N={N}, K={K})"
        )
    return _unrepack_reference(B_packed.reshape(-1), B_absmax.reshape(-1), k, N, K)


def kbit_gemm(
    A: torch.Tensor,
    B_packed: torch.Tensor,
    B_absmax: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    N: int,
    K: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C = A @ W^T (+ bias) for a k-bit weight W[N, K] repacked by ``repack_kbit``.

    A is float16 or bfloat16 of shape [..., K] (leading dims are flattened to M, any M >= 1);
    C has shape [..., N] and A's dtype; accumulation is float32. With ``out`` the result is
    written in place and nothing is allocated (CUDA-graph friendly).

    A codebook shorter than 2^k is used with NaN for its missing entries, so a weight whose indices it does not
    cover gives NaN, not a silently wrong product (checking the indices would read the whole weight every call;
    ``LinearKbit`` checks them once, at load)."""
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(
            f"kbit_gemm: codebook is {type(codebook).__name__}; expected the float32 tensor quantize_kbit returned"
        )
    launch = _eager_launcher(A, bias)
    if launch is not None:
        check_gemm_args(A, B_packed, B_absmax, codebook, k, N, K, bias)  # the op's checks, k, N and K's types first
    else:
        check_weight_args("kbit_gemm", k, N, K)  # before the dispatcher, whose schema error would not name them
    if codebook.dim() == 1 and 1 <= codebook.numel() < 2**k:
        codebook = nan_padded_codebook(codebook, k)
    if launch is not None:
        if out is None:
            out = torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)
        else:
            check_out("kbit_gemm", out, (*A.shape[:-1], N), A.dtype, A.device)
        launch(A, B_packed, B_absmax, codebook.contiguous(), k, N, K, bias, out)
        return out
    if out is not None:
        torch.ops.bitsandbytes.kbit_gemm.out(A, B_packed, B_absmax, codebook, k, N, K, bias, out)
        return out
    return torch.ops.bitsandbytes.kbit_gemm(A, B_packed, B_absmax, codebook, k, N, K, bias)


# Device type -> the eager launcher of the fused GEMM, (A, B_packed, B_absmax, codebook, k, N, K, bias, out) -> None,
# registered by a backend at import (backends/cuda/ops.py). An eager call on plain tensors goes straight to it after the
# same checks the op runs: the op's Python kernel behind the dispatcher costs more host time than the kernel takes at
# decode sizes. Under torch.compile, tensor subclasses, dispatch modes or autograd the call takes the op.
_eager_gemm: dict = {}


def _eager_launcher(A: torch.Tensor, bias: torch.Tensor | None):
    if torch.compiler.is_compiling() or type(A) is not torch.Tensor or torch._C._len_torch_dispatch_stack():
        return None
    if torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    return _eager_gemm.get(A.device.type)


def _kbit_gemm_prepared(
    A: torch.Tensor,
    B_packed: torch.Tensor,
    B_absmax: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    N: int,
    K: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``kbit_gemm`` for a caller that owns the weight (``LinearKbit``): the repacked weight, codebook and bias were
    checked when they were made, so an eager call checks only A against them (dtype, features, device)."""
    launch = _eager_launcher(A, bias)
    if (
        launch is None
        or A.dtype not in GEMM_DTYPES
        or A.shape[-1] != K
        or A.get_device() != B_packed.get_device()
        or (bias is not None and bias.dtype != A.dtype)
    ):
        return kbit_gemm(A, B_packed, B_absmax, codebook, k, N, K, bias)
    out = torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)
    launch(A, B_packed, B_absmax, codebook, k, N, K, bias, out)
    return out


def max_stored_index(packed: torch.Tensor, k: int) -> int:
    """The largest codebook index that the flat packed words of ``quantize_kbit`` hold (reads the data: one host
    sync). A codebook needs more entries than this index."""
    check_k("max_stored_index", k)
    return _max_index(packed, k)
