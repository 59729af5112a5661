#!/usr/bin/env bash
# On the development machine (no GPU): build the wheel for sm_90 and assemble, in .whl/site,
# what the GPU machine lacks (bitsandbytes, slimmed to its CUDA 13.0 library, and this package
# with its native library). benchmarking/run_gpu.sh then runs there with PYTHONPATH=.whl/site.
set -euo pipefail
cd "$(dirname "$0")/.."
arch="${KBIT_CUDA_ARCHS:-90a}"
rm -rf dist .whl/site
KBIT_CUDA_ARCHS="$arch" python3 -m pip wheel --no-deps -w dist . >/dev/null
mkdir -p .whl
ls .whl/bitsandbytes-*.whl >/dev/null 2>&1 || python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2 >/dev/null
ls .whl/pytest_xdist-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps -d .whl pytest-xdist execnet
python3 -m pip install -q --no-deps --no-compile --target .whl/site .whl/bitsandbytes-*.whl dist/bitsandbytes_kbit-*.whl \
    .whl/pytest_xdist-*.whl .whl/execnet-*.whl  # xdist: run_gpu.sh's tests on 4 workers
find .whl/site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name 'libbitsandbytes_cuda130.so' ! -name 'libbitsandbytes_cpu.so' -delete
du -sh .whl/site
