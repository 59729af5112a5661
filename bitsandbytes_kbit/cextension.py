"""Finds and loads the native library, libbitsandbytes_kbit_cuda.so, installed beside this file
by the CMake build when a CUDA toolkit was present.

Loading is lazy: importing the package never fails for want of the library. A CUDA tensor that
reaches a k-bit op without it gets an error that says how to get the kernels.
"""

from __future__ import annotations

import ctypes as ct
import functools
import os
from pathlib import Path

from ._cpu import find_library

LIBRARY_NAME = "libbitsandbytes_kbit_cuda.so"
# For development builds outside the package folder (a CMake build tree): a path to the .so.
LIBRARY_ENV = "BNB_KBIT_LIBRARY"


class KbitLibraryMissingError(RuntimeError):
    pass


def library_path() -> Path:
    override = os.environ.get(LIBRARY_ENV)
    return Path(override) if override else find_library(LIBRARY_NAME)


@functools.cache
def _load() -> ct.CDLL | None:
    path = library_path()
    if not path.is_file():
        return None
    return ct.CDLL(str(path))


def is_available() -> bool:
    return _load() is not None


def get_lib() -> ct.CDLL:
    lib = _load()
    if lib is None:
        raise KbitLibraryMissingError(
            f"bitsandbytes-kbit: a CUDA tensor reached a k-bit op, but the CUDA library {LIBRARY_NAME} was not "
            f"found at {library_path()}. The package was installed without a CUDA toolkit (nvcc), so only the "
            "default PyTorch backend is available (move the tensors to the CPU to use it). To get the kernels, "
            "reinstall with nvcc on PATH: `pip install --no-binary bitsandbytes-kbit bitsandbytes-kbit` or "
            "`pip install .` from a checkout (KBIT_CUDA_ARCHS=90 picks the GPU architectures)."
        )
    return lib
