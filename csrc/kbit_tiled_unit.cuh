// kbit_tiled_unit.cuh: reading the tiled k-bit layout one unit at a time (device code).
//
// A unit is 16 rows n x 128 k of the tiled weight (kbit_gemm.cuh, TiledFormat). Lane (g, t) of a
// warp reading a unit holds rows g and g + 8 x k 8p + 2t, +1 (p = 0..3) of each of its 4 blocks: 32 pairs of
// consecutive elements. A pair's 2*K_BITS index bits are one LUT index, one contiguous field of the
// lane's words; the LUT holds {codebook[i0], codebook[i1]} in the compute dtype, so a pair costs one
// shift/mask (an OR more where an odd-K_BITS field straddles two words), one shared load and one HMUL2
// by the block scale.
//
// Used by kbit_dequant_tiled_kernel, which writes rows of the weight in fp16/bf16 for the large-M
// path (dequantize a chunk, multiply with cuBLAS; see backends/cuda/ops.py).
#pragma once

#include "kbit_gemm.cuh"
#include "kernels.cuh"  // decode_e4m4

namespace kbit {

// What the unit readers need of a weight (a subset of the GEMM's parameters).
struct TiledWeight {
    const uint32_t* B;
    const void* B_absmax;
    const float* codebook;
    int codebook_len;
    int N, K_dim;
    int k_steps, n16_tiles;
};

// One unit column (16 rows x 128 k) as a lane holds it: its 2*K_BITS words and its 8 scales (rows g, g+8 x 4 blocks).
template <int K_BITS, bool ABS_U8> struct UnitRegs {
    uint32_t w[2 * K_BITS];
    uint32_t abs[ABS_U8 ? 2 : 4];  // u8: 8 bytes [half][blk]; fp16: 8 halves
};

template <int K_BITS, bool ABS_U8>
__device__ __forceinline__ void load_unit(UnitRegs<K_BITS, ABS_U8>& r, const TiledWeight& p, int n16, int kstep, int lane) {
    using F = TiledFormat<K_BITS>;
    if (n16 >= p.n16_tiles) {  // past the padded N: zero weights and scales
#pragma unroll
        for (int i = 0; i < 2 * K_BITS; i++) r.w[i] = 0;
#pragma unroll
        for (int i = 0; i < (ABS_U8 ? 2 : 4); i++) r.abs[i] = 0;
        return;
    }
    const long long unit = static_cast<long long>(n16) * p.k_steps + kstep;
    const uint32_t* g_unit = p.B + unit * F::UNIT_WORDS;
#pragma unroll
    for (int c = 0; c < F::NV4; c++) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(g_unit + c * 128 + lane * 4));
        r.w[4 * c + 0] = v.x;
        r.w[4 * c + 1] = v.y;
        r.w[4 * c + 2] = v.z;
        r.w[4 * c + 3] = v.w;
    }
    if constexpr (F::HAS_V2) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(g_unit + F::NV4 * 128 + lane * 2));
        r.w[4 * F::NV4 + 0] = v.x;
        r.w[4 * F::NV4 + 1] = v.y;
    }
    const int g = lane / 4;
    if constexpr (ABS_U8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.B_absmax) + unit * UNIT_ABSMAX + g * 8));
        r.abs[0] = v.x;
        r.abs[1] = v.y;
    } else {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.B_absmax) + unit * UNIT_ABSMAX + g * 8));
        r.abs[0] = v.x;
        r.abs[1] = v.y;
        r.abs[2] = v.z;
        r.abs[3] = v.w;
    }
}

// scale pair {s, s} of (half, blk) in the compute dtype
template <typename T, bool ABS_U8>
__device__ __forceinline__ uint32_t scale_of(const uint32_t* abs, int idx, const uint32_t* s_scale_lut) {
    if constexpr (ABS_U8) {
        const uint32_t code = (abs[idx / 4] >> (8 * (idx % 4))) & 0xFF;
        return s_scale_lut[code];
    } else {
        const uint32_t h = (abs[idx / 2] >> (16 * (idx % 2))) & 0xFFFF;  // fp16 bits
        const float s = __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
        return Pack2<T>::from_floats(s, s);
    }
}

