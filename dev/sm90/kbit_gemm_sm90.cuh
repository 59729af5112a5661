// kbit_gemm_sm90.cuh: the large-M k-bit GEMM for Hopper (sm_90a): dequantize to shared memory,
// multiply with wgmma. Device code only; included by kbit_gemm.cu.
//
// ============================================================================================
// DESIGN
// ============================================================================================
// 1. What is computed: C[M, N] = A[M, K_dim] @ Wdeq[N, K_dim]^T (+ bias), A/C fp16 or bf16, fp32
//    accumulation, W in the tiled k-bit layout of kbit_gemm.cuh (units of 16 rows x 128 k).
//    Used for large M, where the product is bound by the tensor cores: cuBLAS runs at ~900
//    TFLOP/s there on an H200 (M = 1024, 14336 x 4096), which the mma.sync path cannot reach.
//
// 2. Tiles. CTA tile C[BM = 128 tokens, BN = 128 rows n], k-step BK = 128 (= one unit column).
//    3 warpgroups, warp-specialised:
//      WG0  producer   : dequantizes the 8 units (128 n x 128 k) of a k-step into s_B (fp16/bf16)
//      WG1  consumer 0 : tokens  0..63 of the tile: cp.async A rows -> s_A, wgmma m64n128k16 x 8
//      WG2  consumer 1 : tokens 64..127, the same
//          n:  0                      128
//        m  0  +-----------------------+   s_A[c]: [64 tok][128 k] per consumer, K-major, 128B swizzle
//              |  WG1: 64 x 128 acc     |   s_B   : [128 n][128 k], K-major, 128B swizzle, shared
//          64  +-----------------------+
//              |  WG2: 64 x 128 acc     |   wgmma A = tokens (s_A), B = weights (s_B): both K-major
//         128  +-----------------------+   D fragment = mma.sync C layout repeated over 16 n8 blocks
//
// 3. Dequant (producer lane (g, t) of warp w, units 2w and 2w+1 of the k-step): the tiled layout
//    gives a lane exactly rows g and g+8 x k 8t..8t+7 of each of the 4 blocks, as 32 pairs; a
//    pair's LUT index (2 K_BITS bits: lo field | hi field) reads a half2 {cb[i0], cb[i1]} from a
//    shared pair table, HMUL2 by the block scale (E4M4 decoded through a 256-entry table), and 4
//    pairs = 8 consecutive k = one 16-byte swizzled store to s_B. ~2.5 instructions per weight,
//    ~1/3 of one scheduler's issue slots at the tensor-core rate.
//
// 4. Pipeline. s_B is a ring of 2 stages between the producer and both consumers, synchronised
//    with named barriers (FULL[s]: producer arrives, consumers sync; EMPTY[s]: consumers arrive,
//    producer syncs; 384 threads each). Each consumer keeps its own 3-stage ring of A rows
//    (cp.async, issued 2 k-steps ahead; a per-warpgroup named barrier publishes them). Writers
//    fence.proxy.async before the barrier, since wgmma reads shared memory through the async proxy.
//    The producer loads the next k-step's weight words into registers while it dequantizes this one.
//
// 5. Work: a persistent grid of min(tiles, SMs) CTAs walks tiles tile = blockIdx.x + i * gridDim.x,
//    m fastest (the m-tiles of one n-tile run together, so a weight tile is read from DRAM once and
//    from L2 after). The rings run on across tiles, so the next tile's first k-steps are dequantized
//    while the consumers store the previous tile. No split-K: large M has enough tiles.
//
// 6. Invariants: A 16-byte aligned with lda % 8 == 0 (checked by the dispatcher); N padded to 16
//    and K_dim to 128 by the tiled layout (zero absmax); A beyond K_dim or M is zero-filled, units
//    beyond the padded N are written as zeros; smem tiles 1024-byte aligned (128B swizzle atoms).
//
// 7. Why: measured numbers in the benchmark (benchmarking/bench_kbit_gemm.py) and the issue notes.
// ============================================================================================
#pragma once

#include "kbit_tiled_unit.cuh"

