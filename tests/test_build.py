"""The native library: present when the build had nvcc (CI sets KBIT_REQUIRE_NATIVE), every C
entry point the ctypes table names is exported, and a missing library gives a clear message."""

import ctypes as ct
import itertools
import os

import pytest

from bitsandbytes_kbit import cextension
from bitsandbytes_kbit.backends.cuda import ops as cuda_ops


@pytest.mark.skipif(
    not os.environ.get("KBIT_REQUIRE_NATIVE"),
    reason="KBIT_REQUIRE_NATIVE unset: a build without nvcc is pure Python by design (CI and run_gpu.sh set it)",
)
def test_native_library_present_when_required():
    assert cextension.is_available(), f"nvcc was present but {cextension.library_path()} was not built"


@pytest.mark.skipif(not cextension.is_available(), reason="pure-Python install (built without nvcc): no C entry points")
def test_every_entry_point_is_exported():
    lib = cextension.get_lib()
    names = cuda_ops.entry_point_names()
    assert len(names) >= 72
    missing = [name for name in names if not hasattr(lib, name)]
    assert not missing
    lib.ckbit_error_string.restype = ct.c_char_p
    assert lib.ckbit_error_string(0) == b"no error"


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


def _strip_probes_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "dev" / "strip_probes.py"  # the tests run from the repository
    spec = importlib.util.spec_from_file_location("strip_probes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path.parent.parent / "csrc"


def test_strip_probes_takes_the_shipped_branch():
    strip = _strip_probes_module()[0].strip
    text = (
        "a\n#if X\nb\n#ifdef KBIT_PROBE_A // probe\nc\n#else\nd\n#endif\n#endif\n"
        "#ifndef KBIT_PROBE_B\ne\n#ifdef KBIT_PROBE_C\nf\n#endif\n#else\ng\n#endif\n"
        "    KBIT_TIMELINE(3);\n#define KBIT_TIMELINE(j)\nh\n"
    )
    assert strip(text) == "a\n#if X\nb\nd\n#endif\ne\nh\n"
    with pytest.raises(ValueError, match="open"):
        strip("#ifdef KBIT_PROBE_A\nx\n")
    with pytest.raises(ValueError, match="elif"):
        strip("#ifdef KBIT_PROBE_A\nx\n#elif Y\n#endif\n")


def test_strip_probes_leaves_no_probe_in_the_sources():
    module, csrc = _strip_probes_module()
    sources = sorted(p for p in csrc.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert sources
    probed = 0
    for path in sources:
        text = path.read_text()
        stripped = module.strip(text, path.name)
        assert "#ifdef KBIT_PROBE" not in stripped and "#ifndef KBIT_PROBE" not in stripped, path.name
        assert "KBIT_TIMELINE" not in stripped, path.name
        kept = iter(text.splitlines())  # only whole lines are removed, in order
        assert all(line in kept for line in stripped.splitlines()), path.name
        probed += stripped != text
    assert probed >= 1
