#!/usr/bin/env bash
# Build and run the kbit GEMM harness (development tool, not shipped).
#   dev/gemm_harness/run.sh                 correctness sweep + benchmark table
#   dev/gemm_harness/run.sh correct quick   correctness only, smaller shapes
#   dev/gemm_harness/run.sh sweep N K M k   every config (override) + dispatcher for one problem
# ARCH (default 90a, with the wgmma config) selects -gencode. Needs nvcc and cuBLAS. A prebuilt dev/bin/kbit_gemm_sm$ARCH.o is
# reused when it is newer than the sources (build it on a machine without a GPU and carry dev/bin).
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH=${ARCH:-90a}
DEFS=""; [ "$ARCH" = 90a ] && DEFS="-DKBIT_WGMMA_BUILT=1"  # the Hopper wgmma config (kbit_gemm_wgmma.cuh)
mkdir -p dev/bin
OBJ=dev/bin/kbit_gemm_sm$ARCH.o
if [ ! -f "$OBJ" ] || [ -n "$(find csrc -name 'kbit_gemm*' -newer "$OBJ")" ]; then
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr $DEFS -gencode=arch=compute_$ARCH,code=sm_$ARCH -c csrc/kbit_gemm.cu -o "$OBJ"
fi
nvcc -std=c++17 -O3 -gencode=arch=compute_$ARCH,code=sm_$ARCH -Xcompiler -fopenmp \
  dev/gemm_harness/harness.cu "$OBJ" -lcublas -lgomp -o dev/bin/kbit_harness
if [ ! -d dev/bin/tl ]; then mkdir -p dev/bin/tl && python3 dev/gemm_harness/make_repack_ref.py dev/bin/tl; fi
dev/bin/kbit_harness repackcheck dev/bin/tl
OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} dev/bin/kbit_harness "$@"
