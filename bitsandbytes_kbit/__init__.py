"""bitsandbytes-kbit: k-bit (k = 2..5) blockwise weight quantization for bitsandbytes.

Importing this package registers the ``torch.ops.bitsandbytes.*kbit*`` ops (default PyTorch
backend everywhere, CUDA kernels when the native library is installed). bitsandbytes loads it
through the ``bitsandbytes.backends`` entry point, so after ``import bitsandbytes`` the API is
also ``bitsandbytes.functional.<name>``. Only new names are added to bitsandbytes.
"""

import sys
import warnings

from . import (
    _ops,  # noqa: F401  (op definitions first)
    calibration,
    functional,
    integrations,
    nn,
)
from .backends.cpu import ops as _cpu_ops  # noqa: F401
from .backends.cuda import ops as _cuda_ops  # noqa: F401
from .backends.default import ops as _default_ops  # noqa: F401
from .calibration import calibrate_model, quantize_kbit_gptq
from .functional import (  # noqa: F401  (re-exported)
    create_codebook,
    create_normal_float_codebook,
    decode_absmax_e4m4,
    dequantize_kbit,
    encode_absmax_e4m4,
    kbit_gemm,
    quantize_kbit,
    repack_kbit,
)
from .nn import KBIT_FORMAT_VERSION, LinearKbit, ParamsKbit  # noqa: F401  (re-exported)

__version__ = "0.1.0"

__all__ = ["functional", *functional.__all__, "nn", "integrations", *nn.__all__, "BitsAndBytesKbitConfig"]  # noqa: PLE0604
__all__ += ["calibrate_model", "calibration", "quantize_kbit_gptq"]


def __getattr__(name: str):
    # Lazy: importing transformers takes seconds, and `import bitsandbytes` loads this package.
    if name == "BitsAndBytesKbitConfig":
        from .integrations.transformers import BitsAndBytesKbitConfig

        return BitsAndBytesKbitConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _attach_to_bitsandbytes() -> None:
    """Add our public names to bitsandbytes' modules; never replace a name bitsandbytes has."""
    import bitsandbytes.functional as bnb_functional
    import bitsandbytes.nn as bnb_nn

    for name in functional.__all__:
        if not hasattr(bnb_functional, name):
            setattr(bnb_functional, name, getattr(functional, name))
    for name in nn.__all__:
        if not hasattr(bnb_nn, name):
            setattr(bnb_nn, name, getattr(nn, name))


def _load_as_bitsandbytes_backend() -> None:
    """Entry point of the ``bitsandbytes.backends`` group, called with no arguments at the end
    of ``import bitsandbytes``. An exception escaping it would break ``import bitsandbytes`` for
    everyone, so it warns instead."""
    integrations.register()  # transformers quantizer; never raises
    try:
        _attach_to_bitsandbytes()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"bitsandbytes-kbit: could not attach to bitsandbytes: {exc!r}", RuntimeWarning, stacklevel=2)


# Imported after bitsandbytes (not through its entry point): attach now.
if "bitsandbytes.functional" in sys.modules:
    _load_as_bitsandbytes_backend()
integrations.register()
