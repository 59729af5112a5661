// kbit_gemm_wgmma.cuh: the Hopper (sm_90a) kernel of the fused k-bit GEMM for M > 32 (device code
// only; included by kbit_gemm.cu after kbit_gemm.cuh, whose layout, LUT dequant, weight ring and
// split-K it reuses).
//
// ============================================================================================
// DESIGN
// ============================================================================================
// 1. What changes against the shared-A kernel: the MMA. Each warp still streams its own MT units through a private
//    cp.async ring and dequantizes them with the pair/quad LUT into m16n8k16 A-operand fragments. Those fragments
//    are exactly the per-warp slice of the register A operand of wgmma.mma_async.m64nNk16 (warp w of the warpgroup
//    holds rows 16w..16w+15 in the m16n8k16 A layout), so a warpgroup's 4 warps multiply their 4 x 16 rows by the
//    token tile in one asynchronous instruction that reads the tokens (B operand, N = TOK) from shared memory: the
//    tokens are read once per warpgroup by the tensor core instead of by every warp, the multiply runs while the
//    warp dequantizes the next block, and one instruction covers 64 x 64 x 16.
//
// 2. Tiles (config 6: TOK = 64 tokens, MT = 1 unit per warp, 16 warps = 4 warpgroups, 256 rows). The A rows of a
//    wgmma need not be contiguous in W: each warp's 16 rows are whatever unit it dequantized. A warp's D fragment is
//    the m16n8k16 C fragment repeated over TOK / 8 token tiles, i.e. acc[MT][MB = TOK / 8][4] of the mma.sync
//    kernels, whose split-K reduction and store are reused. 128 registers per thread, one CTA per SM.
//
// 3. Token tile in shared memory: per k-step [2 halves: k 0..63, 64..127][TOK rows][128 B], 128-byte swizzle
//    (16-byte chunk c of row r at chunk c ^ (r % 8); atoms 1024-aligned), K-major, one descriptor per k16 step
//    (start + 32 B within the row, SBO = 1024). The tiled weight holds each lane's pairs at the k its fragment slots
//    stand for, so token rows keep their own k order and travel by 16-byte cp.async straight into the ring,
//    W_STAGES - 1 k-steps ahead in the same commit groups as the weights. The ring has W_STAGES + 1 slots: the
//    wgmmas of step i-1 may still read theirs while step i + W_STAGES - 1 lands.
//
// 4. Synchronisation per k-step i: cp.async.wait (this thread's weights and tokens of step i), fence.proxy.async
//    (its token words are seen by wgmma's async proxy), __syncthreads; copy step i + W_STAGES - 1; then per block:
//    wgmma.wait_group 3 (the group of the same block one k-step ago no longer reads its fragment registers; by
//    block 3 all of step i-1 is done, so its token slot is free after the next barrier), scale MT x 2 fragments,
//    wgmma.fence, MT x 2 wgmmas, commit. Three groups stay in flight; the LUT reads of block b+1 are issued before
//    block b is scaled (a software pipeline of one block, FRAG_SLOTS = 4 fragment slots).
//
// 5. Grid: one CTA per SM, tile = blockIdx.x with the m tile fastest (the m tiles of one weight tile run together
//    and share it through L2), blockIdx.y = k split (wgmma_splits in kbit_gemm.cu: waves of split tiles, any M).
//
// 6. Built only for sm_90a (wgmma); the dispatcher offers config 6 only when the library holds sm_90a code
//    (KBIT_WGMMA_BUILT) and the device is compute capability 9.0. Elsewhere the kernel body traps.
//
// 7. Split-K through a thread-block cluster (cluster_reduce_store, p.cluster_reduce): instead of the last CTA
//    reading every split's partial from the workspace alone, a cluster of the k_splits CTAs (dims (1, k_splits, 1))
//    parks each partial in its own shared memory ([token][row] fp32, row stride rows + 4: conflict-free stores);
//    after a cluster barrier every rank sums a k_splits-th of the tile over all ranks through DSMEM in rank order
//    (the same bits as the workspace path) and stores it; a second barrier keeps the parks alive. The launcher
//    takes it where all clusters are resident at once (cudaOccupancyMaxActiveClusters) and each CTA runs at most
//    32 k-steps; it may drop to fewer splits (down to half) only where the CTAs then run at most 8.
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
    static constexpr int W_STAGE_BYTES = 4 * (Base::STAGE_W_WORDS + Base::STAGE_ABS_WORDS); // per warp
    // W_STAGES k-steps of weights (per warp) and of tokens share the commit groups; the token ring has one
    // slot more, because step i-1's wgmmas may still read theirs while step i + W_STAGES - 1 is copied
    static constexpr int FIXED_BYTES = 1024 /* alignment slack */ + A_STAGE_BYTES + 4 * Base::LUT_WORDS;
    static constexpr int BUDGET_BYTES = 226 * 1024;
    static constexpr int W_STAGES_FIT = (BUDGET_BYTES - FIXED_BYTES) / (Base::WARPS * W_STAGE_BYTES + A_STAGE_BYTES);
    static constexpr int W_STAGES = W_STAGES_FIT > 4 ? 4 : W_STAGES_FIT;
    static_assert(W_STAGES >= 2, "the ring needs >= 2 stages");
    static constexpr int A_STAGES = W_STAGES + 1;
    static constexpr int SMEM_BYTES = FIXED_BYTES + W_STAGES * (Base::WARPS * W_STAGE_BYTES + A_STAGE_BYTES);
    static constexpr int TOK_ROW_STEP = Base::THREADS / 16; // token rows one pass of the CTA copies (16 chunks each)
    static_assert(TOK % TOK_ROW_STEP == 0 && TOK_ROW_STEP % 8 == 0, "a thread's token rows share one swizzle phase");
    static constexpr int LOOKAHEAD = 1;   // 1 or 2 blocks
    static constexpr int RAW_SLOTS = LOOKAHEAD + 1;
    static constexpr int FRAG_SLOTS = 4; // 2 or 4
    static_assert((LOOKAHEAD == 1 || LOOKAHEAD == 2) && (FRAG_SLOTS == 2 || FRAG_SLOTS == 4), "pipeline knobs");
    // the cluster split-K park (cluster_reduce_store): [TOK][rows + 4] fp32 over the ring, after the k-loop
    static constexpr int PARK_STRIDE = Base::WARPS_N * MT_ * UNIT_ROWS + 4;
    static_assert(TOK * PARK_STRIDE * 4 <= SMEM_BYTES - 1024, "the cluster park fits in the ring");
};

