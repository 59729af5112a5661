// kbit_gemm_wgmma.cuh: the Hopper (sm_90a) kernel of the fused k-bit GEMM for M > 32 (device code
// only; included by kbit_gemm.cu after kbit_gemm.cuh, whose layout, LUT dequant, weight ring and
// split-K it reuses).
//
// ============================================================================================
// DESIGN
// ============================================================================================
// 1. What changes against the shared-A kernel: the MMA. Each warp still streams its own MT units
//    (16 rows x 128 k of the tiled weight) through a private cp.async ring and dequantizes them with
//    the pair/quad LUT into m16n8k16 A-operand fragments. Those fragments are exactly the per-warp
//    slice of the register A operand of wgmma.mma_async.m64nNk16 (PTX ISA 9.7.15.5.1: warp w of the
//    warpgroup holds rows 16w..16w+15 in the m16n8k16 A layout), so a warpgroup's 4 warps multiply
//    their 4 x 16 rows by the token tile in one asynchronous instruction that reads the tokens
//    (B operand, N = TOK) from shared memory. Against mma.sync: (a) the tokens are read once per
//    warpgroup by the tensor core instead of by every warp through registers (the shared-A wide
//    config read the whole A tile per warp per k-step: ~128 KB of the ~224 KB of shared-memory
//    traffic per SM and k-step at M = 64), (b) the multiply runs while the warp dequantizes the next
//    block, (c) one instruction per 64 x 64 x 16 instead of 32 mma.sync.
//
// 2. Tiles (config 6: TOK = 64 tokens, MT = 1 unit per warp, 16 warps = 4 warpgroups, 256 rows):
//          tokens m:  0 ............ 63
//        n   0  +----------------------+  warp 0  (WG 0) : unit n16_base + 0   \
//           16  +----------------------+  warp 1  (WG 0) : unit n16_base + 1    | one wgmma m64n64k16 per
//               |         ...          |                                        | k16 step: D[64 x 64] +=
//           48  +----------------------+  warp 3  (WG 0)                       /  Wdeq[64 x 16] x tok[16 x 64]
//               |         ...          |  warps 4..15 (WG 1..3)
//          256  +----------------------+
//    A wgmma of a warpgroup covers its 4 warps' units: the A rows of a wgmma need not be contiguous in W,
//    each warp's 16 rows are whatever unit it dequantized. The D fragment of a warp is the m16n8k16 C
//    fragment repeated over TOK / 8 token tiles, i.e. acc[MT][MB = TOK / 8][4] of the mma.sync kernels:
//    their split-K reduction and store are reused. 128 registers per thread (512 threads, one CTA per SM).
//
// 3. Token tile in shared memory: per k-step [2 halves: k 0..63, 64..127][TOK rows][128 B], 128-byte
//    swizzle (16-byte chunk c of row r at chunk c ^ (r % 8); atoms 1024-aligned), K-major, one
//    descriptor per k16 step (start + 32 B within the row, SBO = 1024). The tiled weight permutes k
//    inside each 32-block (kbit_gemm.cuh section 3: slot 2t+e of k16 step s holds real k 8t+4s+e, slot
//    2t+8+e holds 8t+4s+2+e), so the token rows are stored permuted the same way: a thread loads one
//    (token, block) = 4 x 16 bytes (real k 8t..8t+7, t = 0..3) into registers and stores chunk (s, h) =
//    word 2s+h of each of the 4: a 4 x 4 transpose of 32-bit words, register renaming only. The loads
//    of step i+2 are issued during step i and stored after the barrier of step i+1, into a 3-slot ring.
//
// 4. Synchronisation per k-step i: cp.async.wait (this warp's weights of step i), fence.proxy.async
//    (this thread's token stores of step i are seen by wgmma's async proxy), __syncthreads; refill
//    the weight ring and store the tokens of step i+1 into slot (i+1) % 3, which held step i-2; then per
//    block: wgmma.wait_group 3 (the group of the same block one k-step ago no longer reads its fragment
//    registers; by block 3 all of step i-1 is done, so slot (i+2) % 3 is free after the next barrier),
//    scale MT x 2 fragments, wgmma.fence, MT x 2 wgmmas, commit. Three groups stay in flight. The LUT
//    reads of block b+1 are issued before block b is scaled (software pipeline of one block).
//
// 5. Grid: one CTA per SM (161-177 KB of shared memory), tile = blockIdx.x with the m tile fastest (the m tiles of one
//    weight tile run together and share it through L2), blockIdx.y = k split (the same split-K
//    heuristics and workspace slots as the other configs, M <= 256).
//
// 6. Built only for sm_90a (wgmma); the dispatcher offers these configs only when the library holds
//    sm_90a code (KBIT_WGMMA_BUILT) and the device is compute capability 9.0. Elsewhere the kernel body
//    traps instead of returning garbage.
//
// 7. Why (H100, 28672 x 8192, k = 4, us; dev/probe_paths.py, dev/build_variant.sh):
//    - against the wide mma.sync config (same 256 x 64 tile): M=64 121.2 vs 127.0, M=128 251.0 vs 268.1,
//      M=256 509.7 vs 531.1 (cuBLAS fp16 169-217); k = 2 4-10% faster; k = 5 within +-3%, left on mma.sync.
//    - 2 warpgroups with MT = 2 (256 x 64): 134.6 at M=64; 128 x 128 tiles (TOK = 128, MT = 1, 2 warpgroups):
//      240.6 at M=64, 324.8 at M=128 (vs 255.0 here): not kept.
//    - leave-one-out (KBIT_PROBE_WGMMA_NO_DEQUANT: weight words as fragments, no LUT reads;
//      KBIT_PROBE_WGMMA_NO_MMA: no wgmma), M=64: full 122.3, without dequant 98.8, without wgmma 84.2; M=128:
//      255.0 / 199.0 / 150.6. Without the dequant the loop still runs one k-step per ~1.8 us per SM for
//      4.2 MFLOP: ~1/3 of the tensor peak, and the same for 64- and 128-token tiles, so the dequant is not
//      the only cost; every k-step is bounded by per-step latency (one barrier, three groups in flight),
//      which a deeper multi-k-step pipeline (or a producer warpgroup) would have to remove.
// ============================================================================================
#pragma once

