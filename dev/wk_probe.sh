#!/bin/bash
# temporary: configs 2/3 vs their two-warps-along-k versions 8/9 (forced), then the GEMM tests
cd "$(dirname "$0")"
export PYTHONPATH=$PWD/../.whl/site KBIT_REQUIRE_NATIVE=1
S="4096x14336 4096x4096 8192x8192 14336x4096 8192x28672 28672x8192"
python3 probe_paths.py --configs 2 8 --shapes $S --ms 1 --ks 2 3 4 5 --rounds 3 > $OUT/probe_m1.log 2>&1
python3 probe_paths.py --configs 3 9 --shapes $S --ms 16 --ks 2 3 4 5 --rounds 3 > $OUT/probe_m16.log 2>&1
cat $OUT/probe_m1.log $OUT/probe_m16.log | sed 's/fp16=[ 0-9.]*//'
(cd ../tests && timeout 300 python3 -m pytest -q -x -p no:cacheprovider test_kbit_gemm.py 2>&1 | tail -3)
