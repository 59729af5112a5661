#!/usr/bin/env bash
# Build and test the upstream patch series where it would live: inside a patched checkout of upstream bitsandbytes,
# built with upstream's own CMake and flags (issue 67 item 5). Two phases:
#
#   upstream/check_series.sh build UPSTREAM [--work DIR] [--slim DIR] [--python PY] [--jobs N]
#       Here, on a machine with CUDA 13's nvcc (no GPU needed). UPSTREAM is a clean checkout of upstream main.
#       1. export_series.py writes the series from this repository into DIR/series;
#       2. each prefix of the series (patch 1, 1-2, ..., 1-5) applies with `git am` onto a fresh clone, the tree
#          imports (pure Python, no native library) and the k-bit tests that prefix adds pass on the CPU; at patch 1,
#          nvcc compiles csrc/kernels.cu (upstream's kernels plus the quantize / dequantize kernels) with upstream's
#          flags; at the full series all k-bit CPU tests run;
#       3. the full series builds with upstream's CMake invocation for CUDA 13 / sm_90
#          (-DCOMPUTE_BACKEND=cuda -DCOMPUTE_CAPABILITY=90: relocatable device code, --use_fast_math), which writes
#          bitsandbytes/libbitsandbytes_cuda130.so into the tree;
#       4. cuobjdump checks the library: the k-bit GEMM's wgmma kernels carry sm_90a SASS (HGMMA instructions),
#          the rest of the library sm_90;
#       5. a slim copy of the patched tree (no .git, no build directory; the library and the tests kept) goes to
#          --slim (default scratch/patched in this repository, git-excluded), small enough to carry to a GPU machine.
#       Where the toolkit has no cuBLAS (upstream links it), the pip wheel nvidia-cublas (13.0) is unpacked into
#       DIR/cublas and handed to CMake as CUDA_cublas_LIBRARY / CUDA_cublasLt_LIBRARY and an include directory.
#
#   upstream/check_series.sh test PATCHED OUT [--budget SECONDS]
#       On the GPU machine (torch with CUDA 13, no bitsandbytes installed): with PYTHONPATH=PATCHED it checks that
#       the CUDA library loads, then runs the tree's k-bit tests (the CUDA ones compare quantize / dequantize with
#       the pure-PyTorch reference bit for bit, the GEMM against the reference, the Hopper configs on sm_90a) and
#       upstream's tests/test_ops.py and tests/test_functional.py (upstream's marker filter: not slow, benchmark or
#       deprecated; BNB_TEST_DEVICE=cuda as upstream's GPU CI), writing logs, JUnit files and summary.txt to OUT.
#       --budget (default 460 s) caps the whole phase: the k-bit tests get up to 3/5, upstream's tests the rest;
#       pytest-xdist (-n 6, 2 CPU threads each) is used where installed.
#
# docs/UPSTREAMING.md gives the commands and what to look for.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KBIT_TESTS=(tests/test_kbit_quantization.py tests/test_kbit_format_properties.py tests/test_kbit_scale_search.py
    tests/test_kbit_gemm.py tests/test_linear_kbit.py tests/test_kbit_cpu_kernels.py tests/test_transformers_kbit.py
    tests/test_peft_kbit.py tests/test_kbit_fuse_projections.py)
UPSTREAM_MARKERS="not slow and not benchmark and not deprecated"

