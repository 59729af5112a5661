"""Write this project as a numbered ``git format-patch`` series against a checkout of upstream bitsandbytes.

    python upstream/export_series.py --upstream /path/to/bitsandbytes --out /tmp/kbit-series

The checkout is not touched: the script clones it into a temporary directory, applies each step of the series
there from this repository's sources, commits it with a fixed author and date (the output is the same for the same
inputs) and runs ``git format-patch`` into ``--out``. ``git am`` applies the patches, in order, onto the checkout.
docs/UPSTREAMING.md describes the series and how to check it.

How the sources move:
- ``bitsandbytes_kbit`` becomes ``bitsandbytes``; ``_format.py`` becomes ``_kbit_format.py``; the package glue
  (``__init__.py``'s entry point and ``_attach_to_bitsandbytes``, ``cextension.py``, the demo) stays behind.
- Python modules that upstream already has (``_ops.py``, ``functional.py``, the backends' ``ops.py``,
  ``nn/modules.py``) get this project's statements appended and its imports placed after upstream's; names this
  project defines must not collide with upstream's (checked), and ``__all__`` is not carried over.
- C++: the quantize / dequantize kernels go to the end of ``csrc/kernels.cu`` / ``kernels.cuh``, the host launchers
  (and the C ABI's codes and error slot) to ``ops.cu`` / ``ops.cuh``, the quantize / dequantize ``extern "C"``
  entries to ``pythonInterface.cpp`` (CUDA builds only); the GEMM family, its repack and GEMM entries included, keeps
  files of its own, built by upstream's CMake as an object library with sm_90a code for its Hopper
  kernels.
- ruff and clang-format (upstream's settings) format the files the series writes; the script needs clang-format
  (``pip install 'clang-format>=20,<21'``: upstream's pre-commit pins 20.1).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "bitsandbytes_kbit"

AUTHOR_ENV = {
    "GIT_AUTHOR_NAME": "bitsandbytes-kbit",
    "GIT_AUTHOR_EMAIL": "bitsandbytes-kbit@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "bitsandbytes-kbit",
    "GIT_COMMITTER_EMAIL": "bitsandbytes-kbit@users.noreply.github.com",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}

# Upstream files the series edits: absent or changed shape means the checkout is not the upstream this was built for.
UPSTREAM_REQUIRED = (
    "CMakeLists.txt",
    "pyproject.toml",
    "csrc/kernels.cu",
    "csrc/kernels.cuh",
    "csrc/ops.cu",
    "csrc/ops.cuh",
    "csrc/pythonInterface.cpp",
    "bitsandbytes/_ops.py",
    "bitsandbytes/functional.py",
    "bitsandbytes/backends/default/ops.py",
    "bitsandbytes/backends/cuda/ops.py",
    "bitsandbytes/nn/modules.py",
    "bitsandbytes/nn/__init__.py",
    "tests/conftest.py",
)


class ExportError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------------------
# Python


def rename_python(text: str) -> str:
    """This package's names as upstream's: bitsandbytes_kbit -> bitsandbytes, _format -> _kbit_format, _cpu ->
    _kbit_cpu. The string
    "bitsandbytes_kbit" alone is the transformers quantization method's name and stays."""
    keep = "\0quant-method\0"
    text = text.replace(f'"{PKG}"', keep)
    text = re.sub(r"(from \.+)_format import", r"\1_kbit_format import", text)
    text = re.sub(rf"\b{PKG}\._format\b", "bitsandbytes._kbit_format", text)
    text = re.sub(rf"(from (?:\.+|{PKG})) import _cpu\b", r"\1 import _kbit_cpu as _cpu", text)
    text = re.sub(rf"\b{PKG}\._cpu\b", "bitsandbytes._kbit_cpu", text)
    return re.sub(rf"\b{PKG}\b", "bitsandbytes", text).replace(keep, f'"{PKG}"')


