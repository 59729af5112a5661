// CPU kernels of bitsandbytes-kbit over the flat k-bit format: block i of 32
// weights is k int32 bit-plane words at packed[i k .. i k + k) (word b holds bit b of the 32 indices,
// element j in bit j) and one scale absmax[i] (uint8 E4M4, float16 or float32).
//
// kbit_cpu_gemm: y[m, n] = sum_c x[m, c] W[n, c] (+ bias[n]) for a few rows of x (decode), reading the
// packed weight directly; no float copy of W is made. kbit_cpu_dequantize: blocks of W to float32 or
// bfloat16, as the default backend computes them (bit for bit).
//
// Arithmetic of kbit_cpu_gemm, the same in every ISA path so that all give identical results: per
// row n and input row m, 16 float accumulators a[l]; per block with scale s, codebook values w[0..32)
// and inputs x[0..32) (0 past in_features):
//     t = x[2l] * w[2l];  t = fma(x[2l + 1], w[2l + 1], t);  a[l] = fma(t, s, a[l])      (l = 0..15)
// then the lanes are summed as a tree (l + 8, l + 4, l + 2, l + 1), bias added, and the float32 sum
// cast to the output dtype (round to nearest even). The inputs are first copied to float32 with each
// block's even elements before its odd ones (xp[32 j + l] = x[32 j + 2 l], xp[32 j + 16 + l] =
// x[32 j + 2 l + 1]): AVX-512 then builds the 32 indices of a block as 16-bit lanes, one masked add
// per bit-plane (the plane word is the lane mask), and looks up the even and odd elements from the
// low and high halves of each 32-bit lane.
//
// ISA paths: 0 portable C++, 1 AVX2 + FMA, 2 AVX-512 (F, BW, VL, DQ); picked at run time by
// kbit_cpu_best_isa() and passed in by the caller. Threads: OpenMP (in a torch process it is torch's
// own libgomp and thread pool), as many as the caller asks for.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int kBlock = 32;

enum DType : int { F32 = 0, BF16 = 1 };
enum AbsmaxType : int { E4M4 = 0, F16 = 1, ABS_F32 = 2 };

struct E4M4Table {
    float v[256];
    E4M4Table() {
        for (int c = 0; c < 256; ++c) {
            int e = c >> 4, m = c & 15;
            v[c] = e == 0 ? float(m) * std::ldexp(1.0f, -14) : std::ldexp(1.0f + float(m) / 16.0f, e - 11);
        }
    }
};
const E4M4Table kE4M4;

inline float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal half: normalize
        int e = -1;
        do {
            man <<= 1;
            ++e;
        } while (!(man & 1024));
        bits = sign | (uint32_t(112 - e) << 23) | ((man & 1023) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite values, as torch)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7FFFu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float load_scale(const void* absmax, int type, int64_t i) {
    switch (type) {
        case E4M4: return kE4M4.v[static_cast<const uint8_t*>(absmax)[i]];
        case F16: return half_to_float(static_cast<const uint16_t*>(absmax)[i]);
        default: return static_cast<const float*>(absmax)[i];
    }
}

inline float load_x(const void* x, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline void store_y(void* y, int dtype, int64_t i, float v) {
    if (dtype == BF16)
        static_cast<uint16_t*>(y)[i] = float_to_bf16(v);
    else
        static_cast<float*>(y)[i] = v;
}

struct GemmArgs {
    const void* x;
    int64_t x_stride;
    int x_dtype;
    int64_t M;
    const int32_t* packed;
    const void* absmax;
    int absmax_type;
    float cb[32];  // the codebook, zero-padded to 32 entries
    int k;
    int64_t K;      // in_features: inputs at columns >= K count as 0
    int64_t K_pad;  // a multiple of 32
    const void* bias;
    int bias_dtype;
    void* y;
    int64_t y_stride;
    int y_dtype;
};

inline float tree_sum16(const float* a) {
    float r8[8], r4[4], r2[2];
    for (int l = 0; l < 8; ++l) r8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; ++l) r4[l] = r8[l] + r8[l + 4];
    for (int l = 0; l < 2; ++l) r2[l] = r4[l] + r4[l + 2];
    return r2[0] + r2[1];
}

