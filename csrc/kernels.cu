// k-bit blockwise quantize / dequantize kernels (seed 000 section 1) and their explicit
// instantiations. Nothing here depends on another translation unit's device code, so the
// library links without relocatable device code.
#include <type_traits>

#include "kernels.cuh"
#include "kbit_tiled_unit.cuh"

namespace kbit {

constexpr unsigned kFullMask = 0xffffffffu;

// Shared by both quantize kernels (one warp per 32-element block, lane j owns element j).

// The block's absmax, on every lane (invalid lanes pass 0).
__device__ __forceinline__ float warp_absmax(float x) {
    float amax = fabsf(x);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    return amax;
}

// Writes block blk: plane word b (bit j = bit b of lane j's index; lanes past n give 0) from lane b, the stored scale
// from lane 0. Every lane of the warp calls it (the ballots need all of them).
template <int K_BITS, typename ABSMAX_T>
__device__ __forceinline__ void store_block(
    int lane, bool valid, int index, long long blk, int32_t* __restrict__ packed, ABSMAX_T* __restrict__ absmax,
    ABSMAX_T stored
) {
    uint32_t my_word = 0;
#pragma unroll
    for (int b = 0; b < K_BITS; ++b) {
        const uint32_t word = __ballot_sync(kFullMask, valid && ((index >> b) & 1));
        if (lane == b)
            my_word = word;
    }
    if (lane < K_BITS)
        packed[blk * K_BITS + lane] = static_cast<int32_t>(my_word);
    if (lane == 0)
        absmax[blk] = stored;
}

template <typename T, int K_BITS, typename ABSMAX_T>
__global__ void kQuantizeKbit(
    const T* __restrict__ A, const float* __restrict__ codebook, int codebook_len, int32_t* __restrict__ packed,
    ABSMAX_T* __restrict__ absmax, long long n
) {
    const int lane = threadIdx.x % 32;
    const long long num_blocks = (n + kBlockElems - 1) / kBlockElems;
    const long long warps_per_grid = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    const float r_code = lane < codebook_len ? codebook[lane] : 0.0f;  // lane c holds codebook[c]

    // The trip count is uniform across the warp, so every shuffle and ballot has all lanes.
    for (long long blk = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; blk < num_blocks;
         blk += warps_per_grid) {
        const long long i = blk * kBlockElems + lane;
        const bool valid = i < n;
        const float x = valid ? to_float(A[i]) : 0.0f;
        const float amax = warp_absmax(x);

        const ABSMAX_T stored = AbsmaxCodec<ABSMAX_T>::encode(amax);
        const float scale = AbsmaxCodec<ABSMAX_T>::decode(stored);
        const float xn = scale > 0.0f ? x / scale : 0.0f;

        // Nearest codebook entry; strict '<' keeps the lower index on ties.
        int best = 0;
        float best_dist = fabsf(xn - __shfl_sync(kFullMask, r_code, 0));
        for (int c = 1; c < codebook_len; ++c) {
            const float dist = fabsf(xn - __shfl_sync(kFullMask, r_code, c));
            if (dist < best_dist) {
                best_dist = dist;
                best = c;
            }
        }

        store_block<K_BITS>(lane, valid, best, blk, packed, absmax, stored);
    }
}

// Indices of 8 elements (bits 0..7 of each plane word, element j in bit j) as byte offsets
// into a float table: lo4 holds elements 0..3, hi4 elements 4..7, one byte each, = 4 * index.
// Spreading a nibble to 4 bytes is one multiply: bit i of the nibble times 0x00204081 lands at
// bits i, i+7, i+14, i+21, and bit 8i survives the byte mask only for the i-th copy (no
// carries: the 16 products sit at distinct positions). 3 integer ops per plane per 4 elements
// instead of 3 per plane per element.
template <int K_BITS>
__device__ __forceinline__ void
byte_offsets_from_planes(const uint32_t (&planes)[K_BITS], uint32_t& lo4, uint32_t& hi4) {
    lo4 = 0;
    hi4 = 0;
#pragma unroll
    for (int b = 0; b < K_BITS; ++b) {
        const uint32_t spread = 0x00204081u << (b + 2);  // +2: offsets are 4 * index (float table)
        const uint32_t mask = 0x01010101u << (b + 2);
        lo4 |= ((planes[b] & 0xF) * spread) & mask;
        hi4 |= (((planes[b] >> 4) & 0xF) * spread) & mask;
    }
}

__device__ __forceinline__ int32_t load_plane(const int32_t* p) {
    int32_t v;
    asm("ld.global.nc.L2::256B.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}

// A whole block's planes at once for k = 2 (8 bytes) and k = 4 (16 bytes), same path and hint as
// load_plane. (Odd k has no aligned vector: loading 24 aligned bytes around k = 5's 20 and selecting
// dropped it to 63% of copy_, H200.)
__device__ __forceinline__ uint2 load_planes_v2(const int32_t* p) {
    uint2 v;
    asm("ld.global.nc.L2::256B.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 load_planes_v4(const int32_t* p) {
    uint4 v;
    asm("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <typename T, int K_BITS, typename ABSMAX_T>
__global__ void kDequantizeKbit(
    const int32_t* __restrict__ packed, const ABSMAX_T* __restrict__ absmax, const float* __restrict__ codebook,
    int codebook_len, T* __restrict__ out, long long n, bool vector_store
) {
    constexpr int kElemsPerThread = kDequantizeElemsPerThread;
    constexpr int kGroupsPerBlock = kBlockElems / kElemsPerThread;
    __shared__ float s_code[kMaxCodebook];  // 32 floats in 32 banks: any index pattern is conflict-free
    if (threadIdx.x < kMaxCodebook)
        s_code[threadIdx.x] = threadIdx.x < codebook_len ? codebook[threadIdx.x] : 0.0f;
    __syncthreads();
    const char* s_code_bytes = reinterpret_cast<const char*>(s_code);

    const long long num_groups = (n + kElemsPerThread - 1) / kElemsPerThread;
    // 8 elements: LUT offsets from this thread's byte of each plane, then one 16-byte store
    auto convert_store = [&](long long group, const uint32_t (&r_planes)[K_BITS], float scale) {
        const long long first = group * kElemsPerThread;
        uint32_t lo4, hi4;
        byte_offsets_from_planes<K_BITS>(r_planes, lo4, hi4);
        alignas(16) T r_vals[kElemsPerThread];
#pragma unroll
        for (int j = 0; j < kElemsPerThread; ++j) {
            const uint32_t offset = ((j < 4 ? lo4 : hi4) >> (8 * (j % 4))) & 0xFF;
            r_vals[j] = from_float<T>(*reinterpret_cast<const float*>(s_code_bytes + offset) * scale);
        }
        if (vector_store && first + kElemsPerThread <= n) {
            constexpr int kVecs = kElemsPerThread * sizeof(T) / 16;
            const int4* src = reinterpret_cast<const int4*>(r_vals);
            int4* dst = reinterpret_cast<int4*>(out + first);
#pragma unroll
            for (int v = 0; v < kVecs; ++v)
                __stcs(dst + v, src[v]);  // evict-first: the output is written once, keep L2 for the inputs
        } else {
            for (int j = 0; j < kElemsPerThread && first + j < n; ++j)
                out[first + j] = r_vals[j];
        }
    };

    // Persistent grid: the table is loaded once per CTA, not once per few thousand elements.
    // Software pipelined: the next pass's plane words and scale are loaded before this pass is
    // converted, so a thread always has one pass's reads in flight.
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;  // a multiple of 32
    long long group = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    uint32_t r_next[K_BITS];
    ABSMAX_T r_next_abs;
    // even K_BITS: the block's words are 8 (k = 2) or 16 (k = 4) bytes, aligned, one vector load
    const bool vector_load = K_BITS % 2 == 0 && reinterpret_cast<uintptr_t>(packed) % 16 == 0;
    auto load_group = [&](long long grp) {
        const long long blk = grp / kGroupsPerBlock;
        const long long w = blk * K_BITS;
        if constexpr (K_BITS == 4) {
            if (vector_load) {
                const uint4 v = load_planes_v4(packed + w);
                r_next[0] = v.x, r_next[1] = v.y, r_next[2] = v.z, r_next[3] = v.w;
                r_next_abs = absmax[blk];
                return;
            }
        } else if constexpr (K_BITS == 2) {
            if (vector_load) {
                const uint2 v = load_planes_v2(packed + w);
                r_next[0] = v.x, r_next[1] = v.y;
                r_next_abs = absmax[blk];
                return;
            }
        }
#pragma unroll
        for (int b = 0; b < K_BITS; ++b)
            r_next[b] = static_cast<uint32_t>(load_plane(packed + w + b));
        r_next_abs = absmax[blk];
    };
    if (group < num_groups)
        load_group(group);
    for (; group < num_groups; group += stride) {
        const int shift = static_cast<int>(group % kGroupsPerBlock) * kElemsPerThread;
        uint32_t r_planes[K_BITS];  // this thread's byte of each plane, in bits 0..7
#pragma unroll
        for (int b = 0; b < K_BITS; ++b)
            r_planes[b] = r_next[b] >> shift;
        const float scale = AbsmaxCodec<ABSMAX_T>::decode(r_next_abs);
        if (group + stride < num_groups)
            load_group(group + stride);
        convert_store(group, r_planes, scale);
    }
}

// Error-minimizing quantize (the default "mse" rule; scale_search.quantize_blocks_mse is the reference, op for op):
// one warp per block, lane j owns element j. Candidate stored scales around amax / max|level| (E4M4: codes
// -below..+above around the rounded value; fp16 / fp32: target x (1 - j / 64), j = -above..below), each with its
// nearest-level assignment (ties to the lower index) and its squared error over the valid elements, in units of
// 2^exponent(amax); the first least error wins. Then the least-squares scale of that assignment and the stored
// values next to it (E4M4: codes -1..+1) replace it where strictly better. Multiplies and subtracts are rounded
// one by one (no FMA contraction), as the reference's tensor ops are; only the 32-element sums run in another order,
// so a near-tie between two candidates can resolve differently (never to a larger error than the sum's rounding).
template <typename ABSMAX_T> struct MseScale;
template <> struct MseScale<uint8_t> {
    __device__ static uint8_t candidate(float target, int j) {  // j-th code from the code nearest target
        const int c = static_cast<int>(encode_e4m4(fminf(target, decode_e4m4(255)))) + j;
        return static_cast<uint8_t>(c < 1 ? 1 : c > 255 ? 255 : c);
    }
};
template <> struct MseScale<half> {
    __device__ static half candidate(float target, int j) {
        return __float2half_rn(fminf(__fmul_rn(target, 1.0f - static_cast<float>(j) * (1.0f / 64.0f)), 65504.0f));
    }
};
template <> struct MseScale<float> {
    __device__ static float candidate(float target, int j) {
        return fminf(__fmul_rn(target, 1.0f - static_cast<float>(j) * (1.0f / 64.0f)), 3.402823466e38f);
    }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

template <typename T, int K_BITS, typename ABSMAX_T>
__global__ void kQuantizeKbitMse(
    const T* __restrict__ A, const float* __restrict__ codebook, int codebook_len, int32_t* __restrict__ packed,
    ABSMAX_T* __restrict__ absmax, long long n, int below, int above
) {
    constexpr bool kCodes = std::is_same<ABSMAX_T, uint8_t>::value;
    __shared__ float s_code[32], s_mid[32];
    if (threadIdx.x < 32) {
        s_code[threadIdx.x] = threadIdx.x < codebook_len ? codebook[threadIdx.x] : 0.0f;
        s_mid[threadIdx.x] = threadIdx.x + 1 < codebook_len
                                 ? __fmul_rn(__fadd_rn(codebook[threadIdx.x + 1], codebook[threadIdx.x]), 0.5f)
                                 : INFINITY;
    }
    __syncthreads();
    float top = 0.0f;
    for (int c = 0; c < codebook_len; ++c)
        top = fmaxf(top, fabsf(s_code[c]));
    if (!(top > 0.0f))
        top = 1.0f;  // an all-zero codebook: every scale decodes to 0
    const int n_mids = codebook_len - 1;

    const int lane = threadIdx.x % 32;
    const long long num_blocks = (n + kBlockElems - 1) / kBlockElems;
    const long long warps_per_grid = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    for (long long blk = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; blk < num_blocks;
         blk += warps_per_grid) {
        const long long i = blk * kBlockElems + lane;
        const bool valid = i < n;
        const float x = valid ? to_float(A[i]) : 0.0f;
        const float amax = warp_absmax(x);
        int exponent = 0;
        frexpf(amax, &exponent);
        exponent = exponent < -100 ? -100 : exponent > 127 ? 127 : exponent;
        const float unit = ldexpf(1.0f, -exponent);  // errors in units of 2^exponent(amax): exact, no overflow

        // index of the nearest level (count of midpoints below xn), its squared error (unit^2) summed over the warp
        auto assign = [&](float scale, int& idx) {
            const float xn = scale > 0.0f ? __fdiv_rn(x, scale) : 0.0f;
            int lo = 0, hi = n_mids;  // count of s_mid[0..n_mids) < xn; the midpoints are sorted
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (s_mid[mid] < xn)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            idx = lo;
            const float d = __fmul_rn(__fsub_rn(__fmul_rn(s_code[lo], scale), x), unit);
            return warp_sum(valid ? __fmul_rn(d, d) : 0.0f);
        };
        auto stored_at = [&](float target, int j) -> ABSMAX_T {
            if (kCodes && !(amax > 0.0f))
                return ABSMAX_T(0);
            return MseScale<ABSMAX_T>::candidate(target, j);
        };

        const float target = __fdiv_rn(amax, top);
        ABSMAX_T best_stored = stored_at(target, kCodes ? -below : -above);
        int best_idx = 0;
        float best_err = assign(AbsmaxCodec<ABSMAX_T>::decode(best_stored), best_idx);
        const auto consider = [&](ABSMAX_T st) { // keeps the first of equal errors
            int idx;
            const float err = assign(AbsmaxCodec<ABSMAX_T>::decode(st), idx);
            if (err < best_err) {
                best_err = err;
                best_idx = idx;
                best_stored = st;
            }
        };
        // E4M4: codes ascending (lowest scale first); float: j = -above..below, the largest scale first
        for (int j = kCodes ? -below + 1 : -above + 1; j <= (kCodes ? above : below); ++j)
            consider(stored_at(target, j));
        // least-squares scale of the chosen assignment, then the stored values next to it
        const float q = valid ? s_code[best_idx] : 0.0f;
        const float qq = warp_sum(__fmul_rn(q, q));
        float ls = __fdiv_rn(warp_sum(__fmul_rn(x, q)), fmaxf(qq, 1e-30f));
        if (!(ls > 0.0f))
            ls = target;
        for (int j = kCodes ? -1 : 0; j <= (kCodes ? 1 : 0); ++j)
            consider(stored_at(ls, j));
        while (best_idx > 0 && s_code[best_idx - 1] == s_code[best_idx])
            --best_idx;  // a duplicated level is stored as its lowest index (same value and error)

        store_block<K_BITS>(lane, valid, best_idx, blk, packed, absmax, best_stored);
    }
}

template <typename T, int K_BITS, typename ABSMAX_T>
void launch_quantize_kbit(
    unsigned grid, unsigned threads, cudaStream_t stream, const T* A, const float* codebook, int codebook_len,
    int32_t* packed, ABSMAX_T* absmax, long long n
) {
    kQuantizeKbit<T, K_BITS, ABSMAX_T><<<grid, threads, 0, stream>>>(A, codebook, codebook_len, packed, absmax, n);
}

template <typename T, int K_BITS, typename ABSMAX_T>
void launch_quantize_kbit_mse(
    unsigned grid, unsigned threads, cudaStream_t stream, const T* A, const float* codebook, int codebook_len,
    int32_t* packed, ABSMAX_T* absmax, long long n, int below, int above
) {
    kQuantizeKbitMse<T, K_BITS, ABSMAX_T>
        <<<grid, threads, 0, stream>>>(A, codebook, codebook_len, packed, absmax, n, below, above);
}

template <typename T, int K_BITS, typename ABSMAX_T>
void launch_dequantize_kbit(
    unsigned grid, unsigned threads, cudaStream_t stream, const int32_t* packed, const ABSMAX_T* absmax,
    const float* codebook, int codebook_len, T* out, long long n, bool vector_store
) {
    kDequantizeKbit<T, K_BITS, ABSMAX_T>
        <<<grid, threads, 0, stream>>>(packed, absmax, codebook, codebook_len, out, n, vector_store);
}

// Instantiations: every element type x absmax storage x bit width ops.cu dispatches to.
#define KBIT_INSTANTIATE(T, ABSMAX_T, K_BITS)                                                                          \
    template void launch_quantize_kbit<T, K_BITS, ABSMAX_T>(                                                           \
        unsigned, unsigned, cudaStream_t, const T*, const float*, int, int32_t*, ABSMAX_T*, long long                  \
    );                                                                                                                 \
    template void launch_quantize_kbit_mse<T, K_BITS, ABSMAX_T>(                                                       \
        unsigned, unsigned, cudaStream_t, const T*, const float*, int, int32_t*, ABSMAX_T*, long long, int, int        \
    );                                                                                                                 \
    template void launch_dequantize_kbit<T, K_BITS, ABSMAX_T>(                                                         \
        unsigned, unsigned, cudaStream_t, const int32_t*, const ABSMAX_T*, const float*, int, T*, long long, bool      \
    );
#define KBIT_INSTANTIATE_K(T, ABSMAX_T)                                                                                \
    KBIT_INSTANTIATE(T, ABSMAX_T, 2)                                                                                   \
    KBIT_INSTANTIATE(T, ABSMAX_T, 3)                                                                                   \
    KBIT_INSTANTIATE(T, ABSMAX_T, 4)                                                                                   \
    KBIT_INSTANTIATE(T, ABSMAX_T, 5)
#define KBIT_INSTANTIATE_ABSMAX(T)                                                                                     \
    KBIT_INSTANTIATE_K(T, uint8_t)                                                                                     \
    KBIT_INSTANTIATE_K(T, half)                                                                                        \
    KBIT_INSTANTIATE_K(T, float)

KBIT_INSTANTIATE_ABSMAX(half)
KBIT_INSTANTIATE_ABSMAX(__nv_bfloat16)
KBIT_INSTANTIATE_ABSMAX(float)

template <int K_BITS, typename T, bool ABS_U8>
void launch_dequantize_tiled(
    unsigned grid, unsigned threads, cudaStream_t stream, const TiledWeight& w, const TiledRegion& region, T* out
) {
    kbit_dequant_tiled_kernel<K_BITS, T, ABS_U8><<<grid, threads, 0, stream>>>(w, region, out);
}

// Instantiations: the GEMM's compute dtypes x absmax storage (E4M4 / fp16) x bit width.
#define KBIT_INSTANTIATE_TILED(K_BITS)                                                                                 \
    template void launch_dequantize_tiled<K_BITS, half, true>(                                                         \
        unsigned, unsigned, cudaStream_t, const TiledWeight&, const TiledRegion&, half*                                \
    );                                                                                                                 \
    template void launch_dequantize_tiled<K_BITS, half, false>(                                                        \
        unsigned, unsigned, cudaStream_t, const TiledWeight&, const TiledRegion&, half*                                \
    );                                                                                                                 \
    template void launch_dequantize_tiled<K_BITS, __nv_bfloat16, true>(                                                \
        unsigned, unsigned, cudaStream_t, const TiledWeight&, const TiledRegion&, __nv_bfloat16*                       \
    );                                                                                                                 \
    template void launch_dequantize_tiled<K_BITS, __nv_bfloat16, false>(                                               \
        unsigned, unsigned, cudaStream_t, const TiledWeight&, const TiledRegion&, __nv_bfloat16*                       \
    );
KBIT_INSTANTIATE_TILED(2)
KBIT_INSTANTIATE_TILED(3)
KBIT_INSTANTIATE_TILED(4)
KBIT_INSTANTIATE_TILED(5)

}  // namespace kbit
