#!/usr/bin/env bash
# On the GPU machine, from the repository root, after benchmarking/prepare_gpu_run.sh here:
#   bash benchmarking/run_gpu.sh            (carry .whl)
# Runs the CUDA tests and the benchmarks in one call; logs and JSON go to $OUT (or ./out);
# the short tables are printed last. The tests take ~4.5 min on an H100 and the GEMM benchmark ~6 min
# (each path settles at its own clock first): where one call is limited to 10 minutes, run
# KBIT_SKIP_GEMM_BENCH=1 and then KBIT_SKIP_TESTS=1 KBIT_SKIP_DEQUANT_BENCH=1.
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
    (cd "$root/tests" && timeout ${KBIT_TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider ${KBIT_TEST_ARGS:-.} 2>&1) > "$out/pytest.log"
    pytest_rc=$?
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
