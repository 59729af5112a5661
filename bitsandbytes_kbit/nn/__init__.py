"""k-bit layers. After ``import bitsandbytes`` also ``bitsandbytes.nn.LinearKbit`` / ``bitsandbytes.nn.ParamsKbit``."""

from .modules import KBIT_FORMAT_VERSION, LinearKbit, ParamsKbit

__all__ = ["KBIT_FORMAT_VERSION", "LinearKbit", "ParamsKbit"]