die() {
    echo "check_series: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

now() { date +%s; }

step() { echo "== $* ($(date -u +%H:%M:%S))"; }

# ---------------------------------------------------------------------------------------------------------------------
# build

# A sitecustomize that hides the 'bitsandbytes.backends' entry points, so that where bitsandbytes-kbit is installed
# in the same Python, `import bitsandbytes` from the patched tree does not load it too (the ops would be defined twice).
write_sitecustomize() {
    mkdir -p "$1"
    cat >"$1/sitecustomize.py" <<'EOF'
import importlib.metadata as _m

_entry_points = _m.entry_points
_m.entry_points = lambda **kw: [] if kw.get("group") == "bitsandbytes.backends" else _entry_points(**kw)
EOF
}

# cuBLAS headers and libraries for CMake: the toolkit's, or the nvidia-cublas wheel unpacked into $1.
cublas_args() {
    local dir="$1" toolkit
    toolkit="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    if [[ -f "$toolkit/include/cublas_v2.h" ]] && compgen -G "$toolkit/lib*/libcublas.so*" >/dev/null; then
        return
    fi
    if [[ ! -f "$dir/nvidia/cu13/include/cublas_v2.h" ]]; then
        echo "the CUDA toolkit at $toolkit has no cuBLAS: unpacking the nvidia-cublas 13.0 wheel into $dir" >&2
        rm -rf "$dir" && mkdir -p "$dir/wheel"
        "$PYTHON" -m pip download --quiet --no-deps -d "$dir/wheel" "nvidia-cublas==13.0.*" >&2
        "$PYTHON" -m zipfile -e "$dir"/wheel/nvidia_cublas-*.whl "$dir" >&2
    fi
    local cb="$dir/nvidia/cu13"
    printf '%s\n' "-DCUDA_cublas_LIBRARY=$cb/lib/libcublas.so.13" "-DCUDA_cublasLt_LIBRARY=$cb/lib/libcublasLt.so.13" \
        "-DCMAKE_CUDA_FLAGS=-isystem $cb/include" "-DCMAKE_CXX_FLAGS=-isystem $cb/include"
}

# The k-bit tests that exist in the tree in $1, as paths relative to it.
present_kbit_tests() {
    local t
    for t in "${KBIT_TESTS[@]}"; do [[ -f "$1/$t" ]] && echo "$t"; done
    return 0
}

cpu_pytest() { # label, tree, log, test files...
    local label="$1" tree="$2" log="$3"
    shift 3
    (cd "$tree" && PYTHONPATH="$SITE:$tree" "$PYTHON" -m pytest -o addopts= -o log_cli=false -q -p no:cacheprovider \
        "$@") >"$log" 2>&1 || {
        tail -30 "$log" >&2
        die "$label: k-bit CPU tests failed in $tree (log: $log)"
    }
    echo "$label: $(tail -1 "$log")"
}

phase_build() {
    local upstream="" work="$ROOT/scratch/upstream-build" slim="$ROOT/scratch/patched" jobs
    PYTHON="python3"
    jobs="$(nproc)"
    while (($#)); do
        case "$1" in
        --work) work="$2" && shift 2 ;;
        --slim) slim="$2" && shift 2 ;;
        --python) PYTHON="$2" && shift 2 ;;
        --jobs) jobs="$2" && shift 2 ;;
        -h | --help) usage ;;
        -*) die "build: unknown option '$1' (expected --work, --slim, --python or --jobs)" ;;
        *) [[ -z "$upstream" ]] || die "build: one UPSTREAM checkout expected, got '$upstream' and '$1'"
            upstream="$1" && shift ;;
        esac
    done
    [[ -n "$upstream" ]] || die "build: give UPSTREAM, a clean checkout of upstream bitsandbytes main"
    [[ -d "$upstream/.git" ]] || die "build: UPSTREAM='$upstream' is not a git checkout"
    command -v nvcc >/dev/null || die "build: nvcc (CUDA 13) is not on PATH"
    command -v cmake >/dev/null || die "build: cmake is not on PATH"
    "$PYTHON" -c "import torch, pytest" 2>/dev/null || die "build: --python='$PYTHON' lacks torch or pytest"
    local cuobjdump
    cuobjdump="$(command -v cuobjdump || true)"
    [[ -n "$cuobjdump" ]] || cuobjdump="$("$PYTHON" -c 'import nvidia, pathlib; print(next(pathlib.Path(nvidia.__path__[0]).glob("cu*/bin/cuobjdump")))' 2>/dev/null || true)"
    [[ -x "$cuobjdump" ]] || die "build: cuobjdump not found (the CUDA toolkit's, or pip install nvidia-cuda-cuobjdump)"

    local t0 tree series
    t0="$(now)"
    rm -rf "$work/series" "$work/patched" "$work/build-patch1" "$work/elf" && mkdir -p "$work"
    work="$(cd "$work" && pwd)"
    SITE="$work/site"
    write_sitecustomize "$SITE"
    series="$work/series"
    tree="$work/patched"

    step "export the series from $ROOT onto $upstream"
    PATH="$(dirname "$PYTHON"):$PATH" "$PYTHON" "$ROOT/upstream/export_series.py" --upstream "$upstream" --out "$series"
    local patches=("$series"/*.patch)

    step "each prefix of the series applies, imports and passes the k-bit CPU tests it adds"
    git clone --quiet --no-local "$upstream" "$tree"
    local i added
    for i in "${!patches[@]}"; do
        git -C "$tree" am --quiet "${patches[$i]}" || die "patch $((i + 1)) does not apply: ${patches[$i]}"
        (cd "$tree" && PYTHONPATH="$SITE:$tree" "$PYTHON" -c "
import bitsandbytes, bitsandbytes.functional as F
assert bitsandbytes.__file__.startswith('$tree'), bitsandbytes.__file__
F.quantize_kbit, F.dequantize_kbit") || die "the tree at patch $((i + 1)) does not import"
        mapfile -t added < <(git -C "$tree" diff --name-only --diff-filter=A HEAD~1 -- 'tests/test_*.py')
        if ((i == 0)); then
            step "patch 1: upstream's CMake (not yet patched) compiles csrc/kernels.cu with the quantize kernels"
            local extra1 t1
            t1="$(now)"
            mapfile -t extra1 < <(cublas_args "$work/cublas")
            (cd "$tree" && cmake -DCOMPUTE_BACKEND=cuda -DCOMPUTE_CAPABILITY=90 -DCMAKE_BUILD_TYPE=Release \
                "${extra1[@]}" -S . -B "$work/build-patch1" >"$work/patch1_cmake.log" 2>&1 &&
                make -C "$work/build-patch1" csrc/kernels.o VERBOSE=1 >>"$work/patch1_cmake.log" 2>&1) || {
                grep -m 20 "error" "$work/patch1_cmake.log" >&2 || true
                die "patch 1: csrc/kernels.cu does not compile ($work/patch1_cmake.log)"
            }
            echo "patch 1: csrc/kernels.cu compiled in $(($(now) - t1)) s"
        fi
        if ((i + 1 < ${#patches[@]})) && ((${#added[@]})); then
            cpu_pytest "patch $((i + 1))" "$tree" "$work/prefix$((i + 1)).log" "${added[@]}"
        fi
    done
    mapfile -t added < <(present_kbit_tests "$tree")
    cpu_pytest "full series, all k-bit tests" "$tree" "$work/kbit_cpu.log" "${added[@]}"

    step "upstream's ruff and clang-format on every file the series adds or changes"
    local py cxx clang
    mapfile -t py < <(git -C "$tree" diff --name-only --diff-filter=AM "HEAD~${#patches[@]}" -- '*.py')
    mapfile -t cxx < <(git -C "$tree" diff --name-only --diff-filter=AM "HEAD~${#patches[@]}" -- 'csrc/*')
    clang="$(command -v clang-format || echo "$(dirname "$PYTHON")/clang-format")"
    (cd "$tree" && "$PYTHON" -m ruff check --quiet "${py[@]}" && "$PYTHON" -m ruff format --check --quiet "${py[@]}" &&
        "$clang" --dry-run --Werror --style=file "${cxx[@]}") || die "the series is not clean under upstream's style"
    echo "clean: ${#py[@]} Python files (ruff check, ruff format), ${#cxx[@]} C++ files (clang-format $("$clang" \
        --version | grep -oE '[0-9]+\.[0-9.]+' | head -1))"

    step "upstream's CMake: -DCOMPUTE_BACKEND=cuda -DCOMPUTE_CAPABILITY=90"
    local t1 extra
    t1="$(now)"
    mapfile -t extra < <(cublas_args "$work/cublas")
    (cd "$tree" && cmake -DCOMPUTE_BACKEND=cuda -DCOMPUTE_CAPABILITY=90 -DCMAKE_BUILD_TYPE=Release "${extra[@]}" \
        -S . -B build >"$work/cmake_configure.log" 2>&1) || die "cmake configure failed: $work/cmake_configure.log"
    grep -E "CUDA (Version|Targets|NVCC Flags)" "$work/cmake_configure.log"
    (cd "$tree" && cmake --build build --parallel "$jobs" --verbose >"$work/cmake_build.log" 2>&1) || {
        grep -m 20 -E "error|Error" "$work/cmake_build.log" >&2 || true
        die "the CUDA build failed: $work/cmake_build.log"
    }
    local so="$tree/bitsandbytes/libbitsandbytes_cuda130.so"
    [[ -f "$so" ]] || die "the build did not write $so"
    echo "built $(basename "$so") ($(du -h "$so" | cut -f1)) in $(($(now) - t1)) s"
    grep -E "nvcc .*kbit_gemm\.cu" "$work/cmake_build.log" | grep -oE -- "--generate-code=[^ ]+|-rdc=true|--use_fast_math" |
        sort -u | sed 's/^/  kbit_gemm.cu: /'
    grep -E "nvcc .*csrc/kernels\.cu" "$work/cmake_build.log" | grep -oE -- "--generate-code=[^ ]+|-rdc=true|--use_fast_math" |
        sort -u | sed 's/^/  kernels.cu:   /'

    step "cuobjdump: sm_90a SASS for the wgmma kernels"
    check_sass "$cuobjdump" "$so" "$work"

    step "slim copy for the GPU machine: $slim"
    rm -rf "$slim" && mkdir -p "$slim"
    (cd "$tree" && git ls-files -z | xargs -0 cp --parents -t "$slim")
    cp "$so" "$slim/bitsandbytes/"
    echo "slim tree: $(du -sh "$slim" | cut -f1) ($(find "$slim" -type f | wc -l) files), library included"
    echo "build phase done in $(($(now) - t0)) s"
}

# The library's ELF images: the sm_90a one must hold the k-bit GEMM (its wgmma kernels with HGMMA instructions), the
# sm_90 one the rest (upstream's kernels, the k-bit quantize / dequantize from kernels.cu) and no wgmma kernel.
check_sass() {
    local cuobjdump="$1" so="$2" work="$3" cubin name hgmma
    rm -rf "$work/elf" && mkdir -p "$work/elf"
    (cd "$work/elf" && "$cuobjdump" -xelf all "$so" >/dev/null) || die "cuobjdump -xelf failed on $so"
    ls "$work/elf" | sed 's/^/  ELF: /'
    for cubin in "$work"/elf/*.cubin; do
        name="$(basename "$cubin")"
        "$cuobjdump" -sass "$cubin" >"$work/elf/$name.sass"
        # kernels (each starts with a "Function : name" header) and, per kernel, whether it has HGMMA instructions
        hgmma="$(awk '/Function :/ {f=$3; k[f]=0} /HGMMA/ {k[f]=1} END {t=0; w=0; h=0; for (f in k) {t++;
            if (f ~ /wgmma/) {w++; h+=k[f]}} printf "%d kernels, %d wgmma kernels, %d of them with HGMMA", t, w, h}' \
            "$work/elf/$name.sass")"
        echo "  $name: $hgmma; k-bit kernels: $(grep "Function :" "$work/elf/$name.sass" | grep -o -E \
            "kbit_[a-z_]+kernel|kQuantizeKbit(Mse)?|kDequantizeKbit" | sort | uniq -c | tr -s ' \n' ' ')"
        case "$name" in
        *sm_90a.cubin)
            [[ "$hgmma" =~ ([1-9][0-9]*)\ wgmma\ kernels,\ ([0-9]+)\ of ]] && ((BASH_REMATCH[1] == BASH_REMATCH[2])) ||
                die "$name: not every wgmma kernel has HGMMA instructions ($hgmma)" ;;
        *sm_90.cubin)
            [[ "$hgmma" == *" 0 wgmma kernels"* ]] || die "$name: wgmma kernels in the sm_90 image ($hgmma)" ;;
        esac
    done
    compgen -G "$work/elf/*sm_90a.cubin" >/dev/null || die "no sm_90a image in $so: the GEMM's Hopper kernels dropped out"
    compgen -G "$work/elf/*sm_90.cubin" >/dev/null || die "no sm_90 image in $so"
}

# ---------------------------------------------------------------------------------------------------------------------
# test

phase_test() {
    local tree="" out="" budget=460
    while (($#)); do
        case "$1" in
        --budget) budget="$2" && shift 2 ;;
        -h | --help) usage ;;
        -*) die "test: unknown option '$1' (expected --budget)" ;;
        *) if [[ -z "$tree" ]]; then tree="$1"; elif [[ -z "$out" ]]; then out="$1"; else
            die "test: expected PATCHED OUT, got a third argument '$1'"
        fi && shift ;;
        esac
    done
    [[ -n "$tree" && -n "$out" ]] || die "test: give PATCHED (the slim patched tree) and OUT (a directory for results)"
    [[ -d "$tree" ]] || die "test: PATCHED='$tree' is not a directory"
    tree="$(cd "$tree" && pwd)"
    [[ -f "$tree/bitsandbytes/libbitsandbytes_cuda130.so" ]] ||
        die "test: $tree/bitsandbytes/libbitsandbytes_cuda130.so is missing: run the build phase and carry its --slim"
    mkdir -p "$out"
    out="$(cd "$out" && pwd)"
    PYTHON="python3"
    local t0 summary="$out/summary.txt"
    t0="$(now)"
    export PYTHONPATH="$tree" PYTHONUNBUFFERED=1
    cd "$tree"

    {
        echo "patched tree: $tree"
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 || true
        "$PYTHON" -c "
import bitsandbytes, torch
from bitsandbytes.cextension import lib
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))
print('bitsandbytes from', bitsandbytes.__file__)
print('native library:', type(lib).__name__, getattr(getattr(lib, '_lib', None), '_name', None))
assert bitsandbytes.__file__.startswith('$tree'), 'an installed bitsandbytes shadows the patched tree'
assert type(lib).__name__ == 'CudaBNBNativeLibrary', 'the CUDA library did not load'
" 2>&1
    } | tee "$summary"
    grep -q "native library: CudaBNBNativeLibrary" "$summary" || die "test: the patched tree's CUDA library did not load"
    if command -v cuobjdump >/dev/null; then
        cuobjdump --list-elf bitsandbytes/libbitsandbytes_cuda130.so | sed 's/^/elf: /' | tee -a "$summary"
    fi

    # pytest-xdist where installed: 6 workers, 2 CPU threads each (the CPU references run beside the GPU kernels)
    local xdist=()
    "$PYTHON" -c "import xdist" 2>/dev/null && xdist=(-n 6) && export OMP_NUM_THREADS=2
    local kbit_tests
    mapfile -t kbit_tests < <(present_kbit_tests "$tree")
    # SIGINT at the time limit: pytest stops, still prints its summary and writes the JUnit file
    local share=$((budget * 3 / 5)) rc_k=0 rc_u=0
    echo "k-bit tests (${#kbit_tests[@]} files, ${xdist[*]:-serial}, up to $share s)" | tee -a "$summary"
    timeout -s INT -k 30 "$share" "$PYTHON" -m pytest -o addopts= -o log_cli=false -q -p no:cacheprovider "${xdist[@]}" -rs \
        --junitxml="$out/kbit.xml" "${kbit_tests[@]}" >"$out/kbit.log" 2>&1 || rc_k=$?
    echo "k-bit tests: rc=$rc_k; $(tail -1 "$out/kbit.log")" | tee -a "$summary"

    local left=$((budget - ($(now) - t0) - 10))
    # BNB_TEST_DEVICE=cuda, as upstream's CI sets it on its GPU runners: the device-parametrized tests run on the GPU
    # only (their CPU half gives the same results with and without the series, checked on the CPU)
    echo "upstream tests/test_ops.py tests/test_functional.py (BNB_TEST_DEVICE=cuda, -m '$UPSTREAM_MARKERS'," \
        "up to $left s)" | tee -a "$summary"
    BNB_TEST_DEVICE=cuda timeout -s INT -k 30 "$left" "$PYTHON" -m pytest -o addopts= -o log_cli=false -m "$UPSTREAM_MARKERS" -q -p no:cacheprovider \
        "${xdist[@]}" --junitxml="$out/upstream.xml" tests/test_ops.py tests/test_functional.py \
        >"$out/upstream.log" 2>&1 || rc_u=$?
    echo "upstream tests: rc=$rc_u; $(tail -1 "$out/upstream.log")" | tee -a "$summary"
    "$PYTHON" - "$out/kbit.xml" "$out/upstream.xml" <<'EOF' | tee -a "$summary"
# Per file: passed / failed / skipped, the skip reasons of the CUDA tests, and whether the bit-exact quantize tests ran.
import collections, sys, xml.etree.ElementTree as ET
for path in sys.argv[1:]:
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except (OSError, ET.ParseError) as err:
        print(f"{path}: no JUnit report ({err.__class__.__name__}: the run was cut short?)")
        continue
    counts = collections.defaultdict(collections.Counter)
    reasons = collections.Counter()
    bit_exact = collections.Counter()
    for case in cases:
        name = case.get("classname") or "(no class: an interrupted test)"
        file = name.split(".")[1] if "." in name else name
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "skipped"
                reasons[(child.get("message") or "")[:100]] += 1
        counts[file][status] += 1
        if "cuda_bit_exact" in case.get("name", ""):
            bit_exact[status] += 1
    print(f"== {path.rsplit('/', 1)[-1]}")
    for file, c in sorted(counts.items()):
        print(f"  {file}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    for reason, n in reasons.most_common(8):
        print(f"  skipped {n}: {reason}")
    if "kbit" in path:
        print(f"  quantize/dequantize bit-exact vs the reference (test_cuda_bit_exact_*): {dict(bit_exact)}")
EOF
    echo "test phase done in $(($(now) - t0)) s" | tee -a "$summary"
    ((rc_k == 0 && rc_u == 0)) || exit 1
}

case "${1:-}" in
build) shift && phase_build "$@" ;;
test) shift && phase_test "$@" ;;
*) usage ;;
esac
