"""``LinearKbit``: a drop-in ``nn.Linear`` whose weight is stored in k bits (k = 2..5).

What the module holds (all of it is in ``state_dict``, nothing else is needed to rebuild it):

- ``weight``: ``nn.Parameter(requires_grad=False)``, int32, the flat packed words of
  ``quantize_kbit(W_padded)`` (1-D, ``out_features * padded_in_features / 32 * k`` words). Before
  quantization it is the ordinary float ``[out_features, in_features]`` weight of ``nn.Linear``.
- ``absmax``: buffer, uint8 E4M4, one scale per block of 32 (``out_features * padded_in_features / 32``).
- ``codebook``: buffer, float32, at most 2^k levels.
- ``kbit_format``: buffer, int32 ``[format version, k, out_features, in_features, padded_in_features]``.

The packed shape always differs from the float shape, so a k-bit checkpoint can never be read
silently as a float ``nn.Linear``. ``padded_in_features`` is ``in_features`` rounded up to a
multiple of 32: rows are zero-padded before quantization and the input is zero-padded in
``forward``, so the pad columns contribute nothing.

The tiled layout that ``kbit_gemm`` reads is built from the flat tensors with ``repack_kbit``
the first time the module runs on a device with the fused kernel, then cached on the module
(never in ``state_dict``); moving the module, quantizing or loading a state dict drops it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import _cpu
from .. import functional as kbit_F
from .._ops import ABSMAX_DTYPES, BLOCKSIZE, GEMM_DTYPES, SUPPORTED_K, check_k

__all__ = ["KBIT_FORMAT_VERSION", "LinearKbit", "ParamsKbit", "fuse_projections"]

# Version of the serialized layout described in the module docstring. Bump it when the meaning of
# the stored tensors changes; the tiled (repacked) layout is not serialized and needs no bump.
KBIT_FORMAT_VERSION = 1
_FORMAT_FIELDS = ("format_version", "k", "out_features", "in_features", "padded_in_features")
# Serializes the lazy quantize / repack of every LinearKbit (taken only when the layout changes, see
# LinearKbit._ensure_layout). Module-level, so modules stay picklable and deep-copyable.
_LAYOUT_LOCK = threading.RLock()


def padded_features(in_features: int) -> int:
    """in_features rounded up to a multiple of the quantization block (32)."""
    return -(-in_features // BLOCKSIZE) * BLOCKSIZE


def packed_sizes(k: int, out_features: int, in_features: int) -> tuple[int, int]:
    """(int32 words of the packed weight, number of absmax bytes) of a k-bit [out, in] weight."""
    blocks = out_features * padded_features(in_features) // BLOCKSIZE
    return blocks * k, blocks


@dataclass
class ParamsKbit:
    """A weight W[out_features, in_features] quantized to k bits, in the flat (checkpoint) format.

    This is the parameter class of ``LinearKbit`` in the sense of bitsandbytes' ``Params4bit``, but
    deliberately not a tensor subclass (torch.compile graph-breaks on those): the module keeps
    ``packed`` as a plain int32 ``nn.Parameter`` and ``absmax`` / ``codebook`` as buffers, and
    ``LinearKbit.quant_params`` returns them bundled in this object.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    codebook: torch.Tensor
    k: int
    out_features: int
    in_features: int

    @property
    def padded_in_features(self) -> int:
        return padded_features(self.in_features)

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, k: int = 4, codebook: None | str | torch.Tensor = None, scale_method: str = "mse"
    ) -> ParamsKbit:
        """Quantize a float weight [out_features, in_features] (rows zero-padded to a multiple of 32).
        codebook None: the default for k; scale_method: as ``quantize_kbit``."""
        torch._check(
            weight.dim() == 2,
            lambda: f"ParamsKbit.quantize: weight has shape {tuple(weight.shape)}; expected 2-D [out, in]",
        )
        torch._check(
            weight.is_floating_point(),
            lambda: f"ParamsKbit.quantize: weight has dtype {weight.dtype}; expected a floating-point tensor",
        )
        if weight.device.type == "meta":
            raise ValueError(
                "ParamsKbit.quantize: weight is on the meta device (no values); load or materialize it first"
            )
        out_features, in_features = weight.shape
        W = weight.detach()
        amax = float(W.abs().max()) if W.numel() else 0.0
        if amax > kbit_F.E4M4_MAX:
            raise ValueError(
                f"LinearKbit: the weight has max |w| = {amax:g}, above the largest E4M4 block scale "
                f"({kbit_F.E4M4_MAX:g}) that LinearKbit stores; scale the weight down (and the layer's output up "
                "by the same factor), or keep this layer in float (skip_modules)"
            )
        pad = padded_features(in_features) - in_features
        if pad:
            W = F.pad(W, (0, pad))
        packed, absmax, cb = kbit_F.quantize_kbit(W.contiguous(), k=k, codebook=codebook, scale_method=scale_method)
        return cls(packed, absmax, cb, k, out_features, in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out_features, in_features] (the row padding removed)."""
        K = self.padded_in_features
        W = kbit_F.dequantize_kbit(
            self.packed, self.absmax, self.codebook, self.k, self.out_features * K, dtype=dtype
        ).view(self.out_features, K)
        return W[:, : self.in_features] if K != self.in_features else W


def _dequantize_padded(packed, absmax, codebook, k: int, N: int, K_pad: int, dtype: torch.dtype) -> torch.Tensor:
    return kbit_F.dequantize_kbit(packed, absmax, codebook, k, N * K_pad, dtype=dtype).view(N, K_pad)


def _flat_from_tiled(weight, absmax, k: int, N: int, K_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat (checkpoint) words and scales of a repacked weight, bit-exact (pure PyTorch, any device)."""
    return kbit_F.unrepack_kbit(weight, absmax, k, N, K_pad)


