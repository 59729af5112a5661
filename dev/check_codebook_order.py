"""Check, in the SASS of a built library, that every one-token-tile shared-A kernel (configs 2, 8, 10; E4M4 absmax)
waits for its codebook entry before it issues its first weight load.

ptxas places the multiply of the codebook entry by the LUT factor (an FMUL) right after the codebook load, so
each warp stalls there for the load's round trip and only then issues its A copies and weight loads. That order is
not asked for by the source, and it is worth 7-17% at M = 1 on H100:
builds in which ptxas put the multiply after the weight loads (an unrelated epilogue change; the codebook read before
the PDL wait) were that much slower, with the k-loop's SASS unchanged. Run this after any change to
`csrc/kbit_gemm.cuh`:

    python dev/check_codebook_order.py build/.../kbit_gemm.cu.o     (or the .so, or /tmp/kbit_variant/NAME.o)

Needs `cuobjdump` on PATH (CUDA toolkit; or the nvidia-cuda-cuobjdump wheel). Exit status 1 if a kernel has the
other order.
"""

import argparse
import re
import subprocess
import sys

# KbitSharedAConfig<K_BITS, MB, MT, CTAS, ABS_U8, WARPS_K, WARPS_N, BLOCK_COLUMNS>, mangled
CONFIG = re.compile(r"KbitSharedAConfigILi(\d)ELi(\d)ELi(\d)ELi(\d)ELb(\d)ELi(\d)ELi(\d)ELb(\d)EEE(\d+)__(\w+?)EEv")
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")


def kernels(sass: str):
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = block.split("\n", 1)
        yield name.strip(), [m.group(1) for m in map(INSTRUCTION.match, body.split("\n")) if m]


def order_of(instructions: list[str]):
    """(index of the codebook load, of the first instruction that reads its value, of the first weight load), None
    where absent. The codebook load is the first 32-bit LDG (A's fallback loads are 16-bit, the weights' are .NA)."""
    codebook = next((i for i, s in enumerate(instructions) if re.search(r"\bLDG\.E(\.CONSTANT)? R\d+,", s)), None)
    weight = next((i for i, s in enumerate(instructions) if "LDG.E.NA" in s), None)
    if codebook is None:
        return None, None, weight
    reg = re.search(r"LDG\S* (R\d+),", instructions[codebook]).group(1)
    reads = re.compile(rf"[ ,\[]{reg}(?![0-9])")
    use = next(
        (i for i in range(codebook + 1, len(instructions)) if reads.search(instructions[i].split(",", 1)[-1])), None
    )
    return codebook, use, weight


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="an object file or shared library with the sm_90a kernels")
    args = ap.parse_args()
    sass = subprocess.run(["cuobjdump", "-sass", args.binary], capture_output=True, text=True, check=True).stdout
    checked, bad = 0, []
    for name, instructions in kernels(sass):
        m = CONFIG.search(name)
        if "kbit_gemm_shared_a_kernel" not in name or m is None:
            continue
        k_bits, mb, _, _, abs_u8, warps_k, warps_n, block_columns, _, dtype = m.groups()
        if mb != "1" or abs_u8 != "1":  # two token tiles copy the codebook first (cp.async); fp16 absmax has no FMUL
            continue
        codebook, use, weight = order_of(instructions)
        what = f"k={k_bits} warps {warps_n}x{warps_k}{' block columns' if block_columns == '1' else ''} {dtype}"
        checked += 1
        if codebook is None or use is None or weight is None or not codebook < use < weight:
            bad.append(f"{what}: codebook load at {codebook}, its first use at {use}, first weight load at {weight}")
    print(f"{checked} one-token-tile kernels checked, {len(bad)} with the weight loads before the codebook wait")
    for line in bad:
        print("  " + line)
    if checked == 0:
        print("no kernel found: is this an sm_90a build of csrc/kbit_gemm.cu?")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
