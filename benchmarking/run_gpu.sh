#!/usr/bin/env bash
# On the GPU machine, from the repository root, after benchmarking/prepare_gpu_run.sh here:
#   bash benchmarking/run_gpu.sh            (carry .whl)
# Runs the CUDA tests and the benchmarks in one call; logs and JSON go to $OUT (or ./out);
# the short tables are printed last. The tests (about 2,000 on a GPU) and the GEMM benchmark (~6 min: each path
# settles at its own clock first) each take most of a 10-minute call: run KBIT_SKIP_GEMM_BENCH=1 and then
# KBIT_SKIP_TESTS=1 KBIT_SKIP_DEQUANT_BENCH=1; KBIT_TEST_ARGS="test_kbit_gemm.py" and the like run a part of the tests.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
export PYTHONPATH="$root/.whl/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KBIT_REQUIRE_NATIVE=1  # the carried wheel was built with nvcc: its library must load
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$out/gpu.txt"
(cd /tmp && python3 -c "import torch, bitsandbytes, bitsandbytes_kbit as bk; from bitsandbytes_kbit import cextension; \
print('torch', torch.__version__, 'bnb', bitsandbytes.__version__, 'kbit', bk.__file__, 'native', cextension.is_available()); \
assert bitsandbytes.functional.quantize_kbit is bk.quantize_kbit") 2>&1 | grep -v kernels-community | tee -a "$out/gpu.txt"

# the SASS order that M = 1 depends on (dev/check_codebook_order.py; cuobjdump comes with the CUDA toolkit)
if command -v cuobjdump > /dev/null && [ -f "$root/dev/check_codebook_order.py" ]; then
    python3 "$root/dev/check_codebook_order.py" "$root"/.whl/site/bitsandbytes_kbit/libbitsandbytes_kbit_cuda.so 2>&1 \
        | tee "$out/codebook_order.txt"
fi

# tests: run from tests/ so the installed package (with its library) is imported, not the source tree
pytest_rc=0
if [ -z "${KBIT_SKIP_TESTS:-}" ]; then
    # SIGINT at the limit: pytest still prints its summary and the failures (-rfE) of what ran. With pytest-xdist
    # (prepare_gpu_run.sh carries it) 4 workers share the GPU; the >2^31-element tests then run alone after them.
    parallel=()
    if [ -z "${KBIT_TEST_ARGS:-}" ] && python3 -c "import xdist" 2> /dev/null; then
        parallel=(-n 4 -k "not bigmem")
        export OMP_NUM_THREADS=4  # the workers' CPU reference products share the machine's cores
    fi
    (cd "$root/tests" && timeout -s INT -k 30 ${KBIT_TEST_TIMEOUT:-420} python3 -m pytest -q -rfE -p no:cacheprovider \
        "${parallel[@]}" ${KBIT_TEST_ARGS:-.} 2>&1) > "$out/pytest.log"
    pytest_rc=$?
    if [ ${#parallel[@]} -gt 0 ]; then
        (cd "$root/tests" && timeout -s INT -k 30 300 python3 -m pytest -q -rfE -p no:cacheprovider test_bigmem_kbit.py \
            2>&1) >> "$out/pytest.log"
        pytest_rc=$((pytest_rc | $?))
    fi
fi

cd "$root/benchmarking"
[ -z "${KBIT_SKIP_DEQUANT_BENCH:-}" ] && python3 bench_dequantize.py --json "$out/dequantize.json" > "$out/bench_dequantize.log" 2>&1
if [ -f bench_kbit_gemm.py ] && [ -z "${KBIT_SKIP_GEMM_BENCH:-}" ]; then
    python3 bench_kbit_gemm.py --json "$out/kbit_gemm.json" --plot "$out/kbit_gemm.png" ${KBIT_GEMM_BENCH_ARGS:-} \
        > "$out/bench_kbit_gemm.log" 2>&1
fi

if [ -n "${KBIT_DEMO:-}" ]; then  # the main job on the GPU; without the model package: its architecture, random weights
    (cd /tmp && BNB_KBIT_CACHE=/tmp/kbit_cache timeout 300 python3 -m bitsandbytes_kbit.demo --device cuda \
        --plot "$out/kbit_demo.png" $KBIT_DEMO 2>&1 | grep -v "it/s]") > "$out/demo.log"
fi

echo "==================== summary"
[ -f "$out/codebook_order.txt" ] && head -n 4 "$out/codebook_order.txt"
if [ -f "$out/pytest.log" ]; then
    grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -30
    tail -n 3 "$out/pytest.log"
fi
[ -f "$out/bench_dequantize.log" ] && tail -n 8 "$out/bench_dequantize.log"
[ -f "$out/bench_kbit_gemm.log" ] && tail -n 60 "$out/bench_kbit_gemm.log"
[ -f "$out/demo.log" ] && tail -n 12 "$out/demo.log"
exit $pytest_rc