// ---------------------------------------------------------------------------------------------
// PTX helpers (sm_90a). The kernel is instantiated for every architecture of the build (one dispatch
// table) but launched only on compute capability 9.0 from sm_90a code: elsewhere these compile to nothing.
// ---------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define KBIT_SM90A_ASM(...) ((void)0)
#endif
// generic-proxy shared writes made visible to the async proxy (wgmma operands); PTX ISA 9.7.12.4
__device__ __forceinline__ void fence_proxy_async_shared() {
    KBIT_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// PTX ISA 9.7.15.6-8
__device__ __forceinline__ void wgmma_fence() { KBIT_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { KBIT_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    KBIT_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
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
// Token tile: global -> swizzled shared stage, 16-byte cp.async (section 3). Thread x copies chunk c = x % 16 (k 8c ..
// 8c + 7 of the k-step) of token rows x / 16 + j * TOK_ROW_STEP: 16 consecutive threads read a row's 256 bytes, and
// the 8 chunks of a 128-byte row half that a quarter warp writes land in distinct banks (the swizzle).
// ---------------------------------------------------------------------------------------------

// Per-thread token read position, advanced by one k-step per call. 32-bit byte offsets into A (the
// launcher keeps A below 4 GiB on this path); rows past M and blocks past K_dim are zero-filled.
template <class Cfg> struct TokenCursor {
    uint32_t off;      // bytes from A to (token m_base + x / 16, k = kstep * 128 + 8 (x % 16))
    uint32_t row_step; // bytes between the rows of one thread: TOK_ROW_STEP rows of A
    uint32_t rows_ok;  // bit j: row j of this thread is < M
    int k_blk;         // first k of this thread's block at the current k-step
    uint32_t s_off;    // this thread's chunk in a token stage (row x / 16, half c / 8, swizzled chunk c % 8)

    __device__ __forceinline__ void init(const KbitGemmParams& p, int m_base, int kstep) {
        const int c = threadIdx.x % 16, row0 = threadIdx.x / 16;
        off = ((uint32_t)(m_base + row0) * (uint32_t)p.lda + (uint32_t)(kstep * UNIT_K + 8 * c)) * 2u;
        row_step = (uint32_t)(Cfg::TOK_ROW_STEP * p.lda) * 2u;
        rows_ok = 0;
#pragma unroll
        for (int j = 0; j < Cfg::TOK / Cfg::TOK_ROW_STEP; j++)
            rows_ok |= (m_base + row0 + j * Cfg::TOK_ROW_STEP < p.M ? 1u : 0u) << j;
        k_blk = kstep * UNIT_K + (c / 4) * BLOCK_ELEMS;
        s_off = (c / 8) * Cfg::A_HALF_BYTES + swizzle128(row0, c % 8);
    }
    __device__ __forceinline__ void advance() {
        off += UNIT_K * 2;
        k_blk += UNIT_K;
    }
};

// the rows of one thread share a swizzle phase (TOK_ROW_STEP % 8 == 0): row j is j * TOK_ROW_STEP * 128 further
template <class Cfg, bool VEC_OK>
__device__ __forceinline__ void copy_tokens(uint32_t s_stage, const TokenCursor<Cfg>& cur, const KbitGemmParams& p) {
    const char* g_A = reinterpret_cast<const char*>(p.A);
    const bool k_ok = cur.k_blk < p.K_dim; // K_dim % 32 == 0: a block is all in or all out
#pragma unroll
    for (int j = 0; j < Cfg::TOK / Cfg::TOK_ROW_STEP; j++) {
        const bool ok = k_ok && ((cur.rows_ok >> j) & 1u);
        const char* src = g_A + (ok ? cur.off + j * cur.row_step : 0u);
        const uint32_t dst = s_stage + cur.s_off + j * Cfg::TOK_ROW_STEP * 128;
        if constexpr (VEC_OK) {
            cp_async_16_zfill(dst, src, ok ? 16u : 0u);
        } else { // A or lda not 16-byte aligned: synchronous 2-byte loads (the slot is free all the same)
            sts128(dst, ok ? ldg_a_unaligned(reinterpret_cast<const unsigned short*>(src)) : make_uint4(0, 0, 0, 0));
        }
    }
}

template <class Cfg>
__device__ __forceinline__ void copy_tokens_async(uint32_t s_stage, TokenCursor<Cfg>& cur, const KbitGemmParams& p) {
    if (p.a_vec_ok) copy_tokens<Cfg, true>(s_stage, cur, p);
    else copy_tokens<Cfg, false>(s_stage, cur, p);
    cur.advance();
}

// ---------------------------------------------------------------------------------------------
// One k-step, software-pipelined by one block: the LUT reads of block b+1 are issued before block b
// is scaled and multiplied, so their shared-memory latency hides behind block b's work (with two or
// four warps per scheduler there are too few other warps to hide it)
// ---------------------------------------------------------------------------------------------
template <class Cfg> struct WgmmaStep {
    uint32_t r_w[Cfg::MT][Cfg::Fmt::LANE_WORDS];
    uint32_t r_abs[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4];
    uint32_t raw[Cfg::RAW_SLOTS][Cfg::MT][2][4]; // unscaled LUT values of block b in slot b % RAW_SLOTS
};

template <class Cfg, int BLK>
__device__ __forceinline__ void lookup_block(WgmmaStep<Cfg>& st, uint32_t s_lut, uint32_t lane_off) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        lookup_frag_a<Cfg, 2 * BLK>(st.raw[BLK % Cfg::RAW_SLOTS][mt][0], st.r_w[mt], s_lut, lane_off);
        lookup_frag_a<Cfg, 2 * BLK + 1>(st.raw[BLK % Cfg::RAW_SLOTS][mt][1], st.r_w[mt], s_lut, lane_off);
    }
}

template <class Cfg, typename T, int BLK>
__device__ __forceinline__ void block_wgmma(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t (&frag)[Cfg::FRAG_SLOTS][Cfg::MT][2][4],
                                            WgmmaStep<Cfg>& st, uint32_t s_tok, uint32_t s_lut, uint32_t lane_off) {
    if constexpr (BLK + Cfg::LOOKAHEAD < UNIT_BLOCKS) lookup_block<Cfg, BLK + Cfg::LOOKAHEAD>(st, s_lut, lane_off);
    wgmma_wait<Cfg::FRAG_SLOTS - 1>(); // the group that last read frag slot BLK % FRAG_SLOTS is done
    constexpr int F = BLK % Cfg::FRAG_SLOTS, R = BLK % Cfg::RAW_SLOTS;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        const uint32_t sc_g = scale_pair<Cfg, T>(st.r_abs[mt], BLK), sc_g8 = scale_pair<Cfg, T>(st.r_abs[mt], 4 + BLK);
#pragma unroll
        for (int s = 0; s < 2; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) // register j: row g (j even) or g + 8 (j odd)
                frag[F][mt][s][j] = Pack2<T>::mul(st.raw[R][mt][s][j], (j & 1) ? sc_g8 : sc_g);
    }
    wgmma_fence();
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int s = 0; s < 2; s++) // k16 step u = 2 BLK + s: bytes 32 u .. 32 u + 31 of the token row
            WgmmaRS<T, Cfg::TOK>::run(reinterpret_cast<float(&)[Cfg::TOK / 2]>(acc[mt]), frag[F][mt][s],
                                      smem_desc_sw128(s_tok + (BLK / 2) * Cfg::A_HALF_BYTES + ((BLK % 2) * 2 + s) * 32));
    wgmma_commit();
}

