"""k-bit layers. After ``import bitsandbytes`` also ``bitsandbytes.nn.LinearKbit`` / ``bitsandbytes.nn.ParamsKbit``."""

from .modules import KBIT_FORMAT_VERSION, LinearKbit, ParamsKbit, fuse_projections
from .modules import num_parameters as num_parameters  # not attached to bitsandbytes.nn (a generic name)

__all__ = ["KBIT_FORMAT_VERSION", "LinearKbit", "ParamsKbit", "fuse_projections"]
