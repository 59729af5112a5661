#!/usr/bin/env bash
# Build a variant of the native library (sm_90a) from the working tree's csrc/kbit_gemm.cu with extra nvcc flags
# (e.g. -lineinfo for ncu source views), linked with the other objects of the CMake build of prepare_gpu_run.sh, to
# time against the installed library on the GPU machine with BNB_KBIT_LIBRARY=.whl/variants/NAME.so.
#   bash dev/build_variant.sh NAME [nvcc flags...]   -> .whl/variants/NAME.so
set -euo pipefail
cd "$(dirname "$0")/.."
name="$1"; shift
b=build/py3-none-linux_x86_64
o=$b/CMakeFiles/bitsandbytes_kbit_cuda.dir/csrc
mkdir -p .whl/variants /tmp/kbit_variant
nvcc -I csrc -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a -DKBIT_WGMMA_BUILT=1 -Xcompiler=-fPIC --expt-relaxed-constexpr \
    -std=c++17 "$@" -x cu -c csrc/kbit_gemm.cu -o /tmp/kbit_variant/$name.o
g++ -fPIC -O3 -shared -o .whl/variants/$name.so $o/kernels.cu.o $o/ops.cu.o /tmp/kbit_variant/$name.o \
    $o/pythonInterface.cpp.o -L/usr/local/cuda-13.0/targets/x86_64-linux/lib /usr/local/cuda-13.0/lib/libcudart_static.a \
    -ldl -lrt -lpthread
echo ".whl/variants/$name.so"
