"""Integrations with transformers and PEFT.

``register()`` makes ``quantization_config=BitsAndBytesKbitConfig(...)`` and the reload of k-bit
checkpoints work in transformers (>= 5, < 6). It is called by ``import bitsandbytes_kbit`` and by
the bitsandbytes entry point, so it never raises (it warns) and may run any number of times.
transformers is heavy to import, so when its quantizer registry is not imported yet, ``register()``
only installs an import hook that registers the method the moment transformers imports it.

``BitsAndBytesKbitConfig`` and the transformers classes are attributes of this package that import
transformers on first access.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import warnings

__all__ = ["BitsAndBytesKbitConfig", "BitsAndBytesKbitHfQuantizer", "is_registered", "register", "unregister"]

QUANT_METHOD = "bitsandbytes_kbit"
SUPPORTED_TRANSFORMERS = (5, 6)  # [5, 6)
_REGISTRY_MODULE = "transformers.quantizers.auto"
_LAZY = {"BitsAndBytesKbitConfig", "BitsAndBytesKbitHfQuantizer", "KbitQuantize", "replace_with_linear_kbit"}


def __getattr__(name: str):
    if name in _LAZY:
        from . import transformers as _hf

        return getattr(_hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _transformers_version_ok() -> tuple[bool, str]:
    version = importlib.metadata.version("transformers")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return False, version
    return SUPPORTED_TRANSFORMERS[0] <= major < SUPPORTED_TRANSFORMERS[1], version


def _register_now() -> bool:
    ok, version = _transformers_version_ok()
    if not ok:
        warnings.warn(
            f"bitsandbytes-kbit: transformers {version} is installed; the '{QUANT_METHOD}' quantization method "
            f"supports transformers>={SUPPORTED_TRANSFORMERS[0]},<{SUPPORTED_TRANSFORMERS[1]} and was not registered",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    # Import the registry module itself, not the ``transformers.quantizers`` package: the import hook
    # runs while that package is still initializing.
    auto = sys.modules.get(_REGISTRY_MODULE) or importlib.import_module(_REGISTRY_MODULE)
    ours = sys.modules.get(f"{__name__}.transformers")
    if ours is not None and not hasattr(ours, "BitsAndBytesKbitHfQuantizer"):
        # Our transformers module is being imported (its import of transformers ran the hook): it
        # calls register() itself once its classes exist.
        return True
    from .transformers import BitsAndBytesKbitConfig, BitsAndBytesKbitHfQuantizer

    for mapping, cls, what in (
        (auto.AUTO_QUANTIZATION_CONFIG_MAPPING, BitsAndBytesKbitConfig, "config"),
        (auto.AUTO_QUANTIZER_MAPPING, BitsAndBytesKbitHfQuantizer, "quantizer"),
    ):
        registered = mapping.get(QUANT_METHOD)
        if registered is None:
            # The public decorators (transformers >= 4.50) raise on a second registration: checked above.
            register_fn = auto.register_quantization_config if what == "config" else auto.register_quantizer
            register_fn(QUANT_METHOD)(cls)
        elif registered is not cls:
            warnings.warn(
                f"bitsandbytes-kbit: transformers already has a {what} '{QUANT_METHOD}' ({registered!r}); keeping it",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
    return True


class _RegisterOnImportLoader(importlib.abc.Loader):
    """Runs the real loader of transformers' quantizer registry, then registers the k-bit method."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _uninstall_hook()
        _register_quietly()

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class _RegisterOnImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisterOnImportLoader(spec.loader)
        return spec


_hook = _RegisterOnImportFinder()


def _uninstall_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def _register_quietly() -> bool:
    try:
        return _register_now()
    except Exception as exc:  # noqa: BLE001  (never break the caller's import)
        warnings.warn(
            f"bitsandbytes-kbit: could not register the '{QUANT_METHOD}' quantization method with transformers: "
            f"{exc!r}",
            RuntimeWarning,
            stacklevel=3,
        )
        return False


def register() -> bool:
    """Register the ``bitsandbytes_kbit`` quantization method with transformers. Idempotent, never raises.

    Returns True when the method is registered now or will be when transformers loads its quantizers,
    False when transformers is absent, unsupported, or the registration failed (with a warning)."""
    try:
        if importlib.util.find_spec("transformers") is None:
            return False
        if _REGISTRY_MODULE in sys.modules:
            _uninstall_hook()
            return _register_quietly()
        if _hook not in sys.meta_path:
            sys.meta_path.insert(0, _hook)
        return True
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"bitsandbytes-kbit: transformers registration failed: {exc!r}", RuntimeWarning, stacklevel=2)
        return False


def is_registered() -> bool:
    auto = sys.modules.get(_REGISTRY_MODULE)
    return auto is not None and QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING


def unregister() -> None:
    """Remove the method from transformers' registries (for tests: behave as without the extension)."""
    _uninstall_hook()
    auto = sys.modules.get(_REGISTRY_MODULE)
    if auto is not None:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        auto.AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
