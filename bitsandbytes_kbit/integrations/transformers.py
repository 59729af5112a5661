"""transformers (>= 5, < 6) support: the ``bitsandbytes_kbit`` quantization method.

    from bitsandbytes_kbit import BitsAndBytesKbitConfig
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4))
    model.save_pretrained(out)                      # packed weights + config.json "quantization_config"
    model = AutoModelForCausalLM.from_pretrained(out)  # after `import bitsandbytes_kbit` (or bitsandbytes)

Every ``nn.Linear`` except the skipped ones (default: the output head and tied weights, plus
``skip_modules``) becomes a ``LinearKbit``. With ``bnb_kbit_calibration="gptq"`` the model loads in float, its
decoder layers are quantized with GPTQ on calibration text (``bitsandbytes_kbit.calibration``), and then the
layers are converted; the saved checkpoint is an ordinary pre-quantized one. On-the-fly loads quantize each weight on the device
it is loaded to; pre-quantized loads read the module's own parameter and buffers (``weight``,
``absmax``, ``codebook``, ``kbit_format``), so no conversion is needed either way.

This module imports transformers; ``bitsandbytes_kbit.integrations.register()`` registers it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.pytorch_utils import Conv1D
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from .. import functional as kbit_F
from .._ops import SUPPORTED_K, check_int
from ..nn.modules import LinearKbit, ParamsKbit, num_parameters

logger = logging.getLogger(__name__)

QUANT_METHOD = "bitsandbytes_kbit"
_CODEBOOK_NAMES = kbit_F.CODEBOOK_KINDS
_COMPUTE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CALIBRATION_METHODS = ("gptq",)


def _dtype_name(dtype: None | str | torch.dtype) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in _COMPUTE_DTYPES:
        raise ValueError(
            f"BitsAndBytesKbitConfig: bnb_kbit_compute_dtype={dtype!r} is not supported; expected None or one of "
            f"{tuple(_COMPUTE_DTYPES)}"
        )
    return name


def _check_calibration(method, texts, tokenizer, samples, seq_len, damp, act_order, scale_method) -> None:
    name = "BitsAndBytesKbitConfig"
    if method is not None and method not in CALIBRATION_METHODS:
        raise ValueError(
            f"{name}: bnb_kbit_calibration={method!r}; expected None (data-free) or one of {CALIBRATION_METHODS}"
        )
    if method is None and (texts is not None or tokenizer is not None):
        given = "bnb_kbit_calibration_texts" if texts is not None else "bnb_kbit_calibration_tokenizer"
        raise ValueError(f'{name}: {given} is set but bnb_kbit_calibration is None; pass bnb_kbit_calibration="gptq"')
    if texts is not None and (
        isinstance(texts, str)
        or not isinstance(texts, (list, tuple))
        or not texts
        or not all(isinstance(t, str) and t.strip() for t in texts)
    ):
        raise ValueError(
            f"{name}: bnb_kbit_calibration_texts={texts!r:.80}; expected None (the shipped text) or a non-empty list "
            "of non-empty strings"
        )
    if tokenizer is not None and not isinstance(tokenizer, str) and not callable(tokenizer):
        raise TypeError(
            f"{name}: bnb_kbit_calibration_tokenizer is a {type(tokenizer).__name__}; expected None (the model's "
            "own), a name or path, or a tokenizer"
        )
    for key, value in (("bnb_kbit_calibration_samples", samples), ("bnb_kbit_calibration_seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {key}={value!r}; expected an int >= 1")
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp > 0:
        raise ValueError(f"{name}: bnb_kbit_calibration_damp={damp!r}; expected a number > 0")
    if not isinstance(act_order, bool):
        raise TypeError(f"{name}: bnb_kbit_calibration_act_order={act_order!r}; expected True or False")
    if method is not None and scale_method != "mse":
        raise ValueError(
            f"{name}: bnb_kbit_scale_method={scale_method!r} with bnb_kbit_calibration={method!r}; calibration "
            'chooses the scales with the "mse" search: use bnb_kbit_scale_method="mse"'
        )


class BitsAndBytesKbitConfig(QuantizationConfigMixin):
    """Quantization config of the ``bitsandbytes_kbit`` method (k-bit blockwise weights, k = 2..5).

    Args:
        load_in_kbit: must be True (the name mirrors ``load_in_4bit`` of ``BitsAndBytesConfig``).
        bnb_kbit_bits: k, bits per weight (2, 3, 4 or 5).
        bnb_kbit_codebook: None (the default for k, ``DEFAULT_CODEBOOK[k]``: ``"lloyd-zero"`` for every k),
            a built-in name (``"lloyd"``, ``"lloyd-zero"``, ``"nf"``, ``"uniform"``, ``"fp4"``) or a list of at
            most 2^k floats.
        bnb_kbit_scale_method: ``"mse"`` (default: each block's scale chosen for the least error) or
            ``"absmax"`` (the block's absmax rounded), as ``quantize_kbit``'s ``scale_method``.
        bnb_kbit_compute_dtype: dtype of the matmuls (``torch.float16``, ``torch.bfloat16``,
            ``torch.float32`` or their names); None: the input's dtype.
        skip_modules: module names (or patterns, as transformers matches them) kept in float, added to the
            default skips (output head, tied weights, ``_keep_in_fp32_modules``).
        modules_to_not_convert: filled in at quantization: every module that was kept in float, so a
            pre-quantized reload builds exactly the same model.
        bnb_kbit_calibration: None (the default: data-free, each weight quantized on its own as it loads) or
            ``"gptq"``: load in float, run calibration text through the model and quantize its decoder layers
            one after another with ``quantize_kbit_gptq`` (layers outside them, data-free), then convert.
            Worth it at k = 2 and 3 (docs/usage.md); costs a float load plus minutes per billion parameters.
        bnb_kbit_calibration_texts: the calibration text, a list of strings; None: the text the package ships
            (``bitsandbytes_kbit/data/calibration.txt``, English prose, code and dialogue). Not saved.
        bnb_kbit_calibration_tokenizer: None (the model's own, ``AutoTokenizer.from_pretrained`` of the
            model's path), a name or path, or a tokenizer object. A name or path is saved; an object is not.
        bnb_kbit_calibration_samples, bnb_kbit_calibration_seq_len: how many token windows of what length
            the text is cut into (``calibration_samples``).
        bnb_kbit_calibration_damp, bnb_kbit_calibration_act_order: as ``quantize_kbit_gptq``'s damp and
            act_order.
    """

    def __init__(
        self,
        load_in_kbit: bool = True,
        bnb_kbit_bits: int = 4,
        bnb_kbit_codebook: None | str | list[float] = None,
        bnb_kbit_compute_dtype: None | str | torch.dtype = None,
        bnb_kbit_scale_method: str = "mse",
        skip_modules: list[str] | None = None,
        modules_to_not_convert: list[str] | None = None,
        quant_method: str = QUANT_METHOD,
        bnb_kbit_calibration: str | None = None,
        bnb_kbit_calibration_texts: list[str] | None = None,
        bnb_kbit_calibration_tokenizer: Any = None,
        bnb_kbit_calibration_samples: int = 32,
        bnb_kbit_calibration_seq_len: int = 512,
        bnb_kbit_calibration_damp: float = 0.1,
        bnb_kbit_calibration_act_order: bool = True,
        **kwargs: Any,
    ):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"BitsAndBytesKbitConfig: quant_method={quant_method!r}; expected {QUANT_METHOD!r}")
        if not load_in_kbit:
            raise ValueError("BitsAndBytesKbitConfig: load_in_kbit=False; this config only describes k-bit weights")
        check_int("BitsAndBytesKbitConfig", "bnb_kbit_bits", bnb_kbit_bits)
        if bnb_kbit_bits not in SUPPORTED_K:
            raise ValueError(
                f"BitsAndBytesKbitConfig: bnb_kbit_bits={bnb_kbit_bits!r} is not supported; expected one of {SUPPORTED_K}"
            )
        if isinstance(bnb_kbit_codebook, torch.Tensor):
            bnb_kbit_codebook = bnb_kbit_codebook.tolist()
        if bnb_kbit_codebook is not None and not isinstance(bnb_kbit_codebook, (str, list, tuple)):
            raise TypeError(
                f"BitsAndBytesKbitConfig: bnb_kbit_codebook={bnb_kbit_codebook!r}; expected None (the default for k), "
                f"one of {_CODEBOOK_NAMES} or a list of numbers"
            )
        if isinstance(bnb_kbit_codebook, str):
            if bnb_kbit_codebook not in _CODEBOOK_NAMES:
                raise ValueError(
                    f"BitsAndBytesKbitConfig: bnb_kbit_codebook={bnb_kbit_codebook!r}; expected one of {_CODEBOOK_NAMES} "
                    "or a list of floats"
                )
        elif bnb_kbit_codebook is not None:
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bnb_kbit_codebook):
                raise ValueError(
                    f"BitsAndBytesKbitConfig: bnb_kbit_codebook={list(bnb_kbit_codebook)!r}; expected a list of numbers "
                    f"(at most 2^k finite levels) or one of {_CODEBOOK_NAMES}"
                )
            bnb_kbit_codebook = [float(v) for v in bnb_kbit_codebook]
        if bnb_kbit_scale_method not in kbit_F.SCALE_METHODS:
            raise ValueError(
                f"BitsAndBytesKbitConfig: bnb_kbit_scale_method={bnb_kbit_scale_method!r}; expected one of "
                f"{kbit_F.SCALE_METHODS}"
            )
        # Checks the combination (fp4 needs k = 4, a list at most 2^k finite levels) once, here. The CPU is
        # explicit: transformers builds models under a meta default device.
        spec = (
            bnb_kbit_codebook
            if not isinstance(bnb_kbit_codebook, list)
            else torch.tensor(bnb_kbit_codebook, dtype=torch.float32, device="cpu")
        )
        kbit_F.resolve_codebook(spec, bnb_kbit_bits, "cpu")
        _check_calibration(
            bnb_kbit_calibration,
            bnb_kbit_calibration_texts,
            bnb_kbit_calibration_tokenizer,
            bnb_kbit_calibration_samples,
            bnb_kbit_calibration_seq_len,
            bnb_kbit_calibration_damp,
            bnb_kbit_calibration_act_order,
            bnb_kbit_scale_method,
        )
        if kwargs:
            logger.warning("BitsAndBytesKbitConfig: ignoring unknown keys %s", sorted(kwargs))
        self.quant_method = QUANT_METHOD
        self.load_in_kbit = True
        self.bnb_kbit_bits = int(bnb_kbit_bits)
        self.bnb_kbit_codebook = bnb_kbit_codebook
        self.bnb_kbit_scale_method = bnb_kbit_scale_method
        self.bnb_kbit_compute_dtype = _dtype_name(bnb_kbit_compute_dtype)
        self.skip_modules = list(skip_modules) if skip_modules is not None else None
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert is not None else None
        self.bnb_kbit_calibration = bnb_kbit_calibration
        self.bnb_kbit_calibration_texts = list(bnb_kbit_calibration_texts) if bnb_kbit_calibration_texts else None
        self.bnb_kbit_calibration_tokenizer = bnb_kbit_calibration_tokenizer
        self.bnb_kbit_calibration_samples = int(bnb_kbit_calibration_samples)
        self.bnb_kbit_calibration_seq_len = int(bnb_kbit_calibration_seq_len)
        self.bnb_kbit_calibration_damp = float(bnb_kbit_calibration_damp)
        self.bnb_kbit_calibration_act_order = bool(bnb_kbit_calibration_act_order)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return _COMPUTE_DTYPES.get(self.bnb_kbit_compute_dtype) if self.bnb_kbit_compute_dtype else None

    def codebook_spec(self) -> None | str | torch.Tensor:
        """The codebook as ``quantize_kbit`` / ``LinearKbit`` take it: None, a built-in's name or a CPU tensor."""
        cb = self.bnb_kbit_codebook
        return cb if not isinstance(cb, list) else torch.tensor(cb, dtype=torch.float32, device="cpu")

    def codebook(self, device=None) -> torch.Tensor:
        """The float32 codebook on ``device``."""
        return kbit_F.resolve_codebook(self.codebook_spec(), self.bnb_kbit_bits, device)

    def to_dict(self) -> dict[str, Any]:
        tok = self.bnb_kbit_calibration_tokenizer
        return {
            "quant_method": self.quant_method,
            "load_in_kbit": self.load_in_kbit,
            "bnb_kbit_bits": self.bnb_kbit_bits,
            "bnb_kbit_codebook": self.bnb_kbit_codebook,
            "bnb_kbit_scale_method": self.bnb_kbit_scale_method,
            "bnb_kbit_compute_dtype": self.bnb_kbit_compute_dtype,
            "skip_modules": self.skip_modules,
            "modules_to_not_convert": self.modules_to_not_convert,
            # how a calibrated checkpoint was made (a reload does not calibrate again); the texts are not saved
            "bnb_kbit_calibration": self.bnb_kbit_calibration,
            "bnb_kbit_calibration_tokenizer": tok if isinstance(tok, str) else None,
            "bnb_kbit_calibration_samples": self.bnb_kbit_calibration_samples,
            "bnb_kbit_calibration_seq_len": self.bnb_kbit_calibration_seq_len,
            "bnb_kbit_calibration_damp": self.bnb_kbit_calibration_damp,
            "bnb_kbit_calibration_act_order": self.bnb_kbit_calibration_act_order,
        }


def replace_with_linear_kbit(
    model: nn.Module, config: BitsAndBytesKbitConfig, modules_to_not_convert: list[str], pre_quantized: bool
) -> list[str]:
    """Replace every ``type(m) is nn.Linear`` or transformers ``Conv1D`` (GPT-2; its weight is [in, out], the
    transpose of nn.Linear's, and is transposed when quantized) not matched by ``modules_to_not_convert`` by a
    LinearKbit on the meta device: with a float placeholder weight [out, in] for on-the-fly quantization (transformers casts
    the incoming tensor to the placeholder's dtype before the quantize op runs), with the packed shapes
    for a pre-quantized checkpoint. Returns the names of the replaced modules."""
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) not in (nn.Linear, Conv1D) or not should_convert_module(name, modules_to_not_convert):
            continue
        if isinstance(module, Conv1D):
            in_features, out_features = module.weight.shape
        else:
            in_features, out_features = module.in_features, module.out_features
        kwargs = {
            "bias": module.bias is not None,
            "k": config.bnb_kbit_bits,
            "codebook": config.codebook_spec(),
            "compute_dtype": config.compute_dtype,
            "scale_method": config.bnb_kbit_scale_method,
            "device": "meta",
            "dtype": module.weight.dtype,
        }
        if pre_quantized:
            new = LinearKbit.empty_quantized(in_features, out_features, **kwargs)
        else:
            new = LinearKbit(in_features, out_features, **kwargs)
        # The checkpoint of a Conv1D holds the weight as [in, out]: KbitQuantize transposes it.
        new._kbit_source_transposed = isinstance(module, Conv1D)
        if module.bias is not None:
            new.bias.requires_grad_(module.bias.requires_grad)
        model.set_submodule(name, new)
        replaced.append(name)
    return replaced


class KbitQuantize(ConversionOps):
    """The on-the-fly quantize op: one float ``<layer>.weight`` in, the layer's packed ``weight`` and every
    companion (``absmax``, ``codebook``, ``kbit_format``) out, on the tensor's own device."""

    def __init__(self, hf_quantizer: BitsAndBytesKbitHfQuantizer):
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model=None, **kwargs):
        result = {}
        for name, value in input_dict.items():
            if isinstance(value, list):
                if len(value) != 1:
                    raise ValueError(f"KbitQuantize: {name} arrived as {len(value)} tensors; expected one weight")
                value = value[0]
            prefix, _, tensor_name = name.rpartition(".")
            module = model.get_submodule(prefix)
            if tensor_name != "weight" or not isinstance(module, LinearKbit):
                raise ValueError(f"KbitQuantize: {name} is not the weight of a LinearKbit")
            expected = (module.out_features, module.in_features)
            if getattr(module, "_kbit_source_transposed", False):
                value = value.t()  # a Conv1D weight, [in, out]
            if tuple(value.shape) != expected:
                raise ValueError(f"KbitQuantize: {name} has shape {tuple(value.shape)}; expected {expected}")
            config = self.hf_quantizer.quantization_config
            params = ParamsKbit.quantize(
                value,
                k=config.bnb_kbit_bits,
                codebook=config.codebook(value.device),
                scale_method=config.bnb_kbit_scale_method,
            )
            result[name] = nn.Parameter(params.packed, requires_grad=False)
            result[f"{prefix}.absmax"] = params.absmax
            result[f"{prefix}.codebook"] = params.codebook.clone()
            result[f"{prefix}.kbit_format"] = module._format_tensor(value.device)
            module._is_hf_initialized = True
        return result


def _device_type(value) -> str:
    if isinstance(value, int):
        return "cuda"
    if isinstance(value, torch.device):
        return value.type
    return str(value).split(":")[0]


def _cuda_library_problem() -> str | None:
    """None when the CUDA backend and its native library load, else why not."""
    try:
        from ..backends.cuda.ops import library_problem
    except (ImportError, AttributeError) as err:  # a torch build without CUDA
        return f"{type(err).__name__}: {err}"
    return library_problem()


class BitsAndBytesKbitHfQuantizer(HfQuantizer):
    """HfQuantizer of the ``bitsandbytes_kbit`` method (see the module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: BitsAndBytesKbitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if not isinstance(device_map, dict):
            return
        types = {_device_type(v) for v in device_map.values()}
        offloaded = types & {"cpu", "disk"}
        accelerators = types - {"cpu", "disk", "meta"}
        if "disk" in types or (offloaded and accelerators):
            what = "quantized on the fly" if not self.pre_quantized else "loaded pre-quantized"
            where = "to disk" if "disk" in types else "to the CPU next to a GPU"
            raise ValueError(
                f"bitsandbytes_kbit: device_map places modules on {sorted(types)}; k-bit weights {what} cannot be "
                f"offloaded {where}. Give the model enough GPU memory (max_memory=...), or load it entirely on one "
                'device (device_map={"": "cpu"} runs on the CPU through the default backend).'
            )
        if "cuda" in accelerators:
            problem = _cuda_library_problem()
            if problem is not None:
                raise ImportError(
                    f"bitsandbytes_kbit: device_map places k-bit layers on a GPU, but the CUDA library did not load "
                    f"({problem}); reinstall with a CUDA toolkit, or load the model on the CPU"
                )

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is None:
            dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return dtype

    def update_device_map(self, device_map):
        if device_map is None:
            device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else {"": "cpu"}
        return device_map

    def adjust_max_memory(self, max_memory: dict[str, int | str]) -> dict[str, int | str]:
        # Headroom for the float weight being quantized and the repacked copy built at load.
        return {key: val * 0.90 if isinstance(val, (int, float)) else val for key, val in max_memory.items()}

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        prefix, _, tensor_name = param_name.rpartition(".")
        if tensor_name != "weight":
            return False
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            return False
        return isinstance(module, LinearKbit)

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        if self.param_needs_quantization(model, param_name):
            # k bits per weight plus one E4M4 byte per block of 32.
            return (self.quantization_config.bnb_kbit_bits + 8 / 32) / 8
        return param.element_size()

    def _process_model_before_weight_loading(self, model, keep_in_fp32_modules=None, **kwargs):
        config = self.quantization_config
        if self.pre_quantized and config.modules_to_not_convert is not None:
            skips = list(config.modules_to_not_convert)
        else:
            skips = self.get_modules_to_not_convert(
                model, config.skip_modules, getattr(model, "_keep_in_fp32_modules", None), add_default_skips=True
            )
        self.modules_to_not_convert = skips
        if self._calibrating:  # loads in float; converted after calibration (_process_model_after_weight_loading)
            config.modules_to_not_convert = sorted(skips)
            model.config.quantization_config = config
            return
        replaced = replace_with_linear_kbit(model, config, skips, self.pre_quantized)
        if not replaced:
            logger.warning("bitsandbytes_kbit: no nn.Linear module was converted; the model stays in float")
        config.modules_to_not_convert = sorted(skips)
        model.config.quantization_config = config

    @property
    def _calibrating(self) -> bool:
        return not self.pre_quantized and self.quantization_config.bnb_kbit_calibration is not None

    def _calibrate_and_convert(self, model) -> None:
        """GPTQ over the float model's decoder layers, then every convertible linear becomes a LinearKbit holding
        the calibrated weight (data-free for those outside the decoder layers)."""
        from transformers import AutoTokenizer

        from ..calibration import calibrate_model, find_blocks

        config = self.quantization_config
        names = [
            n
            for n, m in model.named_modules()
            if type(m) in (nn.Linear, Conv1D) and should_convert_module(n, self.modules_to_not_convert)
        ]
        if not names:
            logger.warning("bitsandbytes_kbit: no nn.Linear module was converted; the model stays in float")
            return
        tokenizer = config.bnb_kbit_calibration_tokenizer
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model.name_or_path)
        device = next(model.parameters()).device
        blocks_name, _ = find_blocks(model)
        in_blocks = [n for n in names if n.startswith(blocks_name + ".") and type(model.get_submodule(n)) is nn.Linear]
        params = calibrate_model(
            model,
            config.bnb_kbit_bits,
            tokenizer=tokenizer,
            texts=config.bnb_kbit_calibration_texts,
            num_samples=config.bnb_kbit_calibration_samples,
            seq_len=config.bnb_kbit_calibration_seq_len,
            codebook=config.codebook(device),
            damp=config.bnb_kbit_calibration_damp,
            act_order=config.bnb_kbit_calibration_act_order,
            modules=in_blocks,
        )
        for name in names:
            module = model.get_submodule(name)
            weight = module.weight.detach()
            if isinstance(module, Conv1D):
                weight = weight.t()  # [in, out] -> [out, in]
            out_features, in_features = weight.shape
            p = params.get(name)
            if p is None:
                p = ParamsKbit.quantize(
                    weight,
                    k=config.bnb_kbit_bits,
                    codebook=config.codebook(weight.device),
                    scale_method=config.bnb_kbit_scale_method,
                )
            new = LinearKbit.empty_quantized(
                in_features,
                out_features,
                device=weight.device,
                bias=module.bias is not None,
                k=config.bnb_kbit_bits,
                codebook=config.codebook_spec(),
                compute_dtype=config.compute_dtype,
                dtype=weight.dtype,
                scale_method=config.bnb_kbit_scale_method,
            )
            new.set_quant_params(p)
            if module.bias is not None:
                new.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
            model.set_submodule(name, new)

    def _check_prequantized(self, model) -> None:
        """A k-bit checkpoint's layers, as transformers loaded them (it sets tensors directly, not through
        ``LinearKbit.load_state_dict``): refused with every problem named if a layer lacks some of its k-bit tensors
        (transformers would leave them uninitialized and only log them as missing) or holds ones that do not fit it
        (``LinearKbit``'s own load checks: format, k, sizes, dtypes, codebook)."""
        problems = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearKbit) or module.weight.device.type == "meta":
                continue
            tensors = {n: getattr(module, n) for n in ("weight", "kbit_format", "absmax", "codebook")}
            # transformers marks each tensor it loads from the checkpoint; where some of a layer's tensors carry the
            # mark and others not, the others were missing (a layer with none marked was not loaded by this path)
            loaded = {n for n, t in tensors.items() if getattr(t, "_is_hf_initialized", False)}
            if loaded and len(loaded) < len(tensors):
                missing = ", ".join(f"{name}.{n}" for n in tensors if n not in loaded)
                problems.append(f"the checkpoint lacks {missing}")
            elif not module.weight.is_floating_point():
                error = module._kbit_state_error({f"{name}.{n}": t for n, t in tensors.items()}, name + ".")
                if error is not None:
                    problems.append(error)
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ValueError(
                f"bitsandbytes_kbit: the k-bit checkpoint does not fit the model: {'; '.join(problems[:8])}{more}"
            )

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self._calibrating:
            self._calibrate_and_convert(model)
        if self.pre_quantized:
            self._check_prequantized(model)
        for module in model.modules():
            if isinstance(module, LinearKbit) and module.weight.device.type != "meta":
                # quantize_() covers a weight the checkpoint lacked (initialized in float by transformers);
                # prepare_for_inference() builds the repacked weight once, on the weight's device.
                module.quantize_()
                module.check_format()
                module.prepare_for_inference()
        # model.num_parameters() counts the weights a LinearKbit represents, not its packed words (transformers
        # special-cases only bitsandbytes' Params4bit); a partial, not a bound method, so the model still pickles
        model.num_parameters = functools.partial(num_parameters, model)
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def get_quantize_ops(self) -> KbitQuantize:
        return KbitQuantize(self)

    def _dequantize(self, model, dtype=None):
        for name, module in list(model.named_modules()):
            if isinstance(module, LinearKbit):
                weight = module.dequantize(dtype or torch.float32)
                linear = nn.Linear(
                    module.in_features, module.out_features, bias=module.bias is not None, device="meta"
                )
                linear.weight = nn.Parameter(weight, requires_grad=False)
                if module.bias is not None:
                    linear.bias = nn.Parameter(module.bias.detach().to(weight.dtype), requires_grad=False)
                model.set_submodule(name, linear)
        model.__dict__.pop("num_parameters", None)  # a float model again: transformers' own count
        return model


def _register_on_import() -> None:
    # Importing this module means transformers is in use: make sure the method is registered (a
    # registration started by the import hook while this module was half-imported ends here).
    from . import register

    register()


_register_on_import()