def _dequantize_stored(weight, absmax, codebook, k: int, N: int, K_pad: int, dtype: torch.dtype, tiled: bool):
    """W [N, K_pad] from the module's storage, flat or repacked."""
    if tiled:
        if dtype in GEMM_DTYPES:
            return torch.ops.bitsandbytes.dequantize_kbit_tiled(weight, absmax, codebook, k, N, K_pad, dtype)
        weight, absmax = _flat_from_tiled(weight, absmax, k, N, K_pad)
    return _dequantize_padded(weight, absmax, codebook, k, N, K_pad, dtype)


class _KbitLinearFunction(torch.autograd.Function):
    """y = x @ W^T + bias with W in k bits. x is already padded to K_pad features and in the compute
    dtype. weight/absmax are the module's storage: repacked (tiled) for the fused kernel, else flat.
    Backward: grad_x = grad_y @ W from a temporary dequantized W (freed right after), grad_bias
    = sum of grad_y; never a gradient for the packed weight, absmax or codebook."""

    @staticmethod
    def forward(ctx, x, weight, absmax, codebook, bias, tiled: bool, k: int, N: int, K_pad: int):
        ctx.save_for_backward(weight, absmax, codebook)
        ctx.kbit_shape = (k, N, K_pad, tiled)
        if tiled:
            # The fused kernel (float16 / bfloat16 only).
            return kbit_F.kbit_gemm(x, weight, absmax, codebook, k, N, K_pad, bias=bias)
        # Devices without the fused kernel, and float32 compute: the same arithmetic as the default
        # backend's kbit_gemm (float32 weight, float32 accumulation, cast to x's dtype), read from
        # the flat format so no repack is needed. On the CPU the native kernels do it without a float W.
        if x.device.type == "cpu" and _cpu.AVAILABLE:
            return _cpu.linear_any(x, weight, absmax, codebook, k, N, K_pad, K_pad, bias)
        W = _dequantize_padded(weight, absmax, codebook, k, N, K_pad, torch.float32)
        y = x.reshape(-1, K_pad).to(torch.float32) @ W.t()
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, grad_y):
        weight, absmax, codebook = ctx.saved_tensors
        k, N, K_pad, tiled = ctx.kbit_shape
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            W = _dequantize_stored(weight, absmax, codebook, k, N, K_pad, grad_y.dtype, tiled)
            grad_x = grad_y @ W
        if ctx.needs_input_grad[4]:
            grad_bias = grad_y.reshape(-1, N).sum(0)
        return grad_x, None, None, None, grad_bias, None, None, None, None


def _needs_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a call must record autograd: grad mode on and the input or the bias requires grad."""
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def _tiled_gemm(x, compute_dtype, weight, absmax, codebook, k: int, N: int, K_pad: int, bias) -> torch.Tensor:
    """x [..., <= K_pad] times a tiled k-bit weight [N, K_pad] (+ bias) by the fused kernel, without autograd: x cast to
    compute_dtype and zero-padded to K_pad features; the output in x's dtype."""
    h = x if x.dtype == compute_dtype else x.to(compute_dtype)
    if h.shape[-1] != K_pad:
        h = F.pad(h, (0, K_pad - h.shape[-1]))
    if bias is not None and bias.dtype != compute_dtype:
        bias = bias.to(compute_dtype)
    y = kbit_F._kbit_gemm_prepared(h, weight, absmax, codebook, k, N, K_pad, bias)
    return y if y.dtype == x.dtype else y.to(x.dtype)


