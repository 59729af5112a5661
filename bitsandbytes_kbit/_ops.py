"""torch.library definitions of the k-bit ops (namespace ``bitsandbytes``) and their fake
implementations.

The argument checks live here, one function per op, and run three times over: in the fake
implementation (shapes and dtypes under torch.compile), in the default backend and in the CUDA
backend (eager calls reach a backend without passing through the fake). Each message names the
argument, what was given and what is expected.
"""

import functools

import torch

from ._format import BLOCKSIZE, SUPPORTED_K, UNIT_ABSMAX, tiled_sizes

register_fake = torch.library.register_fake
register_kernel = torch.library.register_kernel

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# absmax storage: uint8 is E4M4 (seed 000 section 1.5); float16 / float32 hold the scale itself.
ABSMAX_DTYPES = (torch.uint8, torch.float16, torch.float32)


def num_blocks(n: int) -> int:
    return (n + BLOCKSIZE - 1) // BLOCKSIZE


def check_int(op: str, name: str, value, low: int = 0) -> None:
    """value is a Python int (not a bool, float or string) in [low, 2^63)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{op}: {name}={value!r} is a {type(value).__name__}; expected an int")
    if not isinstance(value, torch.SymInt) and not low <= value.__index__() < 2**63:
        raise ValueError(f"{op}: {name}={value} is out of range; expected {low} <= {name} < 2^63")


def check_k(op: str, k: int) -> None:
    # k is a Python int: a plain check, which Dynamo folds (torch 2.11 graph-breaks on torch._check
    # whose message closure it cannot evaluate).
    if isinstance(k, bool) or not hasattr(type(k), "__index__"):
        raise TypeError(f"{op}: k={k!r} is a {type(k).__name__}; expected an int, one of {SUPPORTED_K}")
    if k not in SUPPORTED_K:
        raise RuntimeError(f"{op}: k={k} is not supported; expected one of {SUPPORTED_K}")


def check_weight_args(op: str, k: int, N: int, K: int) -> None:
    """k, N and K of a weight W[N, K] as Python ints (k one of SUPPORTED_K, N and K >= 1)."""
    check_k(op, k)
    check_int(op, "N", N, 1)
    check_int(op, "K", K, 1)


def check_codebook(op: str, codebook: torch.Tensor, k: int) -> None:
    if codebook.dtype != torch.float32:
        raise RuntimeError(f"{op}: codebook has dtype {codebook.dtype}; expected torch.float32")
    if codebook.dim() != 1 or not 1 <= codebook.numel() <= 2**k:
        raise RuntimeError(
            f"{op}: codebook has shape {tuple(codebook.shape)}; expected a 1-D tensor of 1..{2**k} entries for k={k}"
        )


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise RuntimeError(
            f"{op}: all tensors must be on one device; got "
            + ", ".join(f"{name} on {d}" for name, d in devices.items())
        )


def check_quantize_args(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype) -> None:
    op = "quantize_kbit"
    check_k(op, k)
    if A.dtype not in INPUT_DTYPES:
        raise RuntimeError(f"{op}: A has dtype {A.dtype}; expected one of {INPUT_DTYPES}")
    check_codebook(op, codebook, k)
    if absmax_dtype not in ABSMAX_DTYPES:
        raise RuntimeError(
            f"{op}: absmax_dtype={absmax_dtype} is not supported; expected one of {ABSMAX_DTYPES} (uint8 = E4M4)"
        )
    check_same_device(op, A=A, codebook=codebook)


def check_dequantize_args(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> None:
    op = "dequantize_kbit"
    check_k(op, k)
    torch._check(n >= 0, lambda: f"{op}: n={n} must be >= 0")
    torch._check(packed.dtype == torch.int32, lambda: f"{op}: packed has dtype {packed.dtype}; expected torch.int32")
    torch._check(
        absmax.dtype in ABSMAX_DTYPES,
        lambda: f"{op}: absmax has dtype {absmax.dtype}; expected one of {ABSMAX_DTYPES} (uint8 = E4M4)",
    )
    torch._check(
        dtype in INPUT_DTYPES, lambda: f"{op}: dtype={dtype} is not supported; expected one of {INPUT_DTYPES}"
    )
    check_codebook(op, codebook, k)
    nb = num_blocks(n)
    torch._check(
        packed.numel() == nb * k,
        lambda: f"{op}: packed has {packed.numel()} words; expected ceil(n/32)*k = {nb * k} for n={n}, k={k}",
    )
    torch._check(
        absmax.numel() == nb,
        lambda: f"{op}: absmax has {absmax.numel()} entries; expected ceil(n/32) = {nb} for n={n}",
    )
    check_same_device(op, packed=packed, absmax=absmax, codebook=codebook)


def check_out(op: str, out: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != tuple(shape):
        raise RuntimeError(f"{op}: out has shape {tuple(out.shape)}; expected {tuple(shape)}")
    if out.dtype != dtype:
        raise RuntimeError(f"{op}: out has dtype {out.dtype}; expected {dtype}")
    if out.device != device:
        raise RuntimeError(f"{op}: out is on {out.device}; expected {device}")
    if not out.is_contiguous():
        raise RuntimeError(f"{op}: out must be contiguous")


torch.library.define(
    "bitsandbytes::quantize_kbit",
    "(Tensor A, Tensor codebook, int k, ScalarType absmax_dtype) -> (Tensor, Tensor)",
)


@register_fake("bitsandbytes::quantize_kbit")
def _(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_args(A, codebook, k, absmax_dtype)
    nb = num_blocks(A.numel())
    packed = torch.empty(nb * k, dtype=torch.int32, device=A.device)
    absmax = torch.empty(nb, dtype=absmax_dtype, device=A.device)
    return packed, absmax


torch.library.define(
    "bitsandbytes::dequantize_kbit",
    "(Tensor packed, Tensor absmax, Tensor codebook, int k, int n, ScalarType dtype) -> Tensor",
)


@register_fake("bitsandbytes::dequantize_kbit")
def _(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    return torch.empty(n, dtype=dtype, device=packed.device)


def check_dequantize_out_args(packed, absmax, codebook, k: int, n: int, dtype, out: torch.Tensor) -> None:
    """dequantize_kbit's arguments, and an ``out`` that can hold its result."""
    check_dequantize_args(packed, absmax, codebook, k, n, dtype)
    check_out("dequantize_kbit", out, (n,), dtype, packed.device)