#include "kbit_gemm.cuh"

namespace kbit {

template <int K_BITS_, int TOK_, int MT_, int WARPS_, bool ABS_U8_>
struct KbitWgmmaConfig : KbitGemmConfig<K_BITS_, TOK_ / 8, MT_, WARPS_, 1, ABS_U8_, true> {
    using Base = KbitGemmConfig<K_BITS_, TOK_ / 8, MT_, WARPS_, 1, ABS_U8_, true>;
    static_assert(WARPS_ == 8 || WARPS_ == 16, "2 or 4 warpgroups");
    static constexpr int TOK = TOK_; // tokens per CTA tile = wgmma N
    static_assert(TOK == 64 || TOK == 128, "wgmma m64n64k16 or m64n128k16");
    static constexpr int A_HALF_BYTES = TOK * 128;  // k 0..63 (or 64..127) of one k-step: TOK swizzled rows
    static constexpr int A_STAGE_BYTES = 2 * A_HALF_BYTES;
    static constexpr int A_STAGES = 3;              // step i read by wgmma, i+1 stored, i-1's last groups may run
    static constexpr int W_STAGE_BYTES = 4 * (Base::STAGE_W_WORDS + Base::STAGE_ABS_WORDS); // per warp
    static constexpr int FIXED_BYTES = 1024 /* alignment slack */ + A_STAGES * A_STAGE_BYTES + 4 * Base::LUT_WORDS;
    static constexpr int BUDGET_BYTES = 226 * 1024;
    static constexpr int W_STAGES_FIT = (BUDGET_BYTES - FIXED_BYTES) / (Base::WARPS * W_STAGE_BYTES);
    static constexpr int W_STAGES = W_STAGES_FIT > 4 ? 4 : W_STAGES_FIT;
    static_assert(W_STAGES >= 2, "the weight ring needs >= 2 stages");
    static constexpr int SMEM_BYTES = FIXED_BYTES + W_STAGES * Base::WARPS * W_STAGE_BYTES;
    static constexpr int A_PIECES_ALL = TOK * UNIT_BLOCKS;          // (token, block) pieces of a k-step
    static constexpr int A_PIECES = (A_PIECES_ALL + Base::THREADS - 1) / Base::THREADS; // per thread
    static_assert(A_PIECES_ALL % Base::THREADS == 0 || A_PIECES == 1, "token pieces spread evenly");
};

// ---------------------------------------------------------------------------------------------
// PTX helpers (sm_90a)
// ---------------------------------------------------------------------------------------------
// generic-proxy shared writes made visible to the async proxy (wgmma operands); PTX ISA 9.7.12.4
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// PTX ISA 9.7.15.6-8
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128B-swizzled region (1024-aligned)
__device__ __forceinline__ uint32_t swizzle128(int row, int chunk) {
    return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}
// shared-memory matrix descriptor, K-major, 128-byte swizzle (PTX ISA 9.7.15.5.1): start >> 4 in
// bits 0-13, leading byte offset 1 (unused when swizzled K-major), stride byte offset 1024 >> 4 (8
// rows x 128 B) in bits 32-45, swizzle mode 1 (128 B) in bits 62-63
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t s_addr) {
    return (uint64_t)((s_addr & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

// D[64 x TOK] += A[64 x 16] (registers: this warp's m16n8k16 A fragment) x B[16 x TOK] (shared, K-major)
#define KBIT_ACC8(i)                                                                                                 \
    "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),   \
        "+f"(d[i + 7])
#define KBIT_WGMMA_RS_N64(PTX_TYPE)                                                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " "                             \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "  \
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
                 : KBIT_ACC8(0), KBIT_ACC8(8), KBIT_ACC8(16), KBIT_ACC8(24)                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#define KBIT_WGMMA_RS_N128(PTX_TYPE)                                                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " "                            \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "  \
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "   \
                 "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "    \
                 "%59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                             \
                 : KBIT_ACC8(0), KBIT_ACC8(8), KBIT_ACC8(16), KBIT_ACC8(24), KBIT_ACC8(32), KBIT_ACC8(40),           \
                   KBIT_ACC8(48), KBIT_ACC8(56)                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
template <typename T, int TOK> struct WgmmaRS;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA_BODY(x) x
#else
#define KBIT_WGMMA_BODY(x) __trap()
#endif
#define KBIT_WGMMA_RS_SPEC(T, PTX_TYPE, TOK)                                                                         \
    template <> struct WgmmaRS<T, TOK> {                                                                             \
        static __device__ __forceinline__ void run(float (&d)[TOK / 2], const uint32_t (&a)[4], uint64_t desc_b) {   \
            KBIT_WGMMA_BODY(KBIT_WGMMA_RS_N##TOK(PTX_TYPE));                                                         \
        }                                                                                                            \
    };
KBIT_WGMMA_RS_SPEC(__half, "f16", 64)
KBIT_WGMMA_RS_SPEC(__half, "f16", 128)
KBIT_WGMMA_RS_SPEC(__nv_bfloat16, "bf16", 64)
KBIT_WGMMA_RS_SPEC(__nv_bfloat16, "bf16", 128)
#undef KBIT_WGMMA_RS_SPEC
#undef KBIT_WGMMA_BODY
#undef KBIT_WGMMA_RS_N64
#undef KBIT_WGMMA_RS_N128
#undef KBIT_ACC8

// ---------------------------------------------------------------------------------------------
// Token tile: global -> registers (one k-step ahead) -> permuted, swizzled shared stage
// ---------------------------------------------------------------------------------------------
// piece j of this thread: block blk = idx / TOK, token row = idx % TOK (consecutive threads take
// consecutive rows, so the 8 rows of a store phase hit 8 different swizzled chunks)
template <class Cfg>
__device__ __forceinline__ void load_tokens(uint4 (&r_tok)[Cfg::A_PIECES][4], const KbitGemmParams& p, int m_base,
                                            int kstep) {
    const unsigned short* g_A = reinterpret_cast<const unsigned short*>(p.A);
#pragma unroll
    for (int j = 0; j < Cfg::A_PIECES; j++) {
        const int idx = threadIdx.x + j * Cfg::THREADS;
        if (Cfg::A_PIECES_ALL < Cfg::THREADS && idx >= Cfg::A_PIECES_ALL) break;
        const int blk = idx / Cfg::TOK, row = idx % Cfg::TOK;
        const int m = m_base + row, k = kstep * UNIT_K + blk * BLOCK_ELEMS;
        const bool ok = m < p.M && k < p.K_dim; // K_dim % 32 == 0: a block is all in or all out
        const unsigned short* src = g_A + (long long)(ok ? m : 0) * p.lda + (ok ? k : 0);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            uint4 v = make_uint4(0, 0, 0, 0);
            if (ok) v = p.a_vec_ok ? __ldg(reinterpret_cast<const uint4*>(src + 8 * c)) : ldg_a_unaligned(src + 8 * c);
            r_tok[j][c] = v;
        }
    }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// chunk (s, h) of a block = word 2s + h of its 4 real-k chunks t = 0..3 (section 3)
template <class Cfg>
__device__ __forceinline__ void store_tokens(uint32_t s_stage, const uint4 (&r_tok)[Cfg::A_PIECES][4]) {
#pragma unroll
    for (int j = 0; j < Cfg::A_PIECES; j++) {
        const int idx = threadIdx.x + j * Cfg::THREADS;
        if (Cfg::A_PIECES_ALL < Cfg::THREADS && idx >= Cfg::A_PIECES_ALL) break;
        const int blk = idx / Cfg::TOK, row = idx % Cfg::TOK;
        const uint32_t s_half = s_stage + (blk / 2) * Cfg::A_HALF_BYTES;
#pragma unroll
        for (int w = 0; w < 4; w++) // w = 2s + h
            sts128(s_half + swizzle128(row, (blk % 2) * 4 + w),
                   make_uint4(word_of(r_tok[j][0], w), word_of(r_tok[j][1], w), word_of(r_tok[j][2], w),
                              word_of(r_tok[j][3], w)));
    }
}

// ---------------------------------------------------------------------------------------------
// One k-step, software-pipelined by one block: the LUT reads of block b+1 are issued before block b
// is scaled and multiplied, so their shared-memory latency hides behind block b's work (with two or
// four warps per scheduler there are too few other warps to hide it)
// ---------------------------------------------------------------------------------------------
template <class Cfg> struct WgmmaStep {
    uint32_t r_w[Cfg::MT][Cfg::Fmt::LANE_WORDS];
    uint32_t r_abs[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4];
    uint32_t raw[2][Cfg::MT][2][4]; // unscaled LUT values of blocks b (parity b % 2)
};

template <class Cfg, int BLK>
__device__ __forceinline__ void lookup_block(WgmmaStep<Cfg>& st, uint32_t s_lut, uint32_t lane_off) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        lookup_frag_a<Cfg, 2 * BLK>(st.raw[BLK % 2][mt][0], st.r_w[mt], s_lut, lane_off);
        lookup_frag_a<Cfg, 2 * BLK + 1>(st.raw[BLK % 2][mt][1], st.r_w[mt], s_lut, lane_off);
    }
}

template <class Cfg, typename T, int BLK>
__device__ __forceinline__ void block_wgmma(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t (&frag)[UNIT_BLOCKS][Cfg::MT][2][4],
                                            WgmmaStep<Cfg>& st, uint32_t s_tok, uint32_t s_lut, uint32_t lane_off) {
#ifndef KBIT_PROBE_WGMMA_NO_DEQUANT
    if constexpr (BLK + 1 < UNIT_BLOCKS) lookup_block<Cfg, BLK + 1>(st, s_lut, lane_off);
#endif
    wgmma_wait<3>(); // the group that last read frag[BLK] (same block, previous k-step) is done
#ifdef KBIT_PROBE_WGMMA_NO_DEQUANT // timing probe only: the weight words as fragments, no LUT reads
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int s = 0; s < 2; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) st.raw[BLK % 2][mt][s][j] = st.r_w[mt][(4 * s + j + BLK) % Cfg::Fmt::LANE_WORDS];
#endif
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        const uint32_t sc_g = scale_pair<Cfg, T>(st.r_abs[mt], BLK), sc_g8 = scale_pair<Cfg, T>(st.r_abs[mt], 4 + BLK);
#pragma unroll
        for (int s = 0; s < 2; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) // register j: row g (j even) or g + 8 (j odd)
                frag[BLK][mt][s][j] = Pack2<T>::mul(st.raw[BLK % 2][mt][s][j], (j & 1) ? sc_g8 : sc_g);
    }
    wgmma_fence();
#ifdef KBIT_PROBE_WGMMA_NO_MMA // timing probe only: dequantize, keep the fragments alive, skip the wgmmas
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int s = 0; s < 2; s++)
            asm volatile("" ::"r"(frag[BLK][mt][s][0]), "r"(frag[BLK][mt][s][1]), "r"(frag[BLK][mt][s][2]),
                         "r"(frag[BLK][mt][s][3]));
    if (false)