namespace kbit {
namespace sm90 {

// Tile configuration (choices first, derived values after, each invariant asserted).
template <int BN_> struct Sm90Config {
    static constexpr int BN = BN_;                            // rows n per CTA tile
    static constexpr int BM = 128;                            // tokens per CTA tile: 2 consumer warpgroups x 64
    static constexpr int BK = 64;                             // k per stage: half a unit column (2 blocks)
    static constexpr int STAGES = 4;                          // depth of both the A and the B rings
    static constexpr int THREADS = 384;                       // producer WG + 2 consumer WGs
    static constexpr int A_ROWS = BM / 2;                     // rows per consumer
    static constexpr int UNITS = BN / UNIT_ROWS;              // units per k-step column of the tile
    static constexpr int UNITS_PER_WARP = UNITS / 4;          // 4 producer warps
    static constexpr int A_STAGE_BYTES = A_ROWS * BK * 2;     // per consumer: one 128-byte swizzle atom
    static constexpr int B_STAGE_BYTES = BN * BK * 2;
    static constexpr int LUT_BYTES = (1 << 10) * 4;           // 2^(2*5) half2, the largest K_BITS
    static constexpr int SCALE_LUT_BYTES = 256 * 4;           // E4M4 code -> half2 {s, s}
    static constexpr int SMEM_BYTES =
        1024 /* 1024-byte alignment of the swizzle atoms */ + STAGES * (2 * A_STAGE_BYTES + B_STAGE_BYTES) + LUT_BYTES + SCALE_LUT_BYTES;
    static constexpr int BAR_FULL0 = 1;                       // named barriers (0 is __syncthreads)
    static constexpr int BAR_EMPTY0 = BAR_FULL0 + STAGES;
    static constexpr int BAR_A0 = BAR_EMPTY0 + STAGES;        // + consumer
    static_assert(BN == 128 || BN == 256, "wgmma n128 or n256");
    static_assert(BK * 2 == 128, "a stage row is exactly one 128-byte swizzle row");
    static_assert(UNIT_K == 2 * BK, "a unit column feeds exactly two stages");
    static_assert(UNITS % 4 == 0, "4 producer warps share the units evenly");
    static_assert(BAR_A0 + 2 <= 16, "16 hardware named barriers per CTA");
    static_assert(SMEM_BYTES <= 227 * 1024, "fits the sm_90 shared-memory limit");
};

struct Sm90Params {  // DEV: TiledWeight fields first, so load_unit can take it
    const void* A;
    const uint32_t* B;
    const void* B_absmax;
    const float* codebook;
    int codebook_len;
    const void* bias;
    void* C;
    int M, N, K_dim, lda;
    int k_steps, n16_tiles, m_tiles, n_tiles;
    int dev_mode;  // DEV bits: 1 = producer skips dequant, 2 = consumers skip wgmma, 4 = no proxy fences, 8 = consumers skip A loads
};

__device__ __forceinline__ void bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// PTX ISA 9.7.12.4 (membar/fence): generic-proxy shared-memory writes made visible to the async proxy (wgmma)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128B-swizzled K-major atom
__device__ __forceinline__ uint32_t swizzle128(int row, int chunk) {
    return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// PTX ISA 9.7.15.5.1: wgmma shared-memory matrix descriptor, K-major, 128-byte swizzle:
// start >> 4 in bits 0-13, leading byte offset (unused for swizzled K-major) = 1, stride byte
// offset = 1024 (8 rows x 128 B) >> 4 in bits 32-45, swizzle mode 1 (128B) in bits 62-63.
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_addr) {
    return (static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4)) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// PTX ISA 9.7.15.5: wgmma.mma_async m64nNk16, fp32 accumulators, A and B from shared memory (both K-major)
#define KBIT_ACC8(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define KBIT_REGS8(i) "%" #i ", "
#define KBIT_WGMMA_N128(TYPE)                                                                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                                    \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                             \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                   \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                  \
                 "%64, %65, p, 1, 1, 0, 0;\n}\n"                                                                     \
                 : KBIT_ACC8(0), KBIT_ACC8(8), KBIT_ACC8(16), KBIT_ACC8(24), KBIT_ACC8(32), KBIT_ACC8(40),             \
                   KBIT_ACC8(48), KBIT_ACC8(56)                                                                        \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define KBIT_WGMMA_N256(TYPE)                                                                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                         \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                    \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                             \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                   \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                   \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                    \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                   \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                    \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "        \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "   \
                 "%128, %129, p, 1, 1, 0, 0;\n}\n"                                                                   \
                 : KBIT_ACC8(0), KBIT_ACC8(8), KBIT_ACC8(16), KBIT_ACC8(24), KBIT_ACC8(32), KBIT_ACC8(40),             \
                   KBIT_ACC8(48), KBIT_ACC8(56), KBIT_ACC8(64), KBIT_ACC8(72), KBIT_ACC8(80), KBIT_ACC8(88),           \
                   KBIT_ACC8(96), KBIT_ACC8(104), KBIT_ACC8(112), KBIT_ACC8(120)                                       \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename T, int BN> struct Wgmma;
#define KBIT_WGMMA_SPEC(CT, TYPE, BN_)                                                                                 \
    template <> struct Wgmma<CT, BN_> {                                                                                \
        static __device__ __forceinline__ void run(float (&d)[BN_ / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
            KBIT_WGMMA_IF_SM90(KBIT_WGMMA_N##BN_(TYPE));                                                               \
        }                                                                                                              \
    };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA_IF_SM90(x) x
#else
#define KBIT_WGMMA_IF_SM90(x)
#endif
KBIT_WGMMA_SPEC(__half, "f16", 128)
KBIT_WGMMA_SPEC(__half, "f16", 256)
KBIT_WGMMA_SPEC(__nv_bfloat16, "bf16", 128)
KBIT_WGMMA_SPEC(__nv_bfloat16, "bf16", 256)
#undef KBIT_WGMMA_SPEC
#undef KBIT_WGMMA_IF_SM90
#undef KBIT_WGMMA_N128
#undef KBIT_WGMMA_N256
#undef KBIT_REGS8
#undef KBIT_ACC8

// Dequantize blocks 2*HALF_COL, 2*HALF_COL+1 (k 64*HALF_COL .. +63) of one unit held in registers
// into rows [16*unit_in_tile, +16) of a B stage (one 128-byte swizzle atom per row).
template <int K_BITS, bool ABS_U8, typename T, int HALF_COL>
__device__ __forceinline__ void dequant_unit_to_smem(const UnitRegs<K_BITS, ABS_U8>& r, uint8_t* s_b_stage, int unit_in_tile,
                                                     const uint32_t* s_lut, const uint32_t* s_scale_lut, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int bb = 0; bb < 2; bb++) {
        const int blk = 2 * HALF_COL + bb;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const uint32_t scale = scale_of<T, ABS_U8>(r.abs, half * UNIT_BLOCKS + blk, s_scale_lut);
            uint32_t v[4];
#pragma unroll
            for (int pr = 0; pr < 4; pr++) v[pr] = Pack2<T>::mul(s_lut[pair_lut_index<K_BITS, ABS_U8>(r, blk, half, pr)], scale);
            const int row = unit_in_tile * UNIT_ROWS + g + 8 * half;  // row of the B tile
            const int chunk = bb * 4 + t;                              // 8 consecutive k: (32 bb + 8t) / 8
            *reinterpret_cast<uint4*>(s_b_stage + swizzle128(row, chunk)) = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

// cp.async one consumer's 64 rows x 64 k of A for a stage (zero-filled beyond M / K_dim)
template <class Cfg, typename T>
__device__ __forceinline__ void load_a_stage(uint8_t* s_a_stage, const Sm90Params& p, int m_base, int k_base, int tid_in_wg) {
    const T* g_a = static_cast<const T*>(p.A);
#pragma unroll
    for (int i = 0; i < (Cfg::A_ROWS * Cfg::BK / 8) / 128; i++) {
        const int idx = i * 128 + tid_in_wg;
        const int row = idx / (Cfg::BK / 8), c = idx % (Cfg::BK / 8);
        const int m = m_base + row;
        const int k = k_base + c * 8;
        const bool valid = m < p.M && k < p.K_dim;
        const T* src = valid ? g_a + static_cast<long long>(m) * p.lda + k : g_a;
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(s_a_stage + swizzle128(row, c)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
    }
}

template <class Cfg, typename T>
__device__ __forceinline__ void store_tile(const float (&acc)[Cfg::BN / 2], const Sm90Params& p, int m0, int n_base, int t) {
    // acc[4 j8 + {0,1}] = (row m0, n = n_base + 8 j8 + 2t + {0,1}); acc[4 j8 + {2,3}] = (row m0 + 8, same n)
    T* g_c = static_cast<T*>(p.C);
    const T* g_bias = static_cast<const T*>(p.bias);
#pragma unroll
    for (int j8 = 0; j8 < Cfg::BN / 8; j8++) {
        const int n = n_base + 8 * j8 + 2 * t;
        float b0 = 0.0f, b1 = 0.0f;
        if (g_bias != nullptr) {
            if (n < p.N) b0 = Pack2<T>::to_float(g_bias[n]);
            if (n + 1 < p.N) b1 = Pack2<T>::to_float(g_bias[n + 1]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = m0 + 8 * h;
            if (m >= p.M) continue;
            const float v0 = acc[4 * j8 + 2 * h] + b0, v1 = acc[4 * j8 + 2 * h + 1] + b1;
            T* dst = g_c + static_cast<long long>(m) * p.N + n;
            if (n + 1 < p.N && (p.N % 2) == 0) {
                *reinterpret_cast<uint32_t*>(dst) = Pack2<T>::from_floats(v0, v1);
            } else {
                if (n < p.N) dst[0] = Pack2<T>::from_float(v0);
                if (n + 1 < p.N) dst[1] = Pack2<T>::from_float(v1);
            }
        }
    }
}

template <int K_BITS, typename T, bool ABS_U8, class Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, 1) kbit_gemm_sm90_kernel(const Sm90Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* s_a = smem;                                              // [STAGES][2 consumers][A_STAGE_BYTES]
    uint8_t* s_b = s_a + Cfg::STAGES * 2 * Cfg::A_STAGE_BYTES;        // [STAGES][B_STAGE_BYTES]
    uint32_t* s_lut = reinterpret_cast<uint32_t*>(s_b + Cfg::STAGES * Cfg::B_STAGE_BYTES);  // [2^(2K)] {cb[i0], cb[i1]}
    uint32_t* s_scale_lut = s_lut + Cfg::LUT_BYTES / 4;                                     // [256] E4M4 -> {s, s}

    using F = TiledFormat<K_BITS>;
    for (int e = threadIdx.x; e < F::LUT_ENTRIES; e += Cfg::THREADS) {
        int i0, i1;
        lut_index_to_pair<K_BITS>(e, i0, i1);
        const float c0 = i0 < p.codebook_len ? p.codebook[i0] : 0.0f;
        const float c1 = i1 < p.codebook_len ? p.codebook[i1] : 0.0f;
        s_lut[e] = Pack2<T>::from_floats(c0, c1);
    }
    for (int c = threadIdx.x; c < 256; c += Cfg::THREADS) {
        const float s = decode_e4m4(static_cast<uint8_t>(c));
        s_scale_lut[c] = Pack2<T>::from_floats(s, s);
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    const int tid_in_wg = threadIdx.x % 128;
    const int lane = threadIdx.x % 32;
    const int num_tiles = p.m_tiles * p.n_tiles;
    const int my_tiles = static_cast<int>(blockIdx.x) < num_tiles ? (num_tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int stages_per_tile = 2 * p.k_steps;
    const int total = my_tiles * stages_per_tile;  // stages this CTA walks, across its tiles

    if (wg == 0) {
        // ---------------- producer: weights -> s_B
        // A unit column feeds two stages; two register buffers alternate by k-step, so the
        // words of k-step i + 2 load while i + 1 is dequantized (two stages of cover).
        const int warp = tid_in_wg / 32;
        const int total_ksteps = my_tiles * p.k_steps;
        UnitRegs<K_BITS, ABS_U8> buf0[Cfg::UNITS_PER_WARP], buf1[Cfg::UNITS_PER_WARP];
        auto load_kstep = [&](UnitRegs<K_BITS, ABS_U8>(&r)[Cfg::UNITS_PER_WARP], int i) {
            if (i >= total_ksteps || (p.dev_mode & 1)) return;
            const int tile = blockIdx.x + (i / p.k_steps) * gridDim.x;
            const int n_tile = tile / p.m_tiles;
#pragma unroll
            for (int u = 0; u < Cfg::UNITS_PER_WARP; u++)
                load_unit<K_BITS, ABS_U8>(r[u], p, n_tile * Cfg::UNITS + Cfg::UNITS_PER_WARP * warp + u, i % p.k_steps, lane);
        };
        auto produce = [&](const UnitRegs<K_BITS, ABS_U8>(&r)[Cfg::UNITS_PER_WARP], int i) {
#pragma unroll
            for (int hc = 0; hc < 2; hc++) {
                const int j = 2 * i + hc;  // stage
                const int slot = j % Cfg::STAGES;
                if (j >= Cfg::STAGES) bar_sync(Cfg::BAR_EMPTY0 + slot, Cfg::THREADS);
                uint8_t* s_b_stage = s_b + slot * Cfg::B_STAGE_BYTES;
                if (!(p.dev_mode & 1)) {
#pragma unroll
                    for (int u = 0; u < Cfg::UNITS_PER_WARP; u++) {
                        if (hc == 0)
                            dequant_unit_to_smem<K_BITS, ABS_U8, T, 0>(r[u], s_b_stage, Cfg::UNITS_PER_WARP * warp + u, s_lut, s_scale_lut, lane);
                        else
                            dequant_unit_to_smem<K_BITS, ABS_U8, T, 1>(r[u], s_b_stage, Cfg::UNITS_PER_WARP * warp + u, s_lut, s_scale_lut, lane);
                    }
                }
                if (!(p.dev_mode & 4)) fence_proxy_async();
                bar_arrive(Cfg::BAR_FULL0 + slot, Cfg::THREADS);
            }
        };
        load_kstep(buf0, 0);
        load_kstep(buf1, 1);
        for (int i = 0; i < total_ksteps; i += 2) {
            produce(buf0, i);
            load_kstep(buf0, i + 2);
            if (i + 1 < total_ksteps) {
                produce(buf1, i + 1);
                load_kstep(buf1, i + 3);
            }
        }
        for (int j = total > Cfg::STAGES ? total - Cfg::STAGES : 0; j < total; j++)
            bar_sync(Cfg::BAR_EMPTY0 + j % Cfg::STAGES, Cfg::THREADS);
    } else {
        // ---------------- consumers: A -> s_A (own rows), wgmma, epilogue
        const int c = wg - 1;
        const int warp_in_wg = tid_in_wg / 32;
        const int g = lane / 4, t = lane % 4;
        auto a_slot = [&](int j) { return s_a + ((j % Cfg::STAGES) * 2 + c) * Cfg::A_STAGE_BYTES; };
        auto issue_a = [&](int j) {
            if (j < total && !(p.dev_mode & 8)) {
                const int tile = blockIdx.x + (j / stages_per_tile) * gridDim.x;
                const int m_tile = tile % p.m_tiles;
                load_a_stage<Cfg, T>(a_slot(j), p, m_tile * Cfg::BM + c * Cfg::A_ROWS, (j % stages_per_tile) * Cfg::BK, tid_in_wg);
            }
            asm volatile("cp.async.commit_group;\n" ::: "memory");
        };
        issue_a(0);
        issue_a(1);
        float acc[Cfg::BN / 2];
#pragma unroll
        for (int i = 0; i < Cfg::BN / 2; i++) acc[i] = 0.0f;
        int unreleased = -1;  // the stage whose wgmmas may still read s_B (released one stage later)
        for (int j = 0; j < total; j++) {
            issue_a(j + 2);  // its slot held stage j - 2, finished by the wgmma wait in stage j - 1
            asm volatile("cp.async.wait_group 2;\n" ::: "memory");
            if (!(p.dev_mode & 4)) fence_proxy_async();
            bar_sync(Cfg::BAR_A0 + c, 128);
            const int slot = j % Cfg::STAGES;
            bar_sync(Cfg::BAR_FULL0 + slot, Cfg::THREADS);
            const int kst = j % stages_per_tile;
            const uint32_t a_base = static_cast<uint32_t>(__cvta_generic_to_shared(a_slot(j)));
            const uint32_t b_base = static_cast<uint32_t>(__cvta_generic_to_shared(s_b + slot * Cfg::B_STAGE_BYTES));
            wgmma_fence();
            if (!(p.dev_mode & 2)) {
#pragma unroll
                for (int kk = 0; kk < Cfg::BK / 16; kk++)  // k16 steps: +32 bytes inside the swizzle row
                    Wgmma<T, Cfg::BN>::run(acc, smem_desc(a_base + kk * 32), smem_desc(b_base + kk * 32), (kst > 0 || kk > 0) ? 1 : 0);
            }
            wgmma_commit();
            wgmma_wait<1>();  // stage j - 1 is done: release its s_B slot
            if (unreleased >= 0) bar_arrive(Cfg::BAR_EMPTY0 + unreleased % Cfg::STAGES, Cfg::THREADS);
            unreleased = j;
            if (kst == stages_per_tile - 1) {
                wgmma_wait<0>();
                bar_arrive(Cfg::BAR_EMPTY0 + slot, Cfg::THREADS);
                unreleased = -1;
                const int tile = blockIdx.x + (j / stages_per_tile) * gridDim.x;
                const int m0 = (tile % p.m_tiles) * Cfg::BM + c * Cfg::A_ROWS + warp_in_wg * 16 + g;
                store_tile<Cfg, T>(acc, p, m0, (tile / p.m_tiles) * Cfg::BN, t);
            }
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
#endif
}

}  // namespace sm90
}  // namespace kbit

namespace kbit {

}  // namespace kbit
