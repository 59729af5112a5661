"""bitsandbytes-kbit: k-bit (k = 2..5) blockwise weight quantization for bitsandbytes.

Importing this package registers the ``torch.ops.bitsandbytes.*kbit*`` ops (default PyTorch
backend everywhere, CUDA kernels when the native library is installed). bitsandbytes loads it
through the ``bitsandbytes.backends`` entry point, so after ``import bitsandbytes`` the API is
also ``bitsandbytes.functional.<name>``. Only new names are added to bitsandbytes.
"""

import sys
import warnings

from . import _ops  # noqa: F401  (op definitions first)
from .backends.cuda import ops as _cuda_ops  # noqa: F401
from .backends.default import ops as _default_ops  # noqa: F401
from . import functional
from .functional import (
    create_codebook,
    create_normal_float_codebook,
    decode_absmax_e4m4,
    dequantize_kbit,
    encode_absmax_e4m4,
    quantize_kbit,
)

__version__ = "0.1.0"

__all__ = [
    "functional",
    "create_codebook",
    "create_normal_float_codebook",
    "encode_absmax_e4m4",
    "decode_absmax_e4m4",
    "quantize_kbit",
    "dequantize_kbit",
]


def _attach_to_bitsandbytes() -> None:
    """Add our public names to bitsandbytes' modules; never replace a name bitsandbytes has."""
    import bitsandbytes.functional as bnb_functional

    for name in functional.__all__:
        if not hasattr(bnb_functional, name):
            setattr(bnb_functional, name, getattr(functional, name))


def _load_as_bitsandbytes_backend() -> None:
    """Entry point of the ``bitsandbytes.backends`` group, called with no arguments at the end
    of ``import bitsandbytes``. An exception escaping it would break ``import bitsandbytes`` for
    everyone, so it warns instead."""
    try:
        _attach_to_bitsandbytes()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"bitsandbytes-kbit: could not attach to bitsandbytes: {exc!r}", RuntimeWarning, stacklevel=2)


# Imported after bitsandbytes (not through its entry point): attach now.
if "bitsandbytes.functional" in sys.modules:
    _load_as_bitsandbytes_backend()