torch.library.define(
    "bitsandbytes::dequantize_kbit.out",
    "(Tensor packed, Tensor absmax, Tensor codebook, int k, int n, ScalarType dtype, Tensor! out) -> ()",
)


@register_fake("bitsandbytes::dequantize_kbit.out")
def _(packed, absmax, codebook, k: int, n: int, dtype: torch.dtype, out: torch.Tensor) -> None:
    check_dequantize_out_args(packed, absmax, codebook, k, n, dtype, out)


# ---------------------------------------------------------------- repack + fused GEMM
#
# The tiled layout is the kernel's own (_format.py holds its sizes). Repacked
# tensors are 2-D, [units, words per unit] and [units, absmax per unit], so a flat
# (quantize_kbit) buffer handed to kbit_gemm by mistake is rejected instead of read as garbage.
GEMM_DTYPES = (torch.float16, torch.bfloat16)
GEMM_ABSMAX_DTYPES = (torch.uint8, torch.float16)


@functools.lru_cache(maxsize=1024)
def tiled_shapes(k: int, N: int, K_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of repack_kbit's outputs: ([units, words per unit], [units, absmax per unit])."""
    words, absmax = tiled_sizes(k, N, K_dim)
    units = absmax // UNIT_ABSMAX
    return (units, words // units), (units, UNIT_ABSMAX)


def check_weight_shape(op: str, k: int, N: int, K_dim: int) -> None:
    """check_weight_args, and K_dim a whole number of quantization blocks."""
    check_weight_args(op, k, N, K_dim)
    if K_dim < 32 or K_dim % 32:
        raise RuntimeError(
            f"{op}: K_dim={K_dim} is not a multiple of 32 (the quantization block); pad the weight's rows "
            "(LinearKbit does this) or quantize a K_dim that is"
        )


def check_repack_args(packed: torch.Tensor, absmax: torch.Tensor, k: int, N: int, K_dim: int) -> None:
    op = "repack_kbit"
    check_weight_shape(op, k, N, K_dim)
    nb = N * K_dim // 32
    torch._check(packed.dtype == torch.int32, lambda: f"{op}: packed has dtype {packed.dtype}; expected torch.int32")
    torch._check(
        packed.numel() == nb * k,
        lambda: (
            f"{op}: packed has {packed.numel()} words; expected N*K_dim/32*k = {nb * k} for N={N}, K_dim={K_dim}, k={k}"
        ),
    )
    torch._check(
        absmax.dtype in GEMM_ABSMAX_DTYPES,
        lambda: f"{op}: absmax has dtype {absmax.dtype}; expected torch.uint8 (E4M4) or torch.float16",
    )
    torch._check(
        absmax.numel() == nb,
        lambda: f"{op}: absmax has {absmax.numel()} entries; expected N*K_dim/32 = {nb} for N={N}, K_dim={K_dim}",
    )
    check_same_device(op, packed=packed, absmax=absmax)


def check_gemm_args(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias) -> None:
    """kbit_gemm's arguments against each other and what the kernels assume (shapes, dtypes, devices).
    Every eager call runs this, so it is plain comparisons (a failed one builds the message)."""
    op = "kbit_gemm"
    check_weight_shape(op, k, N, K_dim)
    if A.dtype not in GEMM_DTYPES:
        raise RuntimeError(f"{op}: A has dtype {A.dtype}; expected torch.float16 or torch.bfloat16")
    if A.dim() < 1:
        raise RuntimeError(f"{op}: A must have at least one dimension, got a scalar")
    if A.shape[-1] != K_dim:
        raise RuntimeError(
            f"{op}: A has {A.shape[-1]} features (shape {tuple(A.shape)}); the weight has K_dim={K_dim}"
        )
    words_shape, absmax_shape = tiled_shapes(k, N, K_dim)
    if B_packed.dtype != torch.int32:
        raise RuntimeError(f"{op}: B_packed has dtype {B_packed.dtype}; expected torch.int32")
    if B_packed.shape != words_shape:
        raise RuntimeError(
            f"{op}: B_packed has shape {tuple(B_packed.shape)}; expected {words_shape} for k={k}, N={N}, "
            f"K_dim={K_dim} (the output of repack_kbit, not the flat quantize_kbit words)"
        )
    if B_absmax.dtype not in GEMM_ABSMAX_DTYPES:
        raise RuntimeError(f"{op}: B_absmax has dtype {B_absmax.dtype}; expected torch.uint8 (E4M4) or torch.float16")
    if B_absmax.shape != absmax_shape:
        raise RuntimeError(
            f"{op}: B_absmax has shape {tuple(B_absmax.shape)}; expected {absmax_shape} (the output of repack_kbit)"
        )
    check_codebook(op, codebook, k)
    device = A.device
    if bias is not None:
        if bias.shape != (N,):
            raise RuntimeError(f"{op}: bias has shape {tuple(bias.shape)}; expected ({N},)")
        if bias.dtype != A.dtype:
            raise RuntimeError(f"{op}: bias has dtype {bias.dtype}; expected {A.dtype} (A's)")
        if bias.device != device:
            check_same_device(op, A=A, bias=bias)
    if B_packed.device != device or B_absmax.device != device or codebook.device != device:
        check_same_device(op, A=A, B_packed=B_packed, B_absmax=B_absmax, codebook=codebook)


torch.library.define(
    "bitsandbytes::repack_kbit",
    "(Tensor packed, Tensor absmax, int k, int N, int K_dim) -> (Tensor, Tensor)",
)


@register_fake("bitsandbytes::repack_kbit")
def _(packed: torch.Tensor, absmax: torch.Tensor, k: int, N: int, K_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_repack_args(packed, absmax, k, N, K_dim)
    words_shape, absmax_shape = tiled_shapes(k, N, K_dim)
    return (
        torch.empty(words_shape, dtype=torch.int32, device=packed.device),
        torch.empty(absmax_shape, dtype=absmax.dtype, device=packed.device),
    )


torch.library.define(
    "bitsandbytes::kbit_gemm",
    "(Tensor A, Tensor B_packed, Tensor B_absmax, Tensor codebook, int k, int N, int K_dim, Tensor? bias=None) -> Tensor",
)


@register_fake("bitsandbytes::kbit_gemm")
def _(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias=None) -> torch.Tensor:
    check_gemm_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias)
    return torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)


torch.library.define(
    "bitsandbytes::kbit_gemm.out",
    "(Tensor A, Tensor B_packed, Tensor B_absmax, Tensor codebook, int k, int N, int K_dim, Tensor? bias, "
    "Tensor! out) -> ()",
)


def check_gemm_out_args(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias, out: torch.Tensor) -> None:
    """kbit_gemm's arguments, and an ``out`` that can hold its result."""
    check_gemm_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias)
    check_out("kbit_gemm", out, (*A.shape[:-1], N), A.dtype, A.device)