template <class Cfg, typename T>
__device__ __forceinline__ void compute_stage_wgmma(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t (&frag)[Cfg::FRAG_SLOTS][Cfg::MT][2][4],
                                                    uint32_t s_w, uint32_t s_tok, uint32_t s_lut, uint32_t lane_off,
                                                    int lane) {
    WgmmaStep<Cfg> st;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) read_unit_from_stage<Cfg>(st.r_w[mt], st.r_abs[mt], s_w, mt, lane);
    lookup_block<Cfg, 0>(st, s_lut, lane_off);
    if constexpr (Cfg::LOOKAHEAD == 2) lookup_block<Cfg, 1>(st, s_lut, lane_off);
    block_wgmma<Cfg, T, 0>(acc, frag, st, s_tok, s_lut, lane_off);
    block_wgmma<Cfg, T, 1>(acc, frag, st, s_tok, s_lut, lane_off);
    block_wgmma<Cfg, T, 2>(acc, frag, st, s_tok, s_lut, lane_off);
    block_wgmma<Cfg, T, 3>(acc, frag, st, s_tok, s_lut, lane_off);
}

// Split-K through a thread-block cluster (section 7): the k_splits CTAs of a tile (cluster dims (1, k_splits,
// 1), rank = split) park their partial tiles in their own shared memory as [token][row] fp32 (row stride
// PARK_STRIDE: the park stores are conflict-free), then each rank sums one k_splits-th of the tile over all
// ranks, in rank order (0 + split 0 + split 1 + ...: the workspace path's order, so the same bits), and
// stores it to C. Called by every thread after the k-loop; s_park: 16-byte aligned, PARK_BYTES free.
template <class Cfg, typename T>
__device__ __forceinline__ void cluster_reduce_store(const float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                                     uint32_t s_park, float* s_park_ptr, int n_base_cta, int m_base,
                                                     int warp, int lane) {
    constexpr int ROWS = Cfg::WARPS_N * Cfg::MT * UNIT_ROWS, STRIDE = Cfg::PARK_STRIDE;
    const int g = lane / 4, t = lane % 4;
    __syncthreads(); // every warp's wgmmas and ring reads are done: the ring becomes the park
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int n_local = (warp * Cfg::MT + mt) * UNIT_ROWS + g + 8 * (r / 2);
                const int m_local = mb * 8 + 2 * t + (r % 2);
                s_park_ptr[m_local * STRIDE + n_local] = acc[mt][mb][r];
            }
    cluster_barrier(); // every rank's partial is parked
    const int ranks = p.k_splits, rank = (int)cluster_rank();
    constexpr int QUADS = Cfg::TOK * ROWS / 4; // float4s of the tile
    const int q_end = (rank + 1) * QUADS / ranks;
    T* g_C = reinterpret_cast<T*>(p.C);
    const T* g_bias = reinterpret_cast<const T*>(p.bias);
    for (int q = rank * QUADS / ranks + threadIdx.x; q < q_end; q += Cfg::THREADS) {
        const int m_local = q / (ROWS / 4), n_local = (q % (ROWS / 4)) * 4;
        const int m = m_base + m_local;
        if (m >= p.M) continue;
        const uint32_t s_quad = s_park + 4u * (uint32_t)(m_local * STRIDE + n_local);
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int src = 0; src < ranks; src++) {
            const float4 v = ld_cluster_f32x4(map_to_rank(s_quad, (uint32_t)src));
            sum[0] += v.x;
            sum[1] += v.y;
            sum[2] += v.z;
            sum[3] += v.w;
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = n_base_cta + n_local + e;
            if (n >= p.N) break;
            const float b = g_bias ? Pack2<T>::to_float(g_bias[n]) : 0.0f;
            g_C[(long long)m * p.N + n] = Pack2<T>::from_float(sum[e] * Cfg::OUT_FACTOR + b);
        }
    }
    cluster_barrier(); // the other ranks keep their shared memory until every rank has read it
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::THREADS, 1) kbit_gemm_wgmma_kernel(const KbitGemmParams p) {
    extern __shared__ __align__(16) uint8_t s_raw[];
    grid_dependency_wait(); // PDL (kbit_gemm.cu): every read and write of this grid comes after the previous kernel
    const float cb_entry = load_codebook_entry(p); // first: its latency overlaps the prologue
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
    uint32_t frag[Cfg::FRAG_SLOTS][Cfg::MT][2][4];

    StreamCursor<Cfg> cur;
    cur.init(p, n16_base, m_base, k_begin, lane);
    TokenCursor<Cfg> tok;
    tok.init(p, m_base, k_begin);
    for (int st = 0; st < WS - 1; st++) { // WS - 1 k-steps of weights and tokens in flight
        if (st < n_steps) {
            load_stage_async<Cfg>(s_w_ring + st * Cfg::W_STAGE_BYTES, cur, lane);
            cur.advance();
            copy_tokens_async<Cfg>(s_tok_ring + st * Cfg::A_STAGE_BYTES, tok, p);
        }
        cp_async_commit();
    }
    build_lut<Cfg, T, true>(s_lut_ptr, cb_entry, p);

    for (int i = 0; i < n_steps; i++) {
        cp_async_wait<WS - 2>();    // this thread's weights and tokens of step i landed
        fence_proxy_async_shared(); // its token words of step i are visible to wgmma
        __syncthreads();            // ... everyone's; the LUT; every warp is past step i-1's block 3 wait
        if (i + WS - 1 < n_steps) { // token slot (i + WS - 1) % AS held step i - 2: all its wgmmas retired
            load_stage_async<Cfg>(s_w_ring + ((i + WS - 1) % WS) * Cfg::W_STAGE_BYTES, cur, lane);
            cur.advance();
            copy_tokens_async<Cfg>(s_tok_ring + ((i + WS - 1) % AS) * Cfg::A_STAGE_BYTES, tok, p);
        }
        cp_async_commit();
        compute_stage_wgmma<Cfg, T>(acc, frag, s_w_ring + (i % WS) * Cfg::W_STAGE_BYTES,
                                    s_tok_ring + (i % AS) * Cfg::A_STAGE_BYTES, s_lut, lane_off, lane);
    }
    allow_dependent_launch(); // every copy of this CTA is issued: the next call's CTAs may take the free SMs
    wgmma_wait<0>();
    cp_async_wait<0>();
    if (p.k_splits > 1 && p.cluster_reduce) {
        const int n_base_cta = (tile / m_tiles) * Cfg::WARPS_N * Cfg::MT * UNIT_ROWS;
        cluster_reduce_store<Cfg, T>(acc, p, s_tok_ring, reinterpret_cast<float*>(s_raw + (s_tok_ring - s_raw_addr)),
                                     n_base_cta, m_base, warp, lane);
        return;
    }
    if (p.k_splits > 1) {
        __syncthreads();
        if (!reduce_split_k<Cfg>(acc, p, tile, warp, true, lane, &s_flag)) return;
    }
    store_output<Cfg, T>(acc, p, n16_base * UNIT_ROWS, m_base, lane);
}

} // namespace kbit