class LinearKbit(nn.Linear):
    """A linear layer with a k-bit blockwise-quantized weight (blocksize 32, E4M4 absmax, codebook).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        k: bits per weight, 2..5.
        codebook: None (the default for k, see ``quantize_kbit``), a built-in name (``"lloyd"``,
            ``"lloyd-zero"``, ``"nf"``, ``"uniform"``, ``"fp4"``) or a float tensor of at most 2^k levels.
        scale_method: how the weight's block scales are chosen, as ``quantize_kbit``: ``"mse"``
            (default) or ``"absmax"``.
        compute_dtype: dtype of the matmul. None: the input's dtype. float16 / bfloat16 use the fused
            ``kbit_gemm`` on CUDA; float32 dequantizes and multiplies. On the CPU every compute dtype runs
            the native CPU kernels when they were built (float32 accumulation, no float copy of the weight).
            The output has the input's dtype.
        device, dtype: where and in which float dtype the (not yet quantized) weight is created.

    The weight is quantized by ``from_linear``, when a float weight is moved to a CUDA device
    (``.cuda()`` / ``.to("cuda")``), by ``quantize_()``, or at the first forward. ``.to(dtype)``,
    ``.half()`` etc. cast the bias only: the packed weight, absmax, codebook and format never change
    dtype.
    """

    # Device types on which forward runs the fused kbit_gemm on the repacked (tiled) weight. Elsewhere
    # the flat weight is multiplied as the default backend's kbit_gemm computes it (float32 weight values,
    # float32 accumulation), without its repack: on the CPU by the native kernels (bitsandbytes_kbit._cpu),
    # else by dequantize + matmul. Per instance or per class; tests add "cpu" to run the tiled path.
    fused_device_types: tuple[str, ...] = ("cuda",)
    # Device types where moving a float weight (.to / .cuda) quantizes it, as bitsandbytes' Linear4bit does.
    quantize_on_move_device_types: tuple[str, ...] = ("cuda",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        k: int = 4,
        codebook: None | str | torch.Tensor = None,
        compute_dtype: torch.dtype | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        scale_method: str = "mse",
    ):
        check_k("LinearKbit", k)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LinearKbit: {name}={value!r}; expected an integer >= 1")
        torch._check(
            compute_dtype is None or compute_dtype in (torch.float16, torch.bfloat16, torch.float32),
            lambda: (
                f"LinearKbit: compute_dtype={compute_dtype} is not supported; expected None, torch.float16, "
                "torch.bfloat16 or torch.float32"
            ),
        )
        torch._check(
            scale_method in kbit_F.SCALE_METHODS,
            lambda: (
                f"LinearKbit: scale_method={scale_method!r} is not supported; expected one of {kbit_F.SCALE_METHODS}"
            ),
        )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.k = k
        self.scale_method = scale_method
        self.padded_in_features = padded_features(in_features)
        self.compute_dtype = compute_dtype
        self.weight.requires_grad_(False)
        _, n_blocks = packed_sizes(k, out_features, in_features)
        cb_device = self.weight.device
        self.register_buffer("absmax", torch.zeros(n_blocks, dtype=torch.uint8, device=cb_device))
        self.register_buffer("codebook", kbit_F.resolve_codebook(codebook, k, cb_device).clone())
        self.register_buffer("kbit_format", self._format_tensor(cb_device))
        # Storage layout of weight/absmax: False = flat (checkpoint format), True = repacked for the
        # fused kernel. One copy only: a fused device converts in place at the first forward.
        self._tiled = False
        # The _FusedProjections group serving this layer with its siblings (fuse_projections), or None.
        self._fused: _FusedProjections | None = None

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        k: int = 4,
        codebook: None | str | torch.Tensor = None,
        compute_dtype: torch.dtype | None = None,
        scale_method: str = "mse",
    ) -> LinearKbit:
        """A quantized copy of ``linear`` on the same device (the float weight is not kept)."""
        torch._check(
            isinstance(linear, nn.Linear),
            lambda: f"LinearKbit.from_linear: linear is a {type(linear).__name__}; expected an nn.Linear",
        )
        weight = linear.weight.detach()
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            k=k,
            codebook=codebook,
            compute_dtype=compute_dtype,
            device="meta",
            dtype=weight.dtype,
            scale_method=scale_method,
        )
        module.codebook = kbit_F.resolve_codebook(codebook, k, weight.device).clone()
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        module.set_quant_params(ParamsKbit.quantize(weight, k=k, codebook=module.codebook, scale_method=scale_method))
        return module

    @classmethod
    def empty_quantized(
        cls, in_features: int, out_features: int, *, device=None, absmax_dtype: torch.dtype = torch.uint8, **kwargs
    ) -> LinearKbit:
        """A module whose tensors already have the quantized shapes and dtypes (packed weight and absmax
        zeroed): the target of ``load_state_dict`` or, on ``meta``, of a pre-quantized checkpoint load.
        kwargs: the constructor's other arguments (bias, k, codebook, compute_dtype, dtype).
        device: default ``torch.get_default_device()``."""
        device = torch.device(device) if device is not None else torch.get_default_device()
        module = cls(in_features, out_features, device="meta", **kwargs)
        k, codebook = module.k, kwargs.get("codebook")
        n_words, n_blocks = packed_sizes(k, out_features, in_features)
        module.weight = nn.Parameter(torch.empty(n_words, dtype=torch.int32, device="meta"), requires_grad=False)
        module.absmax = torch.empty(n_blocks, dtype=absmax_dtype, device="meta")
        if device.type != "meta":
            module = module.to_empty(device=device)
            with torch.no_grad():
                for t in (module.weight, module.absmax, module.bias):
                    if t is not None:
                        t.zero_()
                module.codebook.copy_(kbit_F.resolve_codebook(codebook, k, device))
                module.kbit_format.copy_(module._format_tensor(device))
        return module

    def _format_tensor(self, device) -> torch.Tensor:
        values = (KBIT_FORMAT_VERSION, self.k, self.out_features, self.in_features, self.padded_in_features)
        return torch.tensor(values, dtype=torch.int32, device=device)

    # ------------------------------------------------------------------ quantized state

    @property
    def weight_numel(self) -> int:
        """The number of weights the layer represents (out_features * in_features), whatever their storage;
        ``weight.numel()`` counts packed int32 words once quantized."""
        return self.out_features * self.in_features

    @property
    def is_quantized(self) -> bool:
        return not self.weight.is_floating_point()

    @property
    def quant_params(self) -> ParamsKbit:
        """The flat quantized weight (packed, absmax, codebook, k, shape)."""
        torch._check(self.is_quantized, lambda: "LinearKbit.quant_params: the weight is not quantized yet")
        packed, absmax = self.weight, self.absmax
        if self._tiled:
            packed, absmax = _flat_from_tiled(packed, absmax, self.k, self.out_features, self.padded_in_features)
        return ParamsKbit(packed, absmax, self.codebook, self.k, self.out_features, self.in_features)

    def set_quant_params(self, params: ParamsKbit) -> None:
        """Replace the weight by an already-quantized one (same shape; k and codebook may change)."""
        torch._check(
            (params.out_features, params.in_features) == (self.out_features, self.in_features),
            lambda: (
                f"LinearKbit.set_quant_params: weight shape {(params.out_features, params.in_features)} does "
                f"not match the layer's {(self.out_features, self.in_features)}"
            ),
        )
        # The weight goes in last: forward's lock-free check reads it (is_quantized), so the other
        # tensors must already be in place when it turns int32.
        self._unfuse()
        self._tiled = False
        self.k = params.k
        self.absmax = params.absmax
        self.codebook = params.codebook
        self.kbit_format = self._format_tensor(params.packed.device)
        self.weight = nn.Parameter(params.packed, requires_grad=False)

    @torch.no_grad()
    def quantize_(self) -> LinearKbit:
        """Quantize the float weight in place (no-op if it is already quantized)."""
        if not self.is_quantized:
            torch._check(
                self.weight.device.type != "meta",
                lambda: "LinearKbit.quantize_: the weight is on the meta device; load or materialize it first",
            )
            if tuple(self.weight.shape) != (self.out_features, self.in_features):
                raise RuntimeError(
                    f"LinearKbit: weight is a {self.weight.dtype} tensor of shape {tuple(self.weight.shape)}; expected "
                    f"the packed int32 weight (or a float [{self.out_features}, {self.in_features}] one). The packed "
                    "weight was probably cast to float (e.g. `p.data = p.data.to(torch.float32)` over all 1-D "
                    "parameters): skip int32 parameters when casting, and reload the model"
                )
            codebook = self.codebook.to(self.weight.device)
            params = ParamsKbit.quantize(self.weight, k=self.k, codebook=codebook, scale_method=self.scale_method)
            self.set_quant_params(params)
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out_features, in_features] (a new tensor; the module keeps the packed one).
        dtype: default compute_dtype, else float32."""
        dtype = dtype or self.compute_dtype or torch.float32
        if not self.is_quantized:
            return self.weight.detach().to(dtype)
        W = _dequantize_stored(
            self.weight,
            self.absmax,
            self.codebook,
            self.k,
            self.out_features,
            self.padded_in_features,
            dtype,
            self._tiled,
        )
        return W[:, : self.in_features] if self.padded_in_features != self.in_features else W

    def check_format(self) -> None:
        """Raise if ``kbit_format`` (as loaded) disagrees with this module (version, k, shape)."""
        if not self.is_quantized or self.kbit_format.device.type == "meta":
            return
        got = dict(zip(_FORMAT_FIELDS, self.kbit_format.tolist()))
        want = dict(zip(_FORMAT_FIELDS, self._format_tensor("cpu").tolist()))
        if got["format_version"] > KBIT_FORMAT_VERSION:
            raise ValueError(
                f"LinearKbit: the checkpoint has k-bit format version {got['format_version']}; this bitsandbytes-kbit "
                f"reads versions up to {KBIT_FORMAT_VERSION}: upgrade bitsandbytes-kbit"
            )
        if got != want:
            raise ValueError(f"LinearKbit: the stored k-bit format {got} does not match the layer ({want})")
        n_words, n_blocks = packed_sizes(self.k, self.out_features, self.in_features)
        if not self._tiled and self.weight.numel() != n_words or self.absmax.numel() != n_blocks:
            raise ValueError(
                f"LinearKbit: packed weight has {self.weight.numel()} words and absmax {self.absmax.numel()} entries; "
                f"expected {n_words} and {n_blocks} for k={self.k}, shape {(self.out_features, self.in_features)}"
            )

    # ------------------------------------------------------------------ dtype guard, device moves, loading

    def _storage_tensors(self) -> list[torch.Tensor]:
        tensors = [self.absmax, self.codebook, self.kbit_format]
        if self.is_quantized:
            tensors.append(self.weight)
        return tensors

    def _apply(self, fn, recurse: bool = True):
        # nn.Module.to(dtype), .half(), .bfloat16(), .type(...) all come through here: let them move
        # the packed weight, absmax, codebook and format between devices but never change their dtype.
        keep = {id(t) for t in self._storage_tensors()}
        was_on = self.weight.device.type
        self._unfuse()

        def guarded(t):
            out = fn(t)
            if id(t) in keep and out.dtype != t.dtype:
                out = t.to(device=out.device)
            return out

        result = super()._apply(guarded, recurse)
        if self._tiled and self.weight.device.type not in self.fused_device_types:
            self._to_flat()  # the repacked layout serves only the fused kernel
        # A float weight moved to a GPU is quantized there (as bitsandbytes' Linear4bit does). Not after
        # to_empty() from meta: that weight holds no values yet.
        if (
            not self.is_quantized
            and self.weight.device.type in self.quantize_on_move_device_types
            and was_on != "meta"
        ):
            self.quantize_()
        return result

    def _kbit_state_error(self, state_dict, prefix: str) -> str | None:
        """Why the k-bit tensors in ``state_dict`` cannot be loaded into this layer (None: they can).
        Checks everything (format, k, shapes, dtypes, codebook length against the stored indices)
        before loading changes anything."""
        weight = state_dict[prefix + "weight"]
        fmt = state_dict.get(prefix + "kbit_format")
        absmax = state_dict.get(prefix + "absmax")
        codebook = state_dict.get(prefix + "codebook")
        missing = [name for name, t in (("kbit_format", fmt), ("absmax", absmax), ("codebook", codebook)) if t is None]
        if missing:
            return (
                f"{prefix}weight is a packed k-bit weight ({weight.dtype}) but the state dict lacks "
                f"{', '.join(prefix + m for m in missing)}; a k-bit weight loads only with its kbit_format, absmax "
                "and codebook"
            )
        if fmt.dtype not in (torch.int32, torch.int64) or tuple(fmt.shape) != (len(_FORMAT_FIELDS),):
            return f"{prefix}kbit_format is {fmt.dtype} {tuple(fmt.shape)}; expected int32 ({len(_FORMAT_FIELDS)},)"
        fields = dict(zip(_FORMAT_FIELDS, fmt.tolist()))
        if fields["format_version"] > KBIT_FORMAT_VERSION:
            return (
                f"{prefix}kbit_format: format version {fields['format_version']} is newer than this "
                f"bitsandbytes-kbit reads ({KBIT_FORMAT_VERSION}): upgrade bitsandbytes-kbit"
            )
        if fields["format_version"] < 1:
            return f"{prefix}kbit_format: format version {fields['format_version']}; expected 1..{KBIT_FORMAT_VERSION}"
        k = fields["k"]
        if k not in SUPPORTED_K:
            return f"{prefix}kbit_format: k={k} is not supported; expected one of {SUPPORTED_K}"
        if (fields["out_features"], fields["in_features"]) != (self.out_features, self.in_features):
            return (
                f"{prefix}kbit_format: the stored weight has shape {(fields['out_features'], fields['in_features'])}; "
                f"this layer has {(self.out_features, self.in_features)}"
            )
        if fields["padded_in_features"] != self.padded_in_features:
            return (
                f"{prefix}kbit_format: padded_in_features={fields['padded_in_features']}; expected "
                f"{self.padded_in_features} for in_features={self.in_features}"
            )
        n_words, n_blocks = packed_sizes(k, self.out_features, self.in_features)
        if weight.dtype != torch.int32 or weight.dim() != 1 or weight.numel() != n_words:
            return (
                f"{prefix}weight is {weight.dtype} {tuple(weight.shape)}; expected int32 ({n_words},) for k={k}, "
                f"shape {(self.out_features, self.in_features)} (truncated or not a k-bit checkpoint?)"
            )
        if absmax.dtype not in ABSMAX_DTYPES or absmax.dim() != 1 or absmax.numel() != n_blocks:
            return (
                f"{prefix}absmax is {absmax.dtype} {tuple(absmax.shape)}; expected ({n_blocks},) of one of "
                f"{ABSMAX_DTYPES} (uint8 = E4M4)"
            )
        if codebook.dtype != torch.float32 or codebook.dim() != 1 or not 1 <= codebook.numel() <= 2**k:
            return (
                f"{prefix}codebook is {codebook.dtype} {tuple(codebook.shape)}; expected float32 with 1..{2**k} "
                f"entries for k={k}"
            )
        if codebook.device.type != "meta":
            if not bool(torch.isfinite(codebook).all()):
                return f"{prefix}codebook contains NaN or Inf; expected finite values"
            if codebook.numel() > 1 and not bool((codebook[1:] >= codebook[:-1]).all()):
                # the stored indices refer to sorted levels (quantize_kbit sorts; dequantize sorts what it is given)
                return f"{prefix}codebook is not in ascending order; expected the sorted levels quantize_kbit writes"
        if codebook.numel() < 2**k and weight.device.type != "meta":
            top = kbit_F.max_stored_index(weight, k)
            if top >= codebook.numel():
                return (
                    f"{prefix}codebook has {codebook.numel()} entries but the packed weight uses index {top}; "
                    "expected a codebook with an entry for every stored index"
                )
        return None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        weight = state_dict.get(prefix + "weight")
        # Shapes torch would refuse only after copying the other tensors: refused first, so nothing changes.
        bias = state_dict.get(prefix + "bias")
        if isinstance(bias, torch.Tensor) and self.bias is not None and bias.shape != self.bias.shape:
            error_msgs.append(f"{prefix}bias has shape {tuple(bias.shape)}; expected ({self.out_features},)")
            return
        logical = (self.out_features, self.in_features)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point() and tuple(weight.shape) != logical:
            error_msgs.append(f"{prefix}weight is a float tensor of shape {tuple(weight.shape)}; expected {logical}")
            return
        if weight is not None and not weight.is_floating_point():
            # A k-bit state. Validate all of it first: nothing in the module changes if it is refused.
            error = self._kbit_state_error(state_dict, prefix)
            if error is not None:
                error_msgs.append(error)
                return
            # Give our tensors the state's shapes and dtypes, so that the default loading copies into
            # them (bit-identical), whatever state this module was in.
            fmt = state_dict[prefix + "kbit_format"]
            dev = self.weight.device
            with torch.no_grad(), _LAYOUT_LOCK:
                self._unfuse()
                self._tiled = False
                self.k = int(fmt[1])
                self.absmax = torch.empty_like(state_dict[prefix + "absmax"], device=dev)
                self.codebook = torch.empty_like(state_dict[prefix + "codebook"], device=dev)
                self.kbit_format = torch.empty_like(fmt, device=dev)
                self.weight = nn.Parameter(torch.empty_like(weight, device=dev), requires_grad=False)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if weight is not None:
            self._tiled = False  # a loaded weight is flat; a partial load (PEFT adapters) leaves the layout alone

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_tiled", False)
        self.__dict__.setdefault("_fused", None)

    def _unfuse(self) -> None:
        """Leave the sibling group (fuse_projections) before this layer's tensors change: every member then runs on
        its own again (their tensors stay views of the group's, with the same values)."""
        group = self.__dict__.get("_fused")
        if group is not None:
            for member in group.members:
                member._fused = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Checkpoints hold the flat format whatever the storage layout (DESIGN.md section 3).
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._tiled:
            packed, absmax = _flat_from_tiled(
                self.weight, self.absmax, self.k, self.out_features, self.padded_in_features
            )
            destination[prefix + "weight"] = packed if keep_vars else packed.detach()
            destination[prefix + "absmax"] = absmax

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def _to_tiled(self) -> None:
        """Repack the weight in place for the fused kernel (once per load or quantization); the flat
        words are freed, so one copy of the packed weight exists."""
        if not self._tiled:
            self._unfuse()
            B_packed, B_absmax = kbit_F.repack_kbit(
                self.weight, self.absmax, self.k, self.out_features, self.padded_in_features
            )
            self.weight.data = B_packed
            self.absmax = B_absmax
            self._tiled = True

    @torch.no_grad()
    def _to_flat(self) -> None:
        if self._tiled:
            self._unfuse()
            packed, absmax = _flat_from_tiled(
                self.weight, self.absmax, self.k, self.out_features, self.padded_in_features
            )
            self.weight.data = packed
            self.absmax = absmax
            self._tiled = False

    def _ensure_layout(self, fused: bool) -> None:
        """Quantize the weight if it is still float, and store it tiled (``fused``) or flat.

        Thread-safe: several threads may run the first forward of one module at once. Double-checked
        locking: callers test ``not self.is_quantized or fused != self._tiled`` without the lock, and
        only a layout change takes it. The weight is the last tensor each conversion replaces, so a
        thread that sees it in the wanted state also sees its absmax."""
        with _LAYOUT_LOCK:
            if not self.is_quantized:
                self.quantize_()
            if fused != self._tiled:
                self._to_tiled() if fused else self._to_flat()

    def prepare_for_inference(self) -> LinearKbit:
        """Quantize if needed and build the repacked weight now (instead of at the first forward)."""
        self._ensure_layout(self.weight.device.type in self.fused_device_types)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Plain checks (Dynamo folds them; a torch._check closure breaks the graph).
        if not x.is_floating_point():
            raise TypeError(f"LinearKbit: input has dtype {x.dtype}; expected a floating-point tensor")
        if x.dim() == 0:
            raise ValueError("LinearKbit: input is a 0-d tensor; expected shape [..., in_features]")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"LinearKbit: input has {x.shape[-1]} features; expected in_features={self.in_features}")
        compute_dtype = self.compute_dtype or x.dtype
        if self._fused is not None and self._tiled and self._fused.serves(x, compute_dtype, self.bias):
            return self._fused.output(self, x, compute_dtype)
        fused = compute_dtype in GEMM_DTYPES and x.device.type in self.fused_device_types
        if fused != self._tiled or not (fused or self.is_quantized):  # a tiled weight is quantized
            self._ensure_layout(fused)
        bias = self.bias
        inference = not _needs_grad(x, bias)
        if fused and inference:
            # Inference: no autograd node, and an eager call goes straight to the kernel.
            return _tiled_gemm(
                x,
                compute_dtype,
                self.weight,
                self.absmax,
                self.codebook,
                self.k,
                self.out_features,
                self.padded_in_features,
                bias,
            )
        h = x if x.dtype == compute_dtype else x.to(compute_dtype)
        if bias is not None and bias.dtype != compute_dtype:
            bias = bias.to(compute_dtype)
        if inference and not fused and h.device.type == "cpu" and _cpu.AVAILABLE:
            # The CPU kernels read the flat weight and the unpadded input (no float copy of W, no pad).
            y = _cpu.linear_any(
                h,
                self.weight,
                self.absmax,
                self.codebook,
                self.k,
                self.out_features,
                self.in_features,
                self.padded_in_features,
                bias,
            )
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if self.padded_in_features != self.in_features:
            h = F.pad(h, (0, self.padded_in_features - self.in_features))
        y = _KbitLinearFunction.apply(
            h,
            self.weight,
            self.absmax,
            self.codebook,
            bias,
            fused,
            self.k,
            self.out_features,
            self.padded_in_features,
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        cd = f", compute_dtype={self.compute_dtype}" if self.compute_dtype is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"k={self.k}, codebook_size={self.codebook.numel()}{cd}"
        )