def _module_level_names(body: list[ast.stmt], imports: bool = True) -> set[str]:
    """Names a module binds at its top level, also inside if / try / with blocks (not inside functions or classes);
    with ``imports``, also the names its imports bind."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        nested = [getattr(node, block, None) or [] for block in ("body", "orelse", "finalbody")]
        nested += [handler.body for handler in getattr(node, "handlers", None) or []]
        for block in nested:
            names |= _module_level_names(block, imports)
    return names


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def merge_python(upstream: str, ours: str, where: str) -> str:
    """Append ``ours`` (already renamed) to the upstream module ``upstream``.

    Our imports go after upstream's last top-level import (``from __future__`` before upstream's first); our module
    docstring becomes a section comment; our ``__all__`` and assignments that repeat an upstream line verbatim (the
    ``register_fake = torch.library.register_fake`` aliases) are dropped. The function (``_``) and the aliases are the
    only names both may define."""
    up_tree, our_tree = ast.parse(upstream), ast.parse(ours)
    our_lines = ours.splitlines()
    up_lines = upstream.splitlines()

    clash = (_module_level_names(up_tree.body, False) & _module_level_names(our_tree.body, False)) - {
        "_",
        "register_fake",
        "register_kernel",
    }
    if clash:
        raise ExportError(f"{where}: names defined both upstream and here: {sorted(clash)}")

    def source(node: ast.stmt) -> list[str]:
        start = node.lineno - 1
        if getattr(node, "decorator_list", None):
            start = min(d.lineno for d in node.decorator_list) - 1
        return our_lines[start : node.end_lineno]

    up_stripped = {line.strip() for line in up_lines}
    future, imports, body, header = [], [], [], []
    body_start = None
    for i, node in enumerate(our_tree.body):
        if i == 0 and _is_docstring(node):
            header = ["# " + line if line.strip() else "#" for line in node.value.value.strip().splitlines()]
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future.append("\n".join(source(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and body_start is None:
            imports.append("\n".join(source(node)))
        else:
            if isinstance(node, ast.Assign):
                target_names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                text = "\n".join(source(node))
                if target_names == ["__all__"] or (node.lineno == node.end_lineno and text.strip() in up_stripped):
                    continue
            if body_start is None:
                body_start = node.lineno
            body.append(node)
    # everything from the first body statement on, comments included, minus the statements dropped above
    kept_ranges = [
        (min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]), n.end_lineno) for n in body
    ]
    chunks, prev_end = [], None
    for start, end in kept_ranges:
        lo = start - 1
        if prev_end is not None:  # keep the comments and blank lines between kept statements
            gap = our_lines[prev_end:lo]
            chunks.extend(gap)
        else:  # comments directly above the first statement
            j = lo
            while j > 0 and our_lines[j - 1].startswith("#"):
                j -= 1
            chunks.extend(our_lines[j:lo])
        chunks.extend(our_lines[lo:end])
        prev_end = end

    up_imports = [n for n in up_tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = list(up_lines)
    if up_imports:
        last = max(n.end_lineno for n in up_imports)
        out[last:last] = imports
        if future and not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in up_imports):
            first = min(n.lineno for n in up_imports) - 1
            out[first:first] = future
    else:
        out[0:0] = future + imports
    while out and not out[-1].strip():
        out.pop()
    out += ["", ""] + header + ([""] if header else []) + chunks
    return "\n".join(out) + "\n"


def conftest_helpers(text: str) -> str:
    """tests/conftest.py's helpers as tests/kbit_helpers.py: without the pytest hooks and the version fixture
    (upstream's conftest gets the cuda-marker hook), with upstream's library check."""
    tree = ast.parse(text)
    lines = text.splitlines()
    drop = []
    for node in tree.body:
        name = getattr(node, "name", None)
        if name in ("pytest_collection_modifyitems", "_version_is_set"):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            drop.append((start, node.end_lineno))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and (
            "cextension" in ast.unparse(node) or [a.name for a in getattr(node, "names", [])] == [PKG]
        ):
            drop.append((node.lineno - 1, node.end_lineno))
    for start, end in sorted(drop, reverse=True):
        del lines[start:end]
    out = rename_python("\n".join(lines) + "\n")
    out = out.replace("torch.cuda.is_available() and cextension.is_available()", "_native_cuda_library()")
    out = out.replace("(libbitsandbytes_kbit_cuda.so)", "(libbitsandbytes_cuda*.so)")
    out += (
        "\n\ndef _native_cuda_library() -> bool:\n"
        "    from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib\n\n"
        "    return torch.cuda.is_available() and not isinstance(lib, ErrorHandlerMockBNBNativeLibrary)\n"
    )
    # the helper is called at import time by the skip markers: define it first
    head, sep, rest = out.partition("\n\ndef ")
    helper = out[out.index("\n\ndef _native_cuda_library") :]
    rest = (sep + rest)[: -len(helper)] if helper else sep + rest
    return head + helper + rest


CONFTEST_HOOK = """

def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and the native library (skipped otherwise)")


def pytest_collection_modifyitems(config, items):
    # tests marked cuda (the k-bit kernel tests) need a GPU and the native library; the marker itself, not the
    # keyword, which upstream's tests parametrized on device "cuda" also carry
    from tests.kbit_helpers import requires_cuda

    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(requires_cuda)
"""


# Tests of the extension glue (the entry point that attaches this package to bitsandbytes): nothing to test upstream.
EXTENSION_TESTS = {
    "test_bitsandbytes_entry_point_attaches_the_api",
    "test_loading_without_the_extension_fails_loudly",
    "test_subprocess_without_extension_fails_loudly",
}


def drop_functions(text: str, names: set[str]) -> str:
    tree = ast.parse(text)
    lines = text.splitlines()
    for node in reversed(tree.body):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            end = node.end_lineno
            while end < len(lines) and not lines[end].strip():
                end += 1
            del lines[start:end]
    return "\n".join(lines) + "\n"


def port_test(text: str) -> str:
    text = drop_functions(text, EXTENSION_TESTS)
    return rename_python(text).replace("from conftest import", "from tests.kbit_helpers import")


def port_cuda_ops(text: str) -> str:
    """The CUDA registrations against upstream's library object instead of this package's loader."""
    text = rename_python(text)
    text = text.replace("from ...cextension import get_lib", "from ...cextension import lib as _native")
    return text.replace("get_lib()", "_native._lib")


# ---------------------------------------------------------------------------------------------------------------------
# C++ and CMake


def _drop_pragma_once(text: str) -> str:
    return re.sub(r"^#pragma once\n", "", text, flags=re.MULTILINE)


def insert_before_final_endif(upstream: str, ours: str, where: str) -> str:
    """Insert ``ours`` inside the header's include guard (before its last ``#endif``)."""
    idx = upstream.rstrip().rfind("#endif")
    if idx < 0:
        raise ExportError(f"{where}: no include guard's #endif to insert before")
    return upstream[:idx] + ours.rstrip() + "\n\n" + upstream[idx:]


def cuda_only(text: str) -> str:
    """The k-bit sections build for CUDA only (upstream compiles the same files for ROCm)."""
    return (
        "\n#if !BNB_HIP\n// k-bit blockwise quantization (2..5 bits)\n\n" + text.strip() + "\n\n#endif  // !BNB_HIP\n"
    )


def patch_cmake(text: str) -> str:
    """Build csrc/kbit_gemm.cu as an object library of the CUDA build (see the comment it writes)."""
    anchor = "            CUDA_SEPARABLE_COMPILATION ON\n    )\nendif()\n"
    if text.count(anchor) != 1:
        raise ExportError("CMakeLists.txt: the CUDA target's CUDA_SEPARABLE_COMPILATION block was not found once")
    block = (
        "\n# k-bit GEMM: an object library of its own. Its Hopper kernels (wgmma, TMA) need sm_90a code, which the\n"
        "# digits-only COMPUTE_CAPABILITY cannot ask for, so 90 becomes 90a for this file; it builds without relocatable\n"
        "# device code (every template is launched from this file), so the device link of the main target, which knows\n"
        "# only sm_90, cannot drop its sm_90a images. KBIT_WGMMA_BUILT lets the dispatcher offer those kernels.\n"
        "if(BUILD_CUDA)\n"
        "    add_library(bitsandbytes_kbit_gemm OBJECT csrc/kbit_gemm.cu)\n"
        "    set(_kbit_gemm_archs ${CMAKE_CUDA_ARCHITECTURES})\n"
        '    list(TRANSFORM _kbit_gemm_archs REPLACE "^90$" "90a")\n'
        '    list(TRANSFORM _kbit_gemm_archs REPLACE "^90-real$" "90a-real")\n'
        "    set_target_properties(bitsandbytes_kbit_gemm PROPERTIES\n"
        '        CUDA_ARCHITECTURES "${_kbit_gemm_archs}"\n'
        "        CUDA_SEPARABLE_COMPILATION OFF\n"
        "        POSITION_INDEPENDENT_CODE ON)\n"
        "    target_compile_features(bitsandbytes_kbit_gemm PRIVATE cxx_std_17)\n"
        "    target_include_directories(bitsandbytes_kbit_gemm PRIVATE csrc ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})\n"
        "    if(90 IN_LIST _cc_all)\n"
        "        target_compile_definitions(bitsandbytes_kbit_gemm PRIVATE KBIT_WGMMA_BUILT=1)\n"
        "    endif()\n"
        "    target_sources(bitsandbytes PRIVATE $<TARGET_OBJECTS:bitsandbytes_kbit_gemm>)\n"
        "endif()\n"
    )
    return text.replace(anchor, anchor + block, 1)


def port_cxx(text: str) -> str:
    text = text.replace(PKG, "bitsandbytes")
    return text.replace("libbitsandbytes_kbit_cuda", "libbitsandbytes_cuda")


# ---------------------------------------------------------------------------------------------------------------------
# The series


@dataclass
class Step:
    subject: str
    body: str
    edits: list = field(default_factory=list)  # callables (repo: Path) -> list of written paths


def read(rel: str) -> str:
    return (ROOT / rel).read_text()


def write(repo: Path, rel: str, text: str) -> str:
    path = repo / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return rel


def new_py(src: str, dst: str, port=rename_python):
    return lambda repo: [write(repo, dst, port(read(src)))]


def merge_py(src: str, dst: str, port=rename_python):
    def edit(repo: Path):
        return [write(repo, dst, merge_python((repo / dst).read_text(), port(read(src)), dst))]

    return edit


def copy_file(src: str, dst: str, port=None):
    def edit(repo: Path):
        text = read(src)
        return [write(repo, dst, port(text) if port else text)]

    return edit


def append_cxx(src: str, dst: str, header: bool):
    def edit(repo: Path):
        ours = cuda_only(_drop_pragma_once(port_cxx(read(src))))
        up = (repo / dst).read_text()
        text = insert_before_final_endif(up, ours, dst) if header else up.rstrip() + "\n" + ours
        return [write(repo, dst, text)]

    return edit


def append_python_interface(repo: Path):
    dst = "csrc/pythonInterface.cpp"
    ours = port_cxx(read("csrc/pythonInterface.cpp"))
    text = (repo / dst).read_text().rstrip() + "\n\n#if BUILD_CUDA\n// k-bit blockwise quantization (2..5 bits)\n\n"
    return [write(repo, dst, text + ours.strip() + "\n#endif  // BUILD_CUDA\n")]


def conftest_edit(repo: Path):
    helpers = write(repo, "tests/kbit_helpers.py", conftest_helpers(read("tests/conftest.py")))
    conftest = repo / "tests/conftest.py"
    return [helpers, write(repo, "tests/conftest.py", conftest.read_text().rstrip() + "\n" + CONFTEST_HOOK)]


def nn_init_edit(repo: Path):
    path = repo / "bitsandbytes/nn/__init__.py"
    line = "from .modules import KBIT_FORMAT_VERSION, LinearKbit, ParamsKbit, fuse_projections\n"
    return [write(repo, "bitsandbytes/nn/__init__.py", path.read_text().rstrip() + "\n" + line)]


def cmake_edit(repo: Path):
    return [write(repo, "CMakeLists.txt", patch_cmake((repo / "CMakeLists.txt").read_text()))]


# kbit_gemm.cuh comes with patch 1: it defines the tiled format that kernels.cu's tiled dequantize includes.
GEMM_FILES = [
    "kbit_gemm.cu",
    "kbit_gemm_wgmma.cuh",
    "kbit_gemm_wgmma_ws.cuh",
    "kbit_dispatch_coef.inc",
]
BENCH_FILES = [
    "bench_decode.py",
    "bench_dequantize.py",
    "bench_host_overhead.py",
    "bench_kbit_gemm.py",
    "model_shapes.py",
    "timing.py",
]


def series() -> list[Step]:
    return [
        Step(
            "Add k-bit blockwise quantization: format, reference backend, quantize and dequantize",
            "k = 2..5 bits per weight in blocks of 32, stored as k bit-planes per block with a 1-byte E4M4\n"
            "(or fp16 / fp32) absmax and a codebook of 2^k levels. The pure-PyTorch default backend is the\n"
            "format's executable spec; the CUDA quantize / dequantize kernels are checked bit for bit against it.",
            [
                new_py(f"{PKG}/_format.py", "bitsandbytes/_kbit_format.py"),
                new_py(f"{PKG}/scale_search.py", "bitsandbytes/scale_search.py"),
                new_py(f"{PKG}/backends/default/tiled_layout.py", "bitsandbytes/backends/default/tiled_layout.py"),
                merge_py(f"{PKG}/_ops.py", "bitsandbytes/_ops.py"),
                merge_py(f"{PKG}/backends/default/ops.py", "bitsandbytes/backends/default/ops.py"),
                merge_py(f"{PKG}/backends/cuda/ops.py", "bitsandbytes/backends/cuda/ops.py", port_cuda_ops),
                merge_py(f"{PKG}/functional.py", "bitsandbytes/functional.py"),
                append_cxx("csrc/kernels.cuh", "csrc/kernels.cuh", header=True),
                copy_file("csrc/kbit_gemm.cuh", "csrc/kbit_gemm.cuh", port_cxx),
                copy_file("csrc/kbit_tiled_unit.cuh", "csrc/kbit_tiled_unit.cuh", port_cxx),
                append_cxx("csrc/kernels.cu", "csrc/kernels.cu", header=False),
                conftest_edit,
                new_py("tests/test_kbit_quantization.py", "tests/test_kbit_quantization.py", port_test),
                new_py("tests/test_format_properties.py", "tests/test_kbit_format_properties.py", port_test),
                new_py("tests/test_scale_search.py", "tests/test_kbit_scale_search.py", port_test),
            ],
        ),
        Step(
            "Add the k-bit repack and fused dequantize + GEMM",
            "repack_kbit writes the GEMM's tiled layout; kbit_gemm multiplies activations by the packed weight\n"
            "without materialising it. The GEMM family lives in files of its own, as gemm_4bit does; its Hopper\n"
            'kernels build for sm_90a. Host launchers go to ops.cu, the quantize / dequantize extern "C" entry\n'
            "points to pythonInterface.cpp; repack and GEMM's are at the end of kbit_gemm.cu. k, the dtype and the\n"
            "absmax format are runtime arguments of a handful of entries, with one error convention.",
            [
                *[copy_file(f"csrc/{f}", f"csrc/{f}", port_cxx) for f in GEMM_FILES],
                append_cxx("csrc/ops.cuh", "csrc/ops.cuh", header=True),
                append_cxx("csrc/ops.cu", "csrc/ops.cu", header=False),
                append_python_interface,
                cmake_edit,
                new_py("tests/test_kbit_gemm.py", "tests/test_kbit_gemm.py", port_test),
            ],
        ),
        Step(
            "Add LinearKbit",
            "An nn.Linear replacement holding a k-bit weight in the GEMM's layout; state-dict format, autograd\n"
            "for adapters; on the CPU, native kernels (csrc/cpu/kbit_cpu.cpp, not yet in upstream's CPU build:\n"
            "without the library LinearKbit runs the PyTorch path).",
            [
                new_py(f"{PKG}/_cpu.py", "bitsandbytes/_kbit_cpu.py"),
                merge_py(f"{PKG}/backends/cpu/ops.py", "bitsandbytes/backends/cpu/ops.py"),
                copy_file("csrc/cpu/kbit_cpu.cpp", "csrc/cpu/kbit_cpu.cpp", port_cxx),
                merge_py(f"{PKG}/nn/modules.py", "bitsandbytes/nn/modules.py"),
                nn_init_edit,
                new_py("tests/test_linear_kbit.py", "tests/test_linear_kbit.py", port_test),
                new_py("tests/test_cpu_kernels.py", "tests/test_kbit_cpu_kernels.py", port_test),
            ],
        ),
        Step(
            "Add the k-bit transformers and PEFT integration and docs",
            "BitsAndBytesKbitConfig and its HfQuantizer (to become a transformers PR), LoRA on LinearKbit,\n"
            "GPTQ-style calibration, and the format and usage docs.",
            [
                new_py(f"{PKG}/integrations/__init__.py", "bitsandbytes/integrations/__init__.py"),
                new_py(f"{PKG}/integrations/transformers.py", "bitsandbytes/integrations/transformers.py"),
                new_py(f"{PKG}/integrations/peft.py", "bitsandbytes/integrations/peft.py"),
                new_py(f"{PKG}/calibration.py", "bitsandbytes/calibration.py"),
                copy_file(f"{PKG}/data/calibration.txt", "bitsandbytes/data/calibration.txt"),
                copy_file("docs/format.md", "docs/kbit/format.md", rename_python),
                copy_file("docs/usage.md", "docs/kbit/usage.md", rename_python),
                new_py("tests/test_transformers_kbit.py", "tests/test_transformers_kbit.py", port_test),
                new_py("tests/test_peft_kbit.py", "tests/test_peft_kbit.py", port_test),
                new_py("tests/test_fuse_projections.py", "tests/test_kbit_fuse_projections.py", port_test),
            ],
        ),
        Step(
            "Add the k-bit benchmarks",
            "GEMM, dequantize, host-overhead and decode benchmarks with their shared timing helper.",
            [copy_file(f"benchmarking/{f}", f"benchmarking/kbit/{f}", rename_python) for f in BENCH_FILES],
        ),
    ]


# ---------------------------------------------------------------------------------------------------------------------


def git(repo: Path, *args: str, env: dict | None = None) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), *args],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **AUTHOR_ENV, **(env or {})},
    )
    if result.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {repo}:\n{result.stderr.strip()}")
    return result.stdout