inline void finish(const GemmArgs& g, int64_t m, int64_t n, float sum) {
    if (g.bias) sum += load_x(g.bias, g.bias_dtype, n);
    store_y(g.y, g.y_dtype, m * g.y_stride + n, sum);
}

// ---------------------------------------------------------------- portable path

void gemm_rows_portable(const GemmArgs& g, int64_t n0, int64_t n1) {
    const int64_t kb = g.K_pad / kBlock;
    const float* xp = static_cast<const float*>(g.x);
    float w[kBlock], acc[16];
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t m = 0; m < g.M; ++m) {
            for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
            for (int64_t j = 0; j < kb; ++j) {
                const int64_t blk = n * kb + j;
                const uint32_t* words = reinterpret_cast<const uint32_t*>(g.packed) + blk * g.k;
                for (int e = 0; e < kBlock; ++e) {
                    int idx = 0;
                    for (int b = 0; b < g.k; ++b) idx |= int((words[b] >> e) & 1u) << b;
                    w[e] = g.cb[idx];
                }
                const float* xb = xp + m * g.x_stride + j * kBlock;
                const float s = load_scale(g.absmax, g.absmax_type, blk);
                for (int l = 0; l < 16; ++l) {
                    float t = xb[l] * w[2 * l];
                    t = std::fma(xb[16 + l], w[2 * l + 1], t);
                    acc[l] = std::fma(t, s, acc[l]);
                }
            }
            finish(g, m, n, tree_sum16(acc));
        }
    }
}

void dequant_blocks_portable(const int32_t* packed, const void* absmax, int absmax_type, const float* cb, int k,
                             int64_t b0, int64_t b1, void* out, int out_dtype) {
    for (int64_t blk = b0; blk < b1; ++blk) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(packed) + blk * k;
        const float s = load_scale(absmax, absmax_type, blk);
        for (int e = 0; e < kBlock; ++e) {
            int idx = 0;
            for (int b = 0; b < k; ++b) idx |= int((words[b] >> e) & 1u) << b;
            store_y(out, out_dtype, blk * kBlock + e, cb[idx] * s);
        }
    }
}

#if defined(__x86_64__)

// ---------------------------------------------------------------- AVX2 + FMA path

__attribute__((target("avx2,fma"))) inline __m256i indices8(const uint32_t* words, int k, int first) {
    // indices of elements first, first + 2, ..., first + 14: lane l tests bit first + 2 l of each plane word
    const __m256i lane_bit = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i want = _mm256_slli_epi32(lane_bit, first);  // first <= 17: bit 31 at most
    __m256i idx = _mm256_setzero_si256();
    for (int b = 0; b < k; ++b) {
        const __m256i w = _mm256_set1_epi32(int(words[b]));
        const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(w, want), want);
        idx = _mm256_or_si256(idx, _mm256_and_si256(on, _mm256_set1_epi32(1 << b)));
    }
    return idx;
}

__attribute__((target("avx2,fma"))) void gemm_rows_avx2(const GemmArgs& g, int64_t n0, int64_t n1) {
    const int64_t kb = g.K_pad / kBlock;
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t m = 0; m < g.M; ++m) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t j = 0; j < kb; ++j) {
                const int64_t blk = n * kb + j;
                const uint32_t* words = reinterpret_cast<const uint32_t*>(g.packed) + blk * g.k;
                // even elements 0..14 and 16..30, odd elements 1..15 and 17..31
                const __m256 we0 = _mm256_i32gather_ps(g.cb, indices8(words, g.k, 0), 4);
                const __m256 we1 = _mm256_i32gather_ps(g.cb, indices8(words, g.k, 16), 4);
                const __m256 wo0 = _mm256_i32gather_ps(g.cb, indices8(words, g.k, 1), 4);
                const __m256 wo1 = _mm256_i32gather_ps(g.cb, indices8(words, g.k, 17), 4);
                const float* xb = static_cast<const float*>(g.x) + m * g.x_stride + j * kBlock;
                const __m256 s = _mm256_set1_ps(load_scale(g.absmax, g.absmax_type, blk));
                __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(xb), we0);
                __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), we1);
                t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), wo0, t0);
                t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), wo1, t1);
                a0 = _mm256_fmadd_ps(t0, s, a0);
                a1 = _mm256_fmadd_ps(t1, s, a1);
            }
            alignas(32) float acc[16];
            _mm256_store_ps(acc, a0);
            _mm256_store_ps(acc + 8, a1);
            finish(g, m, n, tree_sum16(acc));
        }
    }
}

