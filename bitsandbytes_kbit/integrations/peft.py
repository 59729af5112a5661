"""PEFT (>= 0.21) glue for LinearKbit.

LinearKbit subclasses ``nn.Linear``, so plain LoRA needs nothing from here: PEFT's generic
``lora.Linear`` wraps it, trains (the k-bit forward is differentiable w.r.t. its input) and saves
and reloads adapters. What the generic wrapper cannot do is merge: it adds a float delta into
``weight.data``, which for a packed int32 weight raises a shape/dtype error (it never writes).

``LoraLinearKbit`` adds merging: dequantize, add the LoRA delta, re-quantize with the layer's k
and codebook. Re-quantization is lossy: the merged layer is the k-bit weight nearest to
W + delta, and ``unmerge`` does not restore the original packed weight bit for bit.
Use it through ``register_lora_kbit(lora_config)`` (PEFT's custom-module API; the mapping is not
saved with the adapter, so pass the registered config again to ``PeftModel.from_pretrained``).
"""

from __future__ import annotations

import warnings

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge

from ..nn.modules import LinearKbit, ParamsKbit

__all__ = ["LoraLinearKbit", "register_lora_kbit"]


class LoraLinearKbit(LoraLinear):
    """PEFT's LoRA ``Linear`` around a LinearKbit, with merge / unmerge by re-quantization."""

    def _requantize_with(self, adapter: str, sign: float, safe_merge: bool) -> None:
        if adapter in self.lora_variant:
            raise NotImplementedError(
                f"LoraLinearKbit: merging adapter {adapter!r} ({type(self.lora_variant[adapter]).__name__}, e.g. DoRA) "
                "into a k-bit layer is not supported; only plain LoRA adapters can be merged"
            )
        base: LinearKbit = self.get_base_layer()
        W = base.dequantize(torch.float32)
        W = W + sign * self.get_delta_weight(adapter).to(device=W.device, dtype=torch.float32)
        if safe_merge and not bool(torch.isfinite(W).all()):
            raise ValueError(f"LoraLinearKbit: merging adapter {adapter!r} gives NaN or Inf weights; expected finite")
        base.set_quant_params(ParamsKbit.quantize(W, k=base.k, codebook=base.codebook))
        if self.lora_bias[adapter]:
            if base.bias is None:
                raise RuntimeError(
                    f"LoraLinearKbit: adapter {adapter!r} has lora_bias=True; the base layer has no bias to merge it into"
                )
            delta_bias = self.lora_B[adapter].bias * self.scaling[adapter]
            base.bias.data += sign * delta_bias.to(base.bias.dtype)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        warnings.warn(
            "Merging LoRA into a k-bit layer re-quantizes the weight (dequantize, add, quantize): the result is the "
            "k-bit weight nearest to W + delta, and unmerging will not restore the original bit for bit.",
            UserWarning,
            stacklevel=2,
        )
        for adapter in adapter_names:
            if adapter in self.lora_A:
                self._requantize_with(adapter, 1.0, safe_merge)
                self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("LoraLinearKbit.unmerge: no adapter is merged", UserWarning, stacklevel=2)
            return
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_A:
                self._requantize_with(adapter, -1.0, safe_merge=False)


def register_lora_kbit(lora_config):
    """Make ``lora_config`` wrap LinearKbit layers in ``LoraLinearKbit`` (mergeable). Returns the config.

    Pass the same (registered) config to ``PeftModel.from_pretrained(model, path, config=...)`` when
    reloading an adapter that should be mergeable; without it PEFT uses its generic wrapper."""
    lora_config._register_custom_module({LinearKbit: LoraLinearKbit})
    return lora_config