def ruff(repo: Path, files: list[str]) -> None:
    """Sort imports and format the series' Python files under upstream's ruff settings."""
    if not files:
        return
    cmd = [sys.executable, "-m", "ruff"]
    for args in (["check", "--fix", "--quiet", "--exit-zero"], ["format", "--quiet"]):
        result = subprocess.run([*cmd, *args, *files], cwd=repo, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExportError(f"ruff {args[0]} failed:\n{result.stdout}{result.stderr}")


def find_clang_format() -> str | None:
    """clang-format on PATH or beside this Python (the pip wheel); upstream pins 20.1 in .pre-commit-config.yaml."""
    beside = Path(sys.executable).parent / "clang-format"
    return shutil.which("clang-format") or (str(beside) if beside.is_file() else None)


def clang_format(repo: Path, files: list[str]) -> None:
    """Format the series' C++ files under upstream's .clang-format (upstream's files are already clean)."""
    if not files:
        return
    exe = find_clang_format()
    for _ in range(8):  # each pass can still move a macro's trailing backslashes (4 passes here): run to a fixed point
        before = [(repo / f).read_bytes() for f in files]
        cmd = [exe, "-i", "--style=file", *files]
        result = subprocess.run(cmd, cwd=repo, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExportError(f"clang-format failed:\n{result.stdout}{result.stderr}")
        if before == [(repo / f).read_bytes() for f in files]:
            return
    raise ExportError(f"clang-format does not reach a fixed point on {files}")


def _module_file(repo: Path, module: str) -> Path | None:
    base = repo / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def unresolved_imports(repo: Path, files: list[str]) -> list[str]:
    """Names that the given Python files import from bitsandbytes modules of ``repo`` which those modules do not
    define (top-level functions, classes, assignments, imports; or a submodule): what a rename left pointing at
    this package's own glue (its loader, say)."""
    problems = []
    for rel in files:
        package = rel.rsplit("/", 1)[0].replace("/", ".") if "/" in rel else ""
        for node in ast.walk(ast.parse((repo / rel).read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "bitsandbytes":
                continue
            source = _module_file(repo, module)
            if source is None:
                problems.append(f"{rel}:{node.lineno}: no module {module}")
                continue
            defined = _module_level_names(ast.parse(source.read_text()).body)
            if "__getattr__" in defined:  # lazy module attributes (PEP 562): not checked
                continue
            for alias in node.names:
                if alias.name not in defined and _module_file(repo, f"{module}.{alias.name}") is None:
                    problems.append(f"{rel}:{node.lineno}: {module} has no {alias.name}")
    return problems


def export(upstream: Path, out: Path) -> list[Path]:
    if find_clang_format() is None:
        raise ExportError("clang-format was not found (pip install 'clang-format>=20,<21', upstream's version)")
    upstream, out = upstream.resolve(), out.resolve()  # git runs in the clone: a relative --out would land there
    if not (upstream / ".git").exists():
        raise ExportError(f"--upstream={upstream} is not a git checkout (no .git)")
    missing = [f for f in UPSTREAM_REQUIRED if not (upstream / f).is_file()]
    if missing:
        raise ExportError(f"--upstream={upstream} lacks {missing}: expected a checkout of upstream bitsandbytes main")
    if git(upstream, "status", "--porcelain", "--untracked-files=no").strip():
        raise ExportError(f"--upstream={upstream} has uncommitted changes; give a clean checkout")
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob("*.patch"))
    if stale:
        raise ExportError(f"--out={out} already holds patches ({stale[0].name}, ...); give an empty directory")

    with tempfile.TemporaryDirectory(prefix="kbit-series-") as tmp:
        work = Path(tmp) / "bitsandbytes"
        subprocess.run(["git", "clone", "--quiet", "--no-local", str(upstream), str(work)], check=True)
        base = git(work, "rev-parse", "HEAD").strip()
        for step in series():
            written = []
            for edit in step.edits:
                written += edit(work)
            missing = unresolved_imports(work, [f for f in written if f.endswith(".py")])
            if missing:
                raise ExportError(f"{step.subject}: imports upstream lacks: " + "; ".join(missing))
            ruff(work, [f for f in written if f.endswith(".py")])
            clang_format(work, [f for f in written if f.startswith("csrc/")])
            git(work, "add", "--", *written)
            git(work, "commit", "--quiet", "--no-verify", "-m", f"{step.subject}\n\n{step.body}\n")
        git(work, "format-patch", "--quiet", "--zero-commit", "--no-signature", "-o", str(out), base)
    return sorted(out.glob("*.patch"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="a clean checkout of upstream bitsandbytes main")
    parser.add_argument("--out", type=Path, required=True, help="an empty (or new) directory for the patches")
    args = parser.parse_args(argv)
    if shutil.which("git") is None:
        parser.error("git is not on PATH")
    try:
        patches = export(args.upstream, args.out)
    except ExportError as err:
        print(f"export_series: {err}", file=sys.stderr)
        return 1
    for patch in patches:
        print(patch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