// ---------------------------------------------------------------- AVX-512 path

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// Indices of the block's 32 elements, 16 per vector: lane l of plane b's contribution is bit l of the
// (half) word, moved to bit b by one variable shift, and or-ed in with one ternary-logic op.
AVX512_TARGET inline void indices16(const uint32_t* words, int k, __m512i& lo, __m512i& hi) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    lo = _mm512_setzero_si512();
    hi = _mm512_setzero_si512();
    for (int b = 0; b < k; ++b) {
        const __m512i bit = _mm512_set1_epi32(1 << b);
        const __m512i w_lo = _mm512_set1_epi32(int((words[b] & 0xFFFFu) << b));
        const __m512i w_hi = _mm512_set1_epi32(int((words[b] >> 16) << b));
        // idx | (shifted & bit): ternary-logic table 0xF8 over (idx, shifted, bit)
        lo = _mm512_ternarylogic_epi32(lo, _mm512_srlv_epi32(w_lo, lanes), bit, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, _mm512_srlv_epi32(w_hi, lanes), bit, 0xF8);
    }
}

// The 32 indices of a block as 16-bit lanes (element e in lane e): plane word b is the mask of the
// lanes that get 1 << b.
template <int K>
AVX512_TARGET inline __m512i indices32x16(const uint32_t* words) {
    __m512i idx = _mm512_setzero_si512();
    for (int b = 0; b < K; ++b) idx = _mm512_mask_add_epi16(idx, __mmask32(words[b]), idx, _mm512_set1_epi16(1 << b));
    return idx;
}

// Codebook lookup by the low 4 (vpermps) or 5 (vpermt2ps) bits of each 32-bit lane.
template <int K>
AVX512_TARGET inline __m512 lookup(__m512i idx, __m512 cb_lo, __m512 cb_hi) {
    if constexpr (K == 5)
        return _mm512_permutex2var_ps(cb_lo, idx, cb_hi);
    else
        return _mm512_permutexvar_ps(idx, cb_lo);
}

template <int K, int A, int MT>
AVX512_TARGET void gemm_tile_avx512(const GemmArgs& g, int64_t n, int64_t m0) {
    // rows m0 .. m0 + MT of x against weight row n: each block is unpacked once for MT inputs
    const int64_t kb = g.K_pad / kBlock;
    const __m512 cb_lo = _mm512_loadu_ps(g.cb), cb_hi = _mm512_loadu_ps(g.cb + 16);
    __m512 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    const uint32_t* words = reinterpret_cast<const uint32_t*>(g.packed) + n * kb * K;
    const float* x0 = static_cast<const float*>(g.x) + m0 * g.x_stride;
    for (int64_t j = 0; j < kb; ++j, words += K) {
        const __m512i idx = indices32x16<K>(words);
        const __m512 w_even = lookup<K>(idx, cb_lo, cb_hi);
        const __m512 w_odd = lookup<K>(_mm512_srli_epi32(idx, 16), cb_lo, cb_hi);
        const __m512 s = _mm512_set1_ps(load_scale(g.absmax, A, n * kb + j));
        for (int i = 0; i < MT; ++i) {
            const float* xb = x0 + i * g.x_stride + j * kBlock;
            const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w_odd, _mm512_mul_ps(_mm512_loadu_ps(xb), w_even));
            acc[i] = _mm512_fmadd_ps(t, s, acc[i]);
        }
    }
    for (int i = 0; i < MT; ++i) {
        alignas(64) float a[16];
        _mm512_store_ps(a, acc[i]);
        finish(g, m0 + i, n, tree_sum16(a));
    }
}

