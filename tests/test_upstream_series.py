"""upstream/export_series.py: the series applies with `git am` onto upstream bitsandbytes, is reproducible, and the
patched tree imports and quantizes like this package. Needs git, clang-format and a copy of upstream's repository
(the snapshot below); skipped without them."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import bitsandbytes_kbit.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_SNAPSHOT = Path("/work/.mirror/bitsandbytes-foundation+bitsandbytes/repo")

_spec = importlib.util.spec_from_file_location("export_series", REPO_ROOT / "upstream" / "export_series.py")
export_series = importlib.util.module_from_spec(_spec)
sys.modules["export_series"] = export_series  # dataclasses look the module up while the class is built
_spec.loader.exec_module(export_series)

needs_tools = pytest.mark.skipif(
    shutil.which("git") is None or export_series.find_clang_format() is None or not UPSTREAM_SNAPSHOT.exists(),
    reason=f"needs git, clang-format and the upstream snapshot at {UPSTREAM_SNAPSHOT}",
)

SUBJECTS = [
    "Add k-bit blockwise quantization: format, reference backend, quantize and dequantize",
    "Add the k-bit repack and fused dequantize + GEMM",
    "Add LinearKbit",
    "Add the k-bit transformers and PEFT integration and docs",
    "Add the k-bit benchmarks",
]


def _git(*args, cwd=None):
    env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
    )
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("series")
    upstream = tmp / "upstream"
    _git("clone", "--quiet", str(UPSTREAM_SNAPSHOT), str(upstream))
    out = tmp / "out"
    assert export_series.main(["--upstream", str(upstream), "--out", str(out)]) == 0
    patched = tmp / "patched"
    _git("clone", "--quiet", str(UPSTREAM_SNAPSHOT), str(patched))
    patches = sorted(out.glob("*.patch"))
    _git("am", "--quiet", *map(str, patches), cwd=patched)
    return upstream, out, patches, patched


@needs_tools
def test_series_applies_in_order_with_the_planned_shape(series):
    upstream, _, patches, patched = series
    assert [p.name[:4] for p in patches] == ["0001", "0002", "0003", "0004", "0005"]
    subjects = _git("log", "--format=%s", "-5", "--reverse", cwd=patched).splitlines()
    assert subjects == SUBJECTS
    assert _git("status", "--porcelain", cwd=upstream) == "", "the given checkout must stay untouched"

    def added(rel):
        return (patched / rel).read_text()

    # kernels appended to upstream's files, the GEMM family in files of its own, built by upstream's CMake
    assert "kQuantizeKbit" in added("csrc/kernels.cu") and "kDequantizeKbit" in added("csrc/kernels.cu")
    assert "void launch_quantize_kbit(" in added("csrc/kernels.cuh")
    assert 'extern "C"' in added("csrc/pythonInterface.cpp").split("k-bit blockwise quantization")[-1]
    assert (patched / "csrc/kbit_gemm.cu").is_file()
    cmake = added("CMakeLists.txt")
    assert "add_library(bitsandbytes_kbit_gemm OBJECT csrc/kbit_gemm.cu)" in cmake and "KBIT_WGMMA_BUILT" in cmake
    assert "$<TARGET_OBJECTS:bitsandbytes_kbit_gemm>" in cmake
    # the Python layers under upstream's names, without the extension glue
    assert '"bitsandbytes::quantize_kbit"' in added("bitsandbytes/_ops.py")
    assert "def quantize_kbit(" in added("bitsandbytes/functional.py")
    assert "class LinearKbit(" in added("bitsandbytes/nn/modules.py")
    changed = _git("diff", "--name-only", "HEAD~5", cwd=patched).split()
    assert not any("bitsandbytes_kbit" in path for path in changed)
    for path in changed:
        if path.endswith(".py"):
            text = added(path).replace('"bitsandbytes_kbit"', "")  # the transformers quant_method name stays
            # the CPU kernels' own library (libbitsandbytes_kbit_cpu.so) keeps its name until upstream's CPU build has them
            assert "bitsandbytes_kbit" not in text.replace("libbitsandbytes_kbit_cpu", ""), path
            assert "_attach_to_bitsandbytes" not in text and "_load_as_bitsandbytes_backend" not in text, path


@needs_tools
def test_series_is_reproducible(series, tmp_path):
    upstream, _, patches, _ = series
    again = tmp_path / "again"
    assert export_series.main(["--upstream", str(upstream), "--out", str(again)]) == 0
    assert [p.read_bytes() for p in sorted(again.glob("*.patch"))] == [p.read_bytes() for p in patches]


@needs_tools
def test_patched_tree_quantizes_like_this_package(series, tmp_path):
    """Import the patched tree in a fresh interpreter (this package's entry point switched off, so only upstream's
    own code runs) and compare its quantize / dequantize with this package's on fresh random data."""
    _, _, _, patched = series
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    A = torch.randn(3, 200, generator=g)
    torch.save(A, tmp_path / "A.pt")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import importlib.metadata as m
            _entry_points = m.entry_points
            m.entry_points = lambda **kw: [] if kw.get("group") == "bitsandbytes.backends" else _entry_points(**kw)
            """
        )
    )
    code = textwrap.dedent(
        f"""
        import torch, bitsandbytes
        assert bitsandbytes.__file__.startswith({str(patched)!r}), bitsandbytes.__file__
        A = torch.load({str(tmp_path / "A.pt")!r})
        out = {{}}
        for k in (2, 3, 4, 5):
            packed, absmax, cb = bitsandbytes.functional.quantize_kbit(A, k=k)
            out[k] = (packed, absmax, bitsandbytes.functional.dequantize_kbit(packed, absmax, cb, k, A.numel(), A.dtype))
        torch.save(out, {str(tmp_path / "out.pt")!r})
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(patched)]))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=patched, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for k in (2, 3, 4, 5):
        packed, absmax, cb = F.quantize_kbit(A, k=k)
        assert torch.equal(theirs[k][0], packed) and torch.equal(
            theirs[k][1].view(torch.uint8), absmax.view(torch.uint8)
        )
        assert torch.equal(theirs[k][2], F.dequantize_kbit(packed, absmax, cb, k, A.numel(), A.dtype))