// LUT index of pair pr (elements 8pr + 2t, +1) of (row g + 8 half, block blk): the pair's 2k-bit field of
// the lane's word stream (field positions: TiledFormat, tiled_bit_source).
template <int K_BITS, bool ABS_U8>
__device__ __forceinline__ uint32_t pair_lut_index(const UnitRegs<K_BITS, ABS_U8>& r, int blk, int half, int pr) {
    using F = TiledFormat<K_BITS>;
    const int q = 4 * (2 * blk + (pr >> 1)) + (half | ((pr & 1) << 1));
    const int pos = q * F::FIELD_BITS;
    const int w = pos / 32, b = pos % 32; // field bit 0 = bit b of word w
    uint32_t e = r.w[w] >> b;
    if (b + F::FIELD_BITS > 32) e |= r.w[w + 1] << (32 - b); // straddles two words (k = 3, 5)
    return e & ((1u << F::FIELD_BITS) - 1);
}

// A block of the weight, in whole units: rows [16 n16_begin, n_end) x k [128 ks_begin, k_end),
// written row-major with row stride k_end - 128 ks_begin.
struct TiledRegion {
    int n16_begin, n16_end, ks_begin, ks_end;
    int n_end, k_end;
};

// ---------------------------------------------------------------------------------------------
// Tiled weight -> a row-major fp16/bf16 block of W, for the large-M path (dequantize a chunk of
// rows or of k, then cuBLAS). One warp per unit, persistent CTAs so the pair table is built once
// per CTA; a lane dequantizes its pairs (k 8p + 2t), the lanes of a quad transpose them (quad_transpose_words) and
// each writes 8 chunks of 8 consecutive k (16 bytes).
// ---------------------------------------------------------------------------------------------
constexpr int DEQ_TILED_THREADS = 256;
constexpr int DEQ_TILED_CTAS_PER_SM = 8;  // persistent grid: 8 x 256 threads fill an SM

template <int K_BITS, typename T, bool ABS_U8>
__global__ void __launch_bounds__(DEQ_TILED_THREADS) kbit_dequant_tiled_kernel(
    const TiledWeight p, const TiledRegion region, T* __restrict__ g_out /* [n_end - 16 n16_begin, ld] */
) {
    using F = TiledFormat<K_BITS>;
    __shared__ uint32_t s_lut[1 << (2 * K_BITS)];
    __shared__ uint32_t s_scale_lut[256];
    for (int e = threadIdx.x; e < F::LUT_ENTRIES; e += blockDim.x) {
        int i0, i1;
        lut_index_to_pair<K_BITS>(e, i0, i1);
        s_lut[e] = Pack2<T>::from_floats(i0 < p.codebook_len ? p.codebook[i0] : 0.0f, i1 < p.codebook_len ? p.codebook[i1] : 0.0f);
    }
    for (int c = threadIdx.x; c < 256; c += blockDim.x) {
        const float s = decode_e4m4(static_cast<uint8_t>(c));
        s_scale_lut[c] = Pack2<T>::from_floats(s, s);
    }
    __syncthreads();
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int ks_count = region.ks_end - region.ks_begin;
    const int k_first = region.ks_begin * UNIT_K, row_first = region.n16_begin * UNIT_ROWS;
    const int ld = region.k_end - k_first; // a multiple of 32 (k_end is K_dim or a multiple of 128)
    const long long units = static_cast<long long>(region.n16_end - region.n16_begin) * ks_count;
    for (long long u = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; u < units; u += warps) {
        const int n16 = region.n16_begin + static_cast<int>(u / ks_count);
        const int kstep = region.ks_begin + static_cast<int>(u % ks_count);
        UnitRegs<K_BITS, ABS_U8> r;
        load_unit<K_BITS, ABS_U8>(r, p, n16, kstep, lane);
        const int row = n16 * UNIT_ROWS + g, k_unit = kstep * UNIT_K + 8 * t;
        T* g_row = g_out + static_cast<long long>(row - row_first) * ld + (k_unit - k_first);  // row g, block 0
#pragma unroll
        for (int half = 0; half < 2; half++) {
#pragma unroll
            for (int blk = 0; blk < UNIT_BLOCKS; blk++) {
                const uint32_t scale = scale_of<T, ABS_U8>(r.abs, half * UNIT_BLOCKS + blk, s_scale_lut);
                uint32_t v[4];
#pragma unroll
                for (int pr = 0; pr < 4; pr++) v[pr] = Pack2<T>::mul(s_lut[pair_lut_index<K_BITS, ABS_U8>(r, blk, half, pr)], scale);
                quad_transpose_words(v, t); // v[j] = pair t of lane j: k 8t + 2j, +1
                // one 16-byte store (rows start 64-byte aligned: ld % 32 == 0).
                if (k_unit + blk * BLOCK_ELEMS < region.k_end && row + 8 * half < region.n_end)
                    asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(g_row + blk * BLOCK_ELEMS), "r"(v[0]),
                                 "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
            }
            g_row += 8 * static_cast<long long>(ld);
        }
    }
}

}  // namespace kbit
