"""torch.library definitions of the k-bit ops (namespace ``bitsandbytes``) and their fake
implementations.

The argument checks live here, one function per op, and run three times over: in the fake
implementation (shapes and dtypes under torch.compile), in the default backend and in the CUDA
backend (eager calls reach a backend without passing through the fake). Each message names the
argument, what was given and what is expected.
"""

import torch

register_fake = torch.library.register_fake
register_kernel = torch.library.register_kernel

BLOCKSIZE = 32  # elements per quantization block (normative, DESIGN.md section 3)
SUPPORTED_K = (2, 3, 4, 5)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# absmax storage: uint8 is E4M4 (seed 000 section 1.5); float16 / float32 hold the scale itself.
ABSMAX_DTYPES = (torch.uint8, torch.float16, torch.float32)


def num_blocks(n: int) -> int:
    return (n + BLOCKSIZE - 1) // BLOCKSIZE


def check_k(op: str, k: int) -> None:
    torch._check(k in SUPPORTED_K, lambda: f"{op}: k={k} is not supported; expected one of {SUPPORTED_K}")


def check_codebook(op: str, codebook: torch.Tensor, k: int) -> None:
    torch._check(
        codebook.dtype == torch.float32,
        lambda: f"{op}: codebook has dtype {codebook.dtype}; expected torch.float32",
    )
    torch._check(
        codebook.dim() == 1 and 1 <= codebook.numel() <= 2**k,
        lambda: f"{op}: codebook has shape {tuple(codebook.shape)}; expected a 1-D tensor of 1..{2**k} entries for k={k}",
    )


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    torch._check(
        all(d == first for d in devices.values()),
        lambda: f"{op}: all tensors must be on one device; got "
        + ", ".join(f"{name} on {d}" for name, d in devices.items()),
    )


def check_quantize_args(A: torch.Tensor, codebook: torch.Tensor, k: int, absmax_dtype: torch.dtype) -> None:
    op = "quantize_kbit"
    check_k(op, k)
    torch._check(A.dtype in INPUT_DTYPES, lambda: f"{op}: A has dtype {A.dtype}; expected one of {INPUT_DTYPES}")
    check_codebook(op, codebook, k)
    torch._check(
        absmax_dtype in ABSMAX_DTYPES,
        lambda: f"{op}: absmax_dtype={absmax_dtype} is not supported; expected one of {ABSMAX_DTYPES} "
        "(uint8 = E4M4)",
    )
    check_same_device(op, A=A, codebook=codebook)


def check_dequantize_args(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int, n: int, dtype: torch.dtype
) -> None:
    op = "dequantize_kbit"
    check_k(op, k)
    torch._check(n >= 0, lambda: f"{op}: n={n} must be >= 0")
    torch._check(
        packed.dtype == torch.int32, lambda: f"{op}: packed has dtype {packed.dtype}; expected torch.int32"
    )
    torch._check(
        absmax.dtype in ABSMAX_DTYPES,
        lambda: f"{op}: absmax has dtype {absmax.dtype}; expected one of {ABSMAX_DTYPES} (uint8 = E4M4)",
    )
    torch._check(dtype in INPUT_DTYPES, lambda: f"{op}: dtype={dtype} is not supported; expected one of {INPUT_DTYPES}")
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
    torch._check(
        tuple(out.shape) == tuple(shape),
        lambda: f"{op}: out has shape {tuple(out.shape)}; expected {tuple(shape)}",
    )
    torch._check(out.dtype == dtype, lambda: f"{op}: out has dtype {out.dtype}; expected {dtype}")
    torch._check(out.device == device, lambda: f"{op}: out is on {out.device}; expected {device}")
    torch._check(out.is_contiguous(), lambda: f"{op}: out must be contiguous")


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


torch.library.define(
    "bitsandbytes::dequantize_kbit.out",
    "(Tensor packed, Tensor absmax, Tensor codebook, int k, int n, ScalarType dtype, Tensor! out) -> ()",
)


@register_fake("bitsandbytes::dequantize_kbit.out")
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