def test_merge_refuses_a_name_upstream_already_defines():
    upstream = "import torch\n\n\ndef quantize_kbit(x):\n    return x\n"
    ours = '"""doc"""\n\nimport math\n\n\ndef quantize_kbit(x):\n    return math.pi\n'
    with pytest.raises(export_series.ExportError, match=r"functional\.py: names defined both.*quantize_kbit"):
        export_series.merge_python(upstream, ours, "functional.py")


def test_merge_places_imports_after_upstreams_and_appends_the_body():
    upstream = '"""Upstream."""\n\nimport torch\n\nX = 1\n'
    ours = '"""Ours."""\n\nfrom __future__ import annotations\n\nimport math\n\n__all__ = ["f"]\n\n# f\'s comment\ndef f():\n    return math.pi\n'
    merged = export_series.merge_python(upstream, ours, "m.py")
    lines = merged.splitlines()
    assert lines.index("from __future__ import annotations") < lines.index("import torch") < lines.index("import math")
    assert lines.index("import math") < lines.index("X = 1") < lines.index("# f's comment") < lines.index("def f():")
    assert "__all__" not in merged and "# Ours." in merged
    compile(merged, "m.py", "exec")  # still a valid module (a late __future__ import would not compile)


def test_unresolved_imports_names_what_a_module_does_not_define(tmp_path):
    """The export's import check: names bound at a module's top level (also inside try / if), submodules and lazy
    module attributes resolve; a name the module lacks is reported with its file and line."""
    pkg = tmp_path / "bitsandbytes"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "cextension.py").write_text(
        "try:\n    lib = 1\nexcept OSError:\n    lib = None\ndef get_native_library(): ...\n"
    )
    (pkg / "lazy.py").write_text("def __getattr__(name): ...\n")
    (pkg / "backends" / "ops.py").write_text(
        "from ..cextension import lib, get_native_library\n"
        "from .. import backends, lazy\n"
        "from ..lazy import Anything\n"
        "import torch\n"
        "def f():\n"
        "    from ..cextension import get_lib\n"
        "    from bitsandbytes.missing import x\n"
    )
    problems = export_series.unresolved_imports(tmp_path, ["bitsandbytes/backends/ops.py"])
    assert problems == [
        "bitsandbytes/backends/ops.py:6: bitsandbytes.cextension has no get_lib",
        "bitsandbytes/backends/ops.py:7: no module bitsandbytes.missing",
    ]


def test_rename_keeps_the_quant_method_name():
    text = 'from bitsandbytes_kbit._format import BLOCKSIZE\nfrom ._format import X\nQUANT = "bitsandbytes_kbit"\n'
    renamed = export_series.rename_python(text)
    assert "from bitsandbytes._kbit_format import BLOCKSIZE" in renamed
    assert "from ._kbit_format import X" in renamed and 'QUANT = "bitsandbytes_kbit"' in renamed


def test_rename_maps_every_import_of_the_cpu_module():
    text = "from bitsandbytes_kbit import _cpu\nfrom .. import _cpu\nfrom bitsandbytes_kbit._cpu import find_library\n"
    assert export_series.rename_python(text).splitlines() == [
        "from bitsandbytes import _kbit_cpu as _cpu",
        "from .. import _kbit_cpu as _cpu",
        "from bitsandbytes._kbit_cpu import find_library",
    ]


def test_export_refuses_a_directory_that_is_not_upstream(tmp_path):
    if export_series.find_clang_format() is None:
        pytest.skip("needs clang-format")
    with pytest.raises(export_series.ExportError, match=r"--upstream=.* is not a git checkout"):
        export_series.export(tmp_path, tmp_path / "out")


@needs_tools
def test_no_identifier_of_ours_is_an_upstream_macro(series):
    """Our kernels and launchers are appended to upstream's kernels.cu / ops.cu, after every #define there, so a name
    those files #define (kernels.cu's `#define QUAD 3`, say) would rewrite our identifier and break the build."""
    upstream = series[0]
    macros = {}
    for name in ("kernels.cu", "ops.cu"):
        for macro in re.findall(r"^\s*#\s*define\s+(\w+)", (upstream / "csrc" / name).read_text(), re.MULTILINE):
            macros.setdefault(macro, name)
    assert "QUAD" in macros  # the one this test was written for: the scan reads upstream's sources
    ours = sorted(REPO_ROOT.glob("csrc/*.cu*")) + sorted(REPO_ROOT.glob("csrc/*.inc"))
    clashes = []
    for path in ours:
        code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", path.read_text(), flags=re.DOTALL)
        code = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', code)
        used = set(re.findall(r"\b[A-Za-z_]\w*\b", code))
        clashes += [f"{path.name}: {name} ({macros[name]} #defines it)" for name in sorted(used & macros.keys())]
    assert not clashes, clashes