#endif
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int s = 0; s < 2; s++) // k16 step u = 2 BLK + s: bytes 32 u .. 32 u + 31 of the permuted row
            WgmmaRS<T, Cfg::TOK>::run(reinterpret_cast<float(&)[Cfg::TOK / 2]>(acc[mt]), frag[BLK][mt][s],
                                      smem_desc_sw128(s_tok + (BLK / 2) * Cfg::A_HALF_BYTES + ((BLK % 2) * 2 + s) * 32));
    wgmma_commit();
}

template <class Cfg, typename T>
__device__ __forceinline__ void compute_stage_wgmma(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t (&frag)[UNIT_BLOCKS][Cfg::MT][2][4],
                                                    uint32_t s_w, uint32_t s_tok, uint32_t s_lut, uint32_t lane_off,
                                                    int lane) {
    WgmmaStep<Cfg> st;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) read_unit_from_stage<Cfg>(st.r_w[mt], st.r_abs[mt], s_w, mt, lane);
    lookup_block<Cfg, 0>(st, s_lut, lane_off);
    block_wgmma<Cfg, T, 0>(acc, frag, st, s_tok, s_lut, lane_off);
    block_wgmma<Cfg, T, 1>(acc, frag, st, s_tok, s_lut, lane_off);
    block_wgmma<Cfg, T, 2>(acc, frag, st, s_tok, s_lut, lane_off);
    block_wgmma<Cfg, T, 3>(acc, frag, st, s_tok, s_lut, lane_off);
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::THREADS, 1) kbit_gemm_wgmma_kernel(const KbitGemmParams p) {
    extern __shared__ __align__(16) uint8_t s_raw[];
    __shared__ int s_flag;
    const uint32_t s_raw_addr = (uint32_t)__cvta_generic_to_shared(s_raw);
    const uint32_t s_tok_ring = (s_raw_addr + 1023u) & ~1023u;               // [A_STAGES][2][TOK][128 B]
    const uint32_t s_lut = s_tok_ring + Cfg::A_STAGES * Cfg::A_STAGE_BYTES; // [LUT_ENTRIES][LUT_COPIES]
    uint32_t* s_lut_ptr = reinterpret_cast<uint32_t*>(s_raw + (s_lut - s_raw_addr));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t s_w_ring = s_lut + 4 * Cfg::LUT_WORDS + warp * Cfg::W_STAGES * Cfg::W_STAGE_BYTES; // this warp's

    const int m_tiles = (p.M + Cfg::TOK - 1) / Cfg::TOK;
    const int tile = blockIdx.x; // m tile fastest
    const int m_base = (tile % m_tiles) * Cfg::TOK;
    const int n16_base = ((tile / m_tiles) * Cfg::WARPS_N + warp) * Cfg::MT;
    const int k_begin = blockIdx.y * p.ks_per_split;
    const int n_steps = max(min(k_begin + p.ks_per_split, p.k_steps) - k_begin, 0);
    const uint32_t lane_off = (uint32_t)(lane % Cfg::LUT_COPIES) * Cfg::LUT_ENTRY_BYTES;
    constexpr int WS = Cfg::W_STAGES, AS = Cfg::A_STAGES;

    float acc[Cfg::MT][Cfg::MB][4];
    zero_acc<Cfg>(acc);
    uint32_t frag[UNIT_BLOCKS][Cfg::MT][2][4];

    StreamCursor<Cfg> cur;
    cur.init(p, n16_base, m_base, k_begin, lane);
    for (int st = 0; st < WS - 1; st++) { // WS - 1 k-steps of weights in flight
        if (st < n_steps) {
            load_stage_async<Cfg>(s_w_ring + st * Cfg::W_STAGE_BYTES, cur, lane);
            cur.advance();
        }
        cp_async_commit();
    }
    uint4 r_tok[Cfg::A_PIECES][4];
    if (n_steps > 0) {
        load_tokens<Cfg>(r_tok, p, m_base, k_begin);
        store_tokens<Cfg>(s_tok_ring, r_tok);
        if (n_steps > 1) load_tokens<Cfg>(r_tok, p, m_base, k_begin + 1);
    }
    build_lut<Cfg, T>(s_lut_ptr, p);

    for (int i = 0; i < n_steps; i++) {
        cp_async_wait<WS - 2>();    // this lane's weights of step i landed
        fence_proxy_async_shared(); // this thread's token stores of step i are visible to wgmma
        __syncthreads();            // ... everyone's; the LUT; every warp is past step i-1's block 3 wait
        if (i + WS - 1 < n_steps) {
            load_stage_async<Cfg>(s_w_ring + ((i + WS - 1) % WS) * Cfg::W_STAGE_BYTES, cur, lane);
            cur.advance();
        }
        cp_async_commit();
        if (i + 1 < n_steps) { // slot (i+1) % 3 held step i-2, whose wgmmas all retired before the barrier
            store_tokens<Cfg>(s_tok_ring + ((i + 1) % AS) * Cfg::A_STAGE_BYTES, r_tok);
            if (i + 2 < n_steps) load_tokens<Cfg>(r_tok, p, m_base, k_begin + i + 2);
        }
        compute_stage_wgmma<Cfg, T>(acc, frag, s_w_ring + (i % WS) * Cfg::W_STAGE_BYTES,
                                    s_tok_ring + (i % AS) * Cfg::A_STAGE_BYTES, s_lut, lane_off, lane);
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    if (p.k_splits > 1) {
        __syncthreads();
        if (!reduce_split_k<Cfg>(acc, p, tile, warp, true, lane, &s_flag)) return;
    }
    store_output<Cfg, T>(acc, p, n16_base * UNIT_ROWS, m_base, lane);
}

} // namespace kbit