template <int K, int A>
AVX512_TARGET void gemm_rows_avx512_t(const GemmArgs& g, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        int64_t m = 0;
        for (; m + 4 <= g.M; m += 4) gemm_tile_avx512<K, A, 4>(g, n, m);
        switch (g.M - m) {
            case 3: gemm_tile_avx512<K, A, 3>(g, n, m); break;
            case 2: gemm_tile_avx512<K, A, 2>(g, n, m); break;
            case 1: gemm_tile_avx512<K, A, 1>(g, n, m); break;
            default: break;
        }
    }
}

template <int K>
void gemm_rows_avx512_k(const GemmArgs& g, int64_t n0, int64_t n1) {
    switch (g.absmax_type) {
        case E4M4: gemm_rows_avx512_t<K, E4M4>(g, n0, n1); break;
        case F16: gemm_rows_avx512_t<K, F16>(g, n0, n1); break;
        default: gemm_rows_avx512_t<K, ABS_F32>(g, n0, n1); break;
    }
}

void gemm_rows_avx512(const GemmArgs& g, int64_t n0, int64_t n1) {
    switch (g.k) {
        case 2: gemm_rows_avx512_k<2>(g, n0, n1); break;
        case 3: gemm_rows_avx512_k<3>(g, n0, n1); break;
        case 4: gemm_rows_avx512_k<4>(g, n0, n1); break;
        default: gemm_rows_avx512_k<5>(g, n0, n1); break;
    }
}

AVX512_TARGET void dequant_blocks_avx512(const int32_t* packed, const void* absmax, int absmax_type, const float* cb,
                                       int k, int64_t b0, int64_t b1, void* out, int out_dtype) {
    const __m512 cb_lo = _mm512_loadu_ps(cb), cb_hi = _mm512_loadu_ps(cb + 16);
    for (int64_t blk = b0; blk < b1; ++blk) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(packed) + blk * k;
        __m512i i_lo, i_hi;
        indices16(words, k, i_lo, i_hi);
        const __m512 s = _mm512_set1_ps(load_scale(absmax, absmax_type, blk));
        const __m512 v_lo = _mm512_mul_ps(_mm512_permutex2var_ps(cb_lo, i_lo, cb_hi), s);
        const __m512 v_hi = _mm512_mul_ps(_mm512_permutex2var_ps(cb_lo, i_hi, cb_hi), s);
        if (out_dtype == BF16) {
            // round to nearest even: u + 0x7FFF + ((u >> 16) & 1), then the high half (finite values)
            const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
            __m512i u_lo = _mm512_castps_si512(v_lo), u_hi = _mm512_castps_si512(v_hi);
            u_lo = _mm512_add_epi32(u_lo, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u_lo, 16), one)));
            u_hi = _mm512_add_epi32(u_hi, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u_hi, 16), one)));
            uint16_t* o = static_cast<uint16_t*>(out) + blk * kBlock;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u_lo, 16)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(u_hi, 16)));
        } else {
            float* o = static_cast<float*>(out) + blk * kBlock;
            _mm512_storeu_ps(o, v_lo);
            _mm512_storeu_ps(o + 16, v_hi);
        }
    }
}

#endif  // __x86_64__

template <typename F>
void parallel_ranges(int64_t count, int64_t grain, int nthreads, F&& body) {
    // Split [0, count) into one contiguous range per thread (at least `grain` items each).
    int64_t parts = nthreads < 1 ? 1 : nthreads;
    if (grain > 0 && count / grain < parts) parts = count / grain > 0 ? count / grain : 1;
#ifdef _OPENMP
    if (parts > 1) {
#pragma omp parallel for num_threads(int(parts)) schedule(static, 1)
        for (int64_t p = 0; p < parts; ++p) body(count * p / parts, count * (p + 1) / parts);
        return;
    }
#endif
    body(int64_t(0), count);
}

}  // namespace

