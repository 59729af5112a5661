"""The native library: present when the build had nvcc (CI sets KBIT_REQUIRE_NATIVE), every C
entry point the ctypes table names is exported, and a missing library gives a clear message."""

import ctypes as ct
import itertools
import os
import re
from pathlib import Path

import pytest

from bitsandbytes_kbit import cextension
from bitsandbytes_kbit.backends.cuda import ops as cuda_ops


@pytest.mark.skipif(
    not os.environ.get("KBIT_REQUIRE_NATIVE"),
    reason="KBIT_REQUIRE_NATIVE unset: a build without nvcc is pure Python by design (CI and run_gpu.sh set it)",
)
def test_native_library_present_when_required():
    assert cextension.is_available(), f"nvcc was present but {cextension.library_path()} was not built"


@pytest.mark.skipif(
    not cextension.is_available(), reason="pure-Python install (built without nvcc): no C entry points"
)
def test_every_entry_point_is_exported():
    lib = cextension.get_lib()
    names = cuda_ops.entry_point_names()
    assert {"ckbit_quantize", "ckbit_dequantize", "ckbit_repack", "ckbit_gemm", "ckbit_last_error"} <= set(names)
    missing = [name for name in names if not hasattr(lib, name)]
    assert not missing
    lib.ckbit_last_error.restype = ct.c_char_p
    assert isinstance(lib.ckbit_last_error(), bytes)


def test_missing_library_message(monkeypatch, tmp_path):
    monkeypatch.setenv(cextension.LIBRARY_ENV, str(tmp_path / "absent.so"))
    cextension._load.cache_clear()
    try:
        assert not cextension.is_available()
        with pytest.raises(cextension.KbitLibraryMissingError, match="installed without a CUDA toolkit"):
            cextension.get_lib()
    finally:
        monkeypatch.delenv(cextension.LIBRARY_ENV)
        cextension._load.cache_clear()
    assert list(itertools.islice(cuda_ops.entry_point_names(), 1))


def test_sources_carry_no_build_switches_or_lab_references():
    """The native sources (CUDA and csrc/cpu) compile one way: no timing probes, no -D knobs that pick another code path, no environment
    switches, and no pointers to files that exist only in this repository (dev tools, the design doc, results)."""
    csrc = Path(__file__).resolve().parent.parent / "csrc"  # the tests run from the repository
    sources = sorted(p for p in csrc.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert len(sources) >= 6 and csrc / "cpu" / "kbit_cpu.cpp" in sources
    forbidden = re.compile(r"KBIT_PROBE|KBIT_TIMELINE|getenv|dev/\w|docs/kernel|benchmarking/")
    knob = re.compile(r"^\s*#\s*(ifdef|ifndef|if)\b.*\bKBIT_(?!WGMMA_BUILT\b)\w+")
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not forbidden.search(line), f"{path.name}:{number}: {line.strip()}"
            assert not knob.match(line), f"{path.name}:{number}: a build knob: {line.strip()}"


@pytest.mark.skipif(
    not os.environ.get("KBIT_REQUIRE_CPU_LIBRARY"),
    reason="KBIT_REQUIRE_CPU_LIBRARY unset: without a C++ compiler the install is pure Python (CI sets it with one)",
)
def test_cpu_library_present_when_required():
    from bitsandbytes_kbit import _cpu

    assert _cpu.AVAILABLE, f"a C++ compiler was present but {_cpu.library_path()} was not built or does not load"
    assert _cpu.isa in range(len(_cpu.ISA_NAMES))