# Sibling projections that read the same input in the blocks of common decoder models (Llama, Mistral, Qwen2, Gemma,
# ...): attention's q/k/v and the gated MLP's gate/up.
FUSABLE_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _FusedProjections:
    """Sibling ``LinearKbit`` layers that read one input, served by one ``kbit_gemm`` over their concatenated rows.

    The members' tiled weights, absmax and biases are views into the group's concatenated tensors (one copy). The
    first member called with an input tensor runs the GEMM for all of them; a sibling called with the same tensor
    object takes its columns of that output. A member called with another tensor (cross-attention's k and v) runs
    the GEMM again, so results never depend on the call order; once every member has taken its columns, the group
    lets go of the input and output. An input must not change in place between its siblings' calls."""

    def __init__(self, members: list[LinearKbit]):
        first = members[0]
        self.members = members
        self.k, self.K_pad, self.device = first.k, first.padded_in_features, first.weight.device
        self.compute_dtype = first.compute_dtype
        self.N = sum(m.out_features for m in members)
        start = 0
        for m in members:  # the member's columns of the group's output
            m._fused_columns = (start, start + m.out_features)
            start += m.out_features
        with torch.no_grad():
            self.weight = torch.cat([m.weight.data for m in members])
            self.absmax = torch.cat([m.absmax for m in members])
            self.bias = torch.cat([m.bias.data for m in members]) if first.bias is not None else None
            self.codebook = first.codebook
            w0 = a0 = b0 = 0
            for m in members:  # each member's tensors become views of the group's (concatenated along dim 0)
                nw, na = m.weight.shape[0], m.absmax.shape[0]
                m.weight.data = self.weight[w0 : w0 + nw]
                m.absmax = self.absmax[a0 : a0 + na]
                if self.bias is not None:
                    m.bias.data = self.bias[b0 : b0 + m.out_features]
                w0, a0, b0 = w0 + nw, a0 + na, b0 + m.out_features
        for t in (self.weight, self.absmax, self.bias, self.codebook):
            if t is not None:  # model weights for CUDA graphs (inductor's cudagraph trees): never copied per call
                torch._dynamo.mark_static_address(t)
        # (input, output, members yet to take their columns) of the last GEMM, or None: one tuple, replaced whole,
        # so a thread reads one call's input and output together (threads sharing a group at most recompute)
        self.state: tuple[torch.Tensor, torch.Tensor, int] | None = None
        for m in members:
            m._fused = self

    def serves(self, x: torch.Tensor, compute_dtype: torch.dtype, bias: torch.Tensor | None) -> bool:
        """Whether the group's GEMM can answer a member's call: the fused kernel's dtypes, and no autograd through
        the input or the member's own bias (the group's concatenated bias records none)."""
        return compute_dtype in GEMM_DTYPES and x.device == self.device and not _needs_grad(x, bias)

    def output(self, member: LinearKbit, x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        state = self.state
        if state is None or state[0] is not x:
            y = _tiled_gemm(
                x, compute_dtype, self.weight, self.absmax, self.codebook, self.k, self.N, self.K_pad, self.bias
            )
            state = (x, y, len(self.members))
        start, stop = member._fused_columns
        self.state = (state[0], state[1], state[2] - 1) if state[2] > 1 else None
        return state[1][..., start:stop]


def _fusable(members: list[LinearKbit]) -> bool:
    first = members[0]
    same = (
        first.in_features,
        first.padded_in_features,
        first.k,
        first.compute_dtype,
        first.bias is None,
        first.weight.device,
        first.absmax.dtype,
    )
    for m in members:
        key = (
            m.in_features,
            m.padded_in_features,
            m.k,
            m.compute_dtype,
            m.bias is None,
            m.weight.device,
            m.absmax.dtype,
        )
        if key != same or m._fused is not None or not m._tiled or not torch.equal(m.codebook, first.codebook):
            return False
        if m.bias is not None and m.bias.dtype != first.bias.dtype:
            return False
    # the tiled layout pads every layer's rows to 16: concatenated, only the last may end off a 16-row boundary
    return all(m.out_features % 16 == 0 for m in members[:-1])


def fuse_projections(model: nn.Module, groups: tuple[tuple[str, ...], ...] = FUSABLE_SIBLINGS) -> int:
    """Serve the sibling k-bit projections that read one input (attention's q/k/v, the MLP's gate/up) with one GEMM
    per group, for inference on a device with the fused kernel (CUDA). Returns the number of groups fused now
    (groups already fused stay as they are).

    A group is a module's children named as one entry of ``groups``, all ``LinearKbit`` with the same input width,
    k, codebook, absmax format, compute dtype, device and bias presence, and row counts on 16-row boundaries (all
    but the last). Nothing else changes: each layer keeps its weight (a view into the group's concatenated one),
    ``state_dict`` and checkpoints are as before, and a layer called alone still works. Loading, moving or
    re-quantizing a member dissolves its group (call again to fuse anew). Training (inputs or biases that require
    grad) takes the layers one by one."""
    count = 0
    for parent in model.modules():
        for names in groups:
            members = [getattr(parent, name, None) for name in names]
            if not all(isinstance(m, LinearKbit) and m.is_quantized for m in members):
                continue
            device = members[0].weight.device.type
            if any(m.weight.device.type != device or device not in m.fused_device_types for m in members):
                continue
            for m in members:
                m.prepare_for_inference()
            if _fusable(members):
                _FusedProjections(members)
                count += 1
    return count


def num_parameters(module: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """The parameters of ``module`` with each quantized ``LinearKbit`` weight counted as the weights it represents
    (``weight_numel``: out_features x in_features) instead of its packed int32 words; every other parameter counts
    its elements. Shared (tied) parameters count once. ``only_trainable``: only parameters that require grad (a
    quantized weight never does); ``exclude_embeddings``: leave ``nn.Embedding`` weights out. Models loaded with
    ``BitsAndBytesKbitConfig`` answer ``model.num_parameters()`` with this count."""
    logical = {id(m.weight): m.weight_numel for m in module.modules() if isinstance(m, LinearKbit) and m.is_quantized}
    skip = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
    total = 0
    for p in module.parameters():
        if id(p) in skip or (only_trainable and not p.requires_grad):
            continue
        total += logical.get(id(p), p.numel())
    return total