extern "C" {

// 0 portable, 1 AVX2 + FMA, 2 AVX-512 (F, BW, VL, DQ): the best path this CPU runs.
int kbit_cpu_best_isa() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

int kbit_cpu_has_openmp() {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

// y[m, n] = sum_c x[m, c] W[n, c] (+ bias[n]) for W [N, K_pad] in the flat k-bit format. x: M rows of
// x_stride elements (float32 or bfloat16, x_dtype 0 / 1), read up to column K; bias: N values of x's
// dtype or null; y: M rows of y_stride elements of y_dtype. absmax_type: 0 E4M4 (uint8), 1 float16,
// 2 float32. codebook: cb_n (<= 2^k) float32 levels. Returns 0, or -1 for arguments out of range.
int kbit_cpu_gemm(const void* x, int64_t x_stride, int x_dtype, int64_t M, const int32_t* packed, const void* absmax,
                  int absmax_type, const float* codebook, int64_t cb_n, int k, int64_t N, int64_t K, int64_t K_pad,
                  const void* bias, void* y, int64_t y_stride, int y_dtype, int nthreads, int isa) {
    if (k < 2 || k > 5 || cb_n < 1 || cb_n > (int64_t(1) << k) || K_pad % kBlock || K > K_pad || M < 0 || N < 0)
        return -1;
    GemmArgs g{x, x_stride, x_dtype, M, packed, absmax, absmax_type, {}, k, K, K_pad, bias, x_dtype, y, y_stride, y_dtype};
    for (int64_t i = 0; i < cb_n; ++i) g.cb[i] = codebook[i];
    // The inner loops read float32 rows of K_pad values, each block's even elements first (see the top of
    // this file): converted once here (M K_pad values, small next to the weight), not once per weight row.
    thread_local std::vector<float> xp;
    xp.assign(size_t(M * K_pad), 0.0f);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < K; ++c)
            xp[size_t(m * K_pad + (c & ~int64_t(31)) + ((c & 1) << 4) + ((c & 31) >> 1))] =
                load_x(x, x_dtype, m * x_stride + c);
    g.x = xp.data();
    g.x_stride = K_pad;
    g.x_dtype = F32;
    g.K = K_pad;
    (void)isa;  // only the x86-64 build has other paths
    void (*rows)(const GemmArgs&, int64_t, int64_t) = gemm_rows_portable;
#if defined(__x86_64__)
    if (isa >= 2)
        rows = gemm_rows_avx512;
    else if (isa == 1)
        rows = gemm_rows_avx2;
#endif
    // about 4k weights per work item keeps the per-thread share well above the fork/join cost
    const int64_t grain = (4096 + K_pad * (M > 0 ? M : 1) - 1) / (K_pad * (M > 0 ? M : 1)) + 1;
    parallel_ranges(N, grain, nthreads, [&](int64_t n0, int64_t n1) { rows(g, n0, n1); });
    return 0;
}

// Blocks [b0, b1) of the flat format to out (32 values per block, from out's element 0): float32
// (out_dtype 0) or bfloat16 (1), value = float32(codebook[index] * scale) cast to out_dtype.
int kbit_cpu_dequantize(const int32_t* packed, const void* absmax, int absmax_type, const float* codebook, int64_t cb_n,
                        int k, int64_t b0, int64_t b1, void* out, int out_dtype, int nthreads, int isa) {
    if (k < 2 || k > 5 || cb_n < 1 || cb_n > (int64_t(1) << k) || b0 < 0 || b1 < b0) return -1;
    float cb[32] = {};
    for (int64_t i = 0; i < cb_n; ++i) cb[i] = codebook[i];
    (void)isa;
    const int64_t absmax_bytes = absmax_type == E4M4 ? 1 : absmax_type == F16 ? 2 : 4;
    auto body = [&](int64_t s, int64_t e) {
        // blocks b0 + s .. b0 + e, written from out's element 32 s
        const int32_t* p = packed + (b0 + s) * k;
        const void* a = static_cast<const char*>(absmax) + (b0 + s) * absmax_bytes;
        void* o = static_cast<char*>(out) + s * kBlock * (out_dtype == BF16 ? 2 : 4);
#if defined(__x86_64__)
        if (isa >= 2) {
            dequant_blocks_avx512(p, a, absmax_type, cb, k, 0, e - s, o, out_dtype);
            return;
        }
#endif
        dequant_blocks_portable(p, a, absmax_type, cb, k, 0, e - s, o, out_dtype);
    };
    parallel_ranges(b1 - b0, 256, nthreads, body);
    return 0;
}

}  // extern "C"