@register_fake("bitsandbytes::kbit_gemm.out")
def _(A, B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, bias, out: torch.Tensor) -> None:
    check_gemm_out_args(A, B_packed, B_absmax, codebook, k, N, K_dim, bias, out)


def check_dequantize_tiled_args(B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, dtype) -> None:
    op = "dequantize_kbit_tiled"
    check_weight_shape(op, k, N, K_dim)
    torch._check(
        dtype in GEMM_DTYPES, lambda: f"{op}: dtype={dtype} is not supported; expected torch.float16 or torch.bfloat16"
    )
    (units, words), (_, absmax_per_unit) = tiled_shapes(k, N, K_dim)
    torch._check(
        B_packed.dtype == torch.int32 and tuple(B_packed.shape) == (units, words),
        lambda: (
            f"{op}: B_packed is {B_packed.dtype} {tuple(B_packed.shape)}; expected torch.int32 {(units, words)} "
            "(the output of repack_kbit)"
        ),
    )
    torch._check(
        B_absmax.dtype in GEMM_ABSMAX_DTYPES and tuple(B_absmax.shape) == (units, absmax_per_unit),
        lambda: (
            f"{op}: B_absmax is {B_absmax.dtype} {tuple(B_absmax.shape)}; expected uint8 or float16 "
            f"{(units, absmax_per_unit)} (the output of repack_kbit)"
        ),
    )
    check_codebook(op, codebook, k)
    check_same_device(op, B_packed=B_packed, B_absmax=B_absmax, codebook=codebook)


# The weight a repacked (tiled) tensor holds, W[N, K_dim] in dtype: for backward passes, merges and
# the large-M path, without keeping a flat copy of the packed weight.
torch.library.define(
    "bitsandbytes::dequantize_kbit_tiled",
    "(Tensor B_packed, Tensor B_absmax, Tensor codebook, int k, int N, int K_dim, ScalarType dtype) -> Tensor",
)


@register_fake("bitsandbytes::dequantize_kbit_tiled")
def _(B_packed, B_absmax, codebook, k: int, N: int, K_dim: int, dtype) -> torch.Tensor:
    check_dequantize_tiled_args(B_packed, B_absmax, codebook, k, N, K_dim, dtype)
    return torch.empty((N, K_dim), dtype=dtype, device=B_packed.device)
