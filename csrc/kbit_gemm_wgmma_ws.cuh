// kbit_gemm_wgmma_ws.cuh: the warp-specialised Hopper (sm_90a) kernel of the fused k-bit GEMM for
// large M (configs 7 and 14: token tiles of TOK = 256 and 128; device code and its host-side tensor map; included by
// kbit_gemm.cu after
// kbit_gemm_wgmma.cuh, whose wgmma helpers, and kbit_gemm.cuh, whose layout and LUT dequant it reuses).
//
// ============================================================================================
// DESIGN
// ============================================================================================
// 1. Why another kernel. In config 6 every warp copies its own weights and tokens, waits for them and meets the
//    others at a CTA barrier per k-step, so at large M the tensor pipe waits on the copies and the barrier. Here
//    the copies leave the compute warps:
//      - two PRODUCER warps: one issues, per k-step, 8 bulk copies of the CTA's weight units (contiguous in the
//        tiled layout) + 8 of their absmax, the other 2 TMA tile loads of the tokens (TOK rows x 64 k, 128-byte
//        swizzle: the K-major layout wgmma reads), each completing on an mbarrier ("full"); each refills a slot of
//        its ring when the consumers have released it ("empty").
//      - 8 CONSUMER warps (2 warpgroups) only wait on "full", dequantize (the LUT of kbit_gemm.cuh) into the
//        register A operand and issue wgmma.m64n{TOK}k16; no CTA barrier in the main loop.
//    The tiled weight holds each lane's pairs at the k its fragment slots stand for, so the TMA reads A as it is.
//
// 2. Tiles: CTA = 128 weight rows (8 units, one per consumer warp) x TOK tokens; each weight is dequantized once per
//    TOK tokens (TOK = 128 halves the padded MMA work where M <= 128). Grid: (tiles, k splits), m tile fastest (the m
//    tiles of one weight tile share it through L2). Where the tiles leave SMs idle the host splits the k-steps
//    (ws_splits in kbit_gemm.cu: the split count whose waves finish first, >= WS_MIN_SPLIT_STEPS k-steps each),
//    summed through the workspace slots of kbit_gemm.cuh section 5 with a barrier among the 256 consumer threads in
//    place of __syncthreads (the producer warps have returned).
//
// 3. Shared memory (one CTA per SM): the LUT (32 KB), TOK_STAGES token half-steps (k 64 wide, 32 KB each,
//    1024-aligned; after the main loop they hold the output tile, section 7), W_STAGES weight k-steps (8 units'
//    words + absmax as stored in global), 2 mbarriers per slot. Per k-step i the weight producer fills weight slot
//    i % W_STAGES, the token producer token slots (2i, 2i + 1) % TOK_STAGES.
//
// 4. Consumer loop per k-step: wait w_full, load this warp's unit (LDS) and release the weight slot (one arrive per
//    warp), look up block 0; per block b: look up block b + 1, wgmma.wait_group 1 (the group of block b - 2 retired:
//    its fragment slot is free), scale, fence, 2 wgmmas, commit. At odd blocks the previous token half's slot is
//    released. After block 3 the warp already waits for the next k-step's weights into the other of two register
//    sets (the loop is unrolled by 2) and looks up its block 0, so that chain runs under the tensor work.
//
// 5. Registers: 3 warpgroups (the producers' has two working warps) so that setmaxnreg gives the consumers 232
//    registers and the producers 40. The accumulators are first written by the tile's first wgmma (scale-d = 0):
//    zeroing them with ordinary instructions, or fewer registers, makes ptxas serialize the wgmmas (C7512, C7515).
//    Check every build for C751x warnings.
//
// 6. The partial last wave. One CTA per SM runs the tiles in waves. Where the last wave would leave more than half
//    the SMs idle and the launch has no k splits (ws_tail_tiles in kbit_gemm.cu), its tiles run as two CTAs each,
//    half the k-steps apiece, placed last in the grid:
//        grid: [ whole tiles 0 .. F-1 | tile F k half 0, tile F k half 1, tile F+1 k half 0, ... ]   F = ws_tail_from
//    The two halves add up through the workspace slots, or, in a clustered launch (section 8), as one cluster of 2
//    through each other's shared memory (ws_pair_reduce_store): each parks the fp32 accumulators of the token half
//    the other stores, arrives on the other's mbarrier with cluster-scope release, adds the other's park through
//    DSMEM and stores its half. Split 0 + split 1 either way: the workspace path's bits.
//
// 7. The output through shared memory (ws_store_tile): once every wgmma of the tile has retired and the token ring is
//    free, the consumers write the tile with stmatrix.trans into it (token-major, 16-byte chunks swizzled by
//    token % 8: no bank conflicts on either side) and store each token's 256 bytes with 16-byte stores:
//          fragments (8 warps x 16 rows x TOK tokens) --stmatrix.x4.trans--> smem [TOK tokens][128 rows]
//          --LDS.128 / STG.128, 2 token rows per warp instruction--> C rows m_base + 0..TOK-1, columns n_cta + 0..127
//
// 8. Token multicast (p.ws_multicast). Where a launch has an even number of weight tiles and of tail tiles, the CTAs
//    of weight tiles 2c and 2c + 1 of one m tile and one k split run as a cluster of 2 and share the token
//    tile: each producer loads its TOK / 2 rows of every box with .multicast::cluster into the same slot of both
//    CTAs, and each consumer warp releases a token slot in both (t_empty counts 16 arrives):
//          cluster c:  CTA rank 0 = weight tile 2 (c / m_tiles),     m tile c % m_tiles, token rows 0 .. TOK/2-1 -> both
//                      CTA rank 1 = weight tile 2 (c / m_tiles) + 1, same m tile,      token rows TOK/2 .. TOK-1 -> both
//    A half box wholly past M is not loaded at all (ws_produce_tokens).
//    The producer waits for the partner's last releases before it returns, so neither CTA exits while the other may
//    still arrive on its barriers. The consumers' remote arrive uses the default .release.cta semantics: a
//    cluster-scope fence per release costs a quarter of the kernel's time.
// ============================================================================================
#pragma once

#include "kbit_gemm_wgmma.cuh"

#include <cuda.h>

namespace kbit {

// pipeline knobs; the defaults are the measured choice

template <int K_BITS_, bool ABS_U8_, int TOK_>
struct KbitWsConfig : KbitGemmConfig<K_BITS_, TOK_ / 8, 1, 8, 1, ABS_U8_, true> {
    using Base = KbitGemmConfig<K_BITS_, TOK_ / 8, 1, 8, 1, ABS_U8_, true>;
    static_assert(TOK_ == 128 || TOK_ == 256, "wgmma N of the token tile");
    static constexpr int TOK = TOK_;                // tokens per CTA tile = wgmma N
    static constexpr int ACC = TOK / 2;             // fp32 accumulators per consumer thread (64 rows x TOK / 128)
    static constexpr int CONSUMER_WARPS = 8;        // 2 warpgroups, one unit each per k-step
    static constexpr int CONSUMER_THREADS = 32 * CONSUMER_WARPS;
    // + a producer warpgroup (two warps of it work): 3 warpgroups let setmaxnreg move registers from the producer
    // to the consumers, whose 128 accumulators + fragments need more than the 224 a 288-thread launch allows
    // (there ptxas serialized the wgmmas, C7512)
    static constexpr int WS_THREADS = CONSUMER_THREADS + 128;
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232; // 128 x 40 + 256 x 232 <= 64K
    static constexpr int HALF_K = 64;               // k of one TMA box (128 bytes: the swizzle width)
    static constexpr int TOK_HALF_BYTES = TOK * 128;
    static constexpr int UNIT_BYTES = 4 * Base::Fmt::UNIT_WORDS;
    static constexpr int ABS_UNIT_BYTES = UNIT_ABSMAX * (ABS_U8_ ? 1 : 2);
    static constexpr int W_STAGE_BYTES = CONSUMER_WARPS * (UNIT_BYTES + ABS_UNIT_BYTES);
    static constexpr int TOK_STAGES = 4;
    static constexpr int W_STAGES = 4;
    static constexpr int LUT_BYTES = 4 * Base::LUT_WORDS;
    static constexpr int BAR_BYTES = 8 * (2 * TOK_STAGES + 2 * W_STAGES + 2); // + the pair reduction's two
    static constexpr int SMEM_BYTES = 1024 /* alignment */ + TOK_STAGES * TOK_HALF_BYTES + LUT_BYTES +
                                      W_STAGES * W_STAGE_BYTES + BAR_BYTES;
    static_assert(SMEM_BYTES <= 227 * 1024, "one CTA per SM");
    // wgmma_wait<FRAG_SLOTS - 1>: groups of FRAG_SLOTS - 1 blocks in flight while the next is built
    static constexpr int FRAG_SLOTS = 2;
    static_assert(FRAG_SLOTS == 2 || FRAG_SLOTS == 4, "a token half (2 blocks) is released FRAG_SLOTS / 2 halves late");
    static_assert(TOK_STAGES > FRAG_SLOTS / 2 + 1, "the producer must be able to run ahead");
};

// ---------------------------------------------------------------------------------------------
// mbarrier, bulk copy and TMA (PTX ISA 9.7.13.15, 9.7.9.25.4); sm_90a only, like the wgmma helpers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    KBIT_SM90A_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
__device__ __forceinline__ void bulk_copy_g2s(uint32_t s_dst, const void* g_src, uint32_t bytes, uint32_t bar) {
    KBIT_SM90A_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(s_dst),
                   "l"(g_src), "r"(bytes), "r"(bar)
                   : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t s_dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    KBIT_SM90A_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                       s_dst),
                   "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
                   : "memory");
}
// the same box into the shared memory of every CTA of the cluster in cta_mask (at the same offset, completing on the
// mbarrier at the same offset in each)
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t s_dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                                      uint16_t cta_mask) {
    KBIT_SM90A_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                   " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(s_dst),
                   "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
                   : "memory");
}
// arrive on an mbarrier of another CTA of the cluster (s_cluster_addr: map_to_rank)
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t s_cluster_addr) {
    KBIT_SM90A_ASM("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(s_cluster_addr) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// four 8 x 8 b16 matrices, transposed (PTX ISA 9.7.14.5.16): register q of every lane holds its mma-fragment pair of
// matrix q (row lane / 4, columns 2 (lane % 4) + 0, 1); column j of matrix q goes to the 16 bytes at lane 8q + j's
// address
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t s_addr, const uint32_t (&r)[4]) {
    KBIT_SM90A_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(s_addr), "r"(r[0]),
                   "r"(r[1]), "r"(r[2]), "r"(r[3])
                   : "memory");
}
__device__ __forceinline__ uint4 lds_128(uint32_t s_addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(s_addr));
    return v;
}

// D[64 x N] (+)= A[64 x 16] (registers) x B[16 x N] (shared, K-major, 128-byte swizzle), N = 256 or 128; accumulate = 0
// overwrites D: the first wgmma of a tile starts from it, so the accumulators are never zeroed by ordinary
// instructions (ptxas serializes every wgmma of a kernel whose accumulators are defined between them, C7515)
#define KBIT_ACC8(i)                                                                                                 \
    "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),   \
        "+f"(d[i + 7])
#define KBIT_ACC64(i) KBIT_ACC8(i), KBIT_ACC8(i + 8), KBIT_ACC8(i + 16), KBIT_ACC8(i + 24), KBIT_ACC8(i + 32),      \
                      KBIT_ACC8(i + 40), KBIT_ACC8(i + 48), KBIT_ACC8(i + 56)
#define KBIT_WGMMA_RS_N256(PTX_TYPE)                                                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE " {"                           \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                            \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                  \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                  \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                  \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                  \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                  \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "      \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
                 "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"                                                  \
                 : KBIT_ACC64(0), KBIT_ACC64(64)                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#define KBIT_WGMMA_RS_N128(PTX_TYPE)                                                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                        \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " {"                           \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                            \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                  \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                  \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                 \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                                      \
                 : KBIT_ACC64(0)                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
template <typename T, int N> struct WgmmaRSAcc; // with the scale-d predicate (accumulate = 0: D = A x B)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA_BODY(x) x
#else
#define KBIT_WGMMA_BODY(x) __trap()
#endif
#define KBIT_WGMMA_RS_SPEC(T, N, PTX_TYPE)                                                                           \
    template <> struct WgmmaRSAcc<T, N> {                                                                             \
        static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,       \
                                                   uint32_t accumulate) {                                            \
            KBIT_WGMMA_BODY(KBIT_WGMMA_RS_N##N(PTX_TYPE));                                                           \
        }                                                                                                            \
    };
KBIT_WGMMA_RS_SPEC(__half, 256, "f16")
KBIT_WGMMA_RS_SPEC(__nv_bfloat16, 256, "bf16")
KBIT_WGMMA_RS_SPEC(__half, 128, "f16")
KBIT_WGMMA_RS_SPEC(__nv_bfloat16, 128, "bf16")
#undef KBIT_WGMMA_RS_SPEC
#undef KBIT_WGMMA_BODY
#undef KBIT_WGMMA_RS_N256
#undef KBIT_WGMMA_RS_N128
#undef KBIT_ACC64
#undef KBIT_ACC8

// The tile's output through shared memory (section 7), by the 256 consumer threads once every wgmma of the tile has
// retired (the token ring, free by then, holds it): each warp's fragments with stmatrix.trans into [256 tokens][128
// rows] of 16-bit values, 16-byte chunk c of token m's 256-byte row at chunk c ^ (m % 8) (conflict-free both ways),
// then each token's 256 bytes to its row of C with 16-byte stores (element stores where C or N is not 16-byte
// aligned and at the edge of N).
template <class Cfg, typename T, int TOK_BEGIN = 0, int TOK_END = Cfg::TOK>
__device__ __forceinline__ void ws_store_tile(const float (&acc)[Cfg::ACC], const KbitGemmParams& p, uint32_t s_stage,
                                              int n_cta, int m_base, int warp, int lane) {
    static_assert(TOK_BEGIN % 16 == 0 && TOK_END % 16 == 0 && TOK_BEGIN < TOK_END && TOK_END <= Cfg::TOK, "token rows");
    const int g = lane / 4, q = lane / 8, j = lane % 8;
    const T* g_bias = reinterpret_cast<const T*>(p.bias);
    float bias[2] = {0.0f, 0.0f}; // rows n_cta + 16 warp + g + 8h of this lane's fragments
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = n_cta + 16 * warp + g + 8 * h;
        if (g_bias != nullptr && n < p.N) bias[h] = Pack2<T>::to_float(g_bias[n]);
    }
    named_barrier_sync(1, Cfg::CONSUMER_THREADS); // both warpgroups' wgmmas have read their last token slot
    // matrix u of a stmatrix = (token group mb + u / 2, row half u % 2); lane 8u + j addresses its token
    // 8 (mb + u / 2) + j
#pragma unroll
    for (int mb = TOK_BEGIN / 8; mb < TOK_END / 8; mb += 2) {
        uint32_t r[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float* a = acc + 4 * (mb + u / 2) + 2 * (u % 2);
            r[u] = Pack2<T>::from_floats(a[0] * Cfg::OUT_FACTOR + bias[u % 2], a[1] * Cfg::OUT_FACTOR + bias[u % 2]);
        }
        const int m = 8 * (mb + q / 2) + j, c = 2 * warp + q % 2;
        stmatrix_x4_trans(s_stage + m * 256 + ((c ^ j) << 4), r);
    }
    named_barrier_sync(1, Cfg::CONSUMER_THREADS);
    T* g_C = reinterpret_cast<T*>(p.C);
    const bool vec = ((reinterpret_cast<uintptr_t>(p.C) | ((size_t)p.N * sizeof(T))) % 16) == 0;
    const int c = threadIdx.x % 16, n = n_cta + 8 * c; // thread i: chunk i % 16 of tokens i / 16 + 16 s
#pragma unroll 4
    for (int s = TOK_BEGIN / 16; s < TOK_END / 16; s++) {
        const int ml = threadIdx.x / 16 + 16 * s;
        if (m_base + ml >= p.M) break;
        const uint4 v = lds_128(s_stage + ml * 256 + ((c ^ (ml % 8)) << 4));
        T* dst = g_C + (long long)(m_base + ml) * p.N + n;
        if (vec && n + 8 <= p.N) {
            *reinterpret_cast<uint4*>(dst) = v;
        } else {
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int x = 0; x < 8; x++)
                if (n + x < p.N) reinterpret_cast<uint16_t*>(dst)[x] = (uint16_t)(w[x / 2] >> (16 * (x % 2)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------
template <class Cfg> struct WsSmem {
    uint32_t tok, lut, w, bar; // shared addresses of the token ring, LUT, weight ring, barriers
    uint32_t peer_t_empty;     // token multicast (section 8): t_empty(0) of the other CTA of the cluster, else 0
    __device__ __forceinline__ uint32_t tok_slot(int s) const { return tok + s * Cfg::TOK_HALF_BYTES; }
    __device__ __forceinline__ uint32_t w_slot(int s) const { return w + s * Cfg::W_STAGE_BYTES; }
    __device__ __forceinline__ uint32_t t_full(int s) const { return bar + 8 * s; }
    __device__ __forceinline__ uint32_t t_empty(int s) const { return bar + 8 * (Cfg::TOK_STAGES + s); }
    __device__ __forceinline__ uint32_t w_full(int s) const { return bar + 8 * (2 * Cfg::TOK_STAGES + s); }
    __device__ __forceinline__ uint32_t w_empty(int s) const { return bar + 8 * (2 * Cfg::TOK_STAGES + Cfg::W_STAGES + s); }
    // the split last wave's pair reduction: the partner's park is written / this CTA's park has been read
    __device__ __forceinline__ uint32_t park_full() const { return bar + 8 * (2 * Cfg::TOK_STAGES + 2 * Cfg::W_STAGES); }
    __device__ __forceinline__ uint32_t park_read() const { return park_full() + 8; }
};

// The split last wave's pair reduction (section 6): the two k halves of a tile run as one cluster of 2 (rank =
// half). Each parks the accumulators of the token half the other finalizes in its own free token slots 2, 3, arrives on
// the other's park_full, waits on its own, adds the other's parked half to its own (split 0 + split 1: the workspace
// path's bits) through DSMEM, arrives on the other's park_read and stores its token half; it exits once its own park
// has been read. Park: float4 i of consumer thread x at (i * 256 + x) * 16 bytes (a warp's 512 contiguous bytes).
__device__ __forceinline__ void mbar_arrive_cluster_release(uint32_t s_cluster_addr) {
    KBIT_SM90A_ASM("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(s_cluster_addr) : "memory");
}
template <class Cfg, typename T, int KEEP>
__device__ __forceinline__ void ws_pair_reduce_store(float (&acc)[Cfg::ACC], const KbitGemmParams& p, const WsSmem<Cfg>& sm,
                                                     int n_cta, int m_base, int warp, int lane) {
    // the park (half the accumulators of 256 threads = TOK * 256 bytes) fills token slots 2 and 3 exactly, the output
    // half (TOK / 2 token rows of 256 bytes) lies in slots 0 and 1
    static_assert(Cfg::TOK_STAGES >= 4, "the park takes token slots 2 and 3");
    constexpr int HALF = Cfg::TOK / 2;               // this CTA stores tokens KEEP * HALF .., parks the others
    constexpr int HALF_ACC = Cfg::ACC / 2;           // their accumulators: acc[HALF_ACC * half ..]
    [[maybe_unused]] constexpr int GIVE = 1 - KEEP; // (unused where the asm is compiled out: sm_80 builds)
    const uint32_t tid = threadIdx.x, peer = cluster_rank() ^ 1u;
    const uint32_t park = sm.tok_slot(2);
    named_barrier_sync(1, Cfg::CONSUMER_THREADS); // both warpgroups' wgmmas have read their last token slot
#pragma unroll
    for (int i = 0; i < HALF_ACC / 4; i++)
        KBIT_SM90A_ASM("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(park + (i * 256u + tid) * 16u),
                       "f"(acc[HALF_ACC * GIVE + 4 * i]), "f"(acc[HALF_ACC * GIVE + 4 * i + 1]),
                       "f"(acc[HALF_ACC * GIVE + 4 * i + 2]), "f"(acc[HALF_ACC * GIVE + 4 * i + 3])
                       : "memory");
    mbar_arrive_cluster_release(map_to_rank(sm.park_full(), peer));
    mbar_wait_cluster(sm.park_full(), 0);
    const uint32_t peer_park = map_to_rank(park, peer);
#pragma unroll
    for (int i = 0; i < HALF_ACC / 4; i++) {
        const float4 v = ld_cluster_f32x4(peer_park + (i * 256u + tid) * 16u);
        float* a = acc + HALF_ACC * KEEP + 4 * i;
        a[0] += v.x, a[1] += v.y, a[2] += v.z, a[3] += v.w; // commutative: split 0 + split 1 either way
    }
    mbar_arrive_cluster_release(map_to_rank(sm.park_read(), peer));
    ws_store_tile<Cfg, T, KEEP * HALF, KEEP * HALF + HALF>(acc, p, sm.tok, n_cta, m_base, warp, lane);
    mbar_wait(sm.park_read(), 0); // the other CTA has read this one's park: it may go
}

// The producer warps: one streams the weights (k-step i into weight slot i % W_STAGES), another the tokens (half j
// into token slot j % TOK_STAGES), each gated only by its own ring's "empty" barriers, so the weights run up to
// W_STAGES k-steps ahead whatever the token ring does (one warp issuing both in one loop held the weights behind
// every token-slot wait: ncu showed the consumers' weight waits at 10% of their stall samples).
template <class Cfg>
__device__ __forceinline__ void ws_produce_weights(const KbitGemmParams& p, const WsSmem<Cfg>& sm, int n16_base,
                                                   int k_begin, int n_steps, int lane) {
    // lanes 0-7 copy the words of unit n16_base + lane, lanes 8-15 its absmax (units past N: the last one,
    // whose rows are never stored)
    const int u = lane % Cfg::CONSUMER_WARPS;
    const long long unit0 = (long long)min(n16_base + u, p.n16_tiles - 1) * p.k_steps;
    const int src_step = lane < 8 ? Cfg::UNIT_BYTES : Cfg::ABS_UNIT_BYTES;
    const char* g_src = (lane < 8 ? reinterpret_cast<const char*>(p.B) : reinterpret_cast<const char*>(p.B_absmax)) +
                        (unit0 + k_begin) * src_step;
    const uint32_t dst_off = lane < 8 ? u * Cfg::UNIT_BYTES : Cfg::CONSUMER_WARPS * Cfg::UNIT_BYTES + u * Cfg::ABS_UNIT_BYTES;
    for (int i = 0; i < n_steps; i++) { // slot indices count this split's steps, global k = k_begin + i
        const int ws = i % Cfg::W_STAGES;
        if (lane == 0) {
            mbar_wait(sm.w_empty(ws), ((i / Cfg::W_STAGES) & 1) ^ 1);
            mbar_arrive_expect_tx(sm.w_full(ws), Cfg::W_STAGE_BYTES);
        }
        __syncwarp();
        if (lane < 16) bulk_copy_g2s(sm.w_slot(ws) + dst_off, g_src + (long long)i * src_step, src_step, sm.w_full(ws));
    }
}

// With the token multicast (section 8) the two CTAs of a cluster share the token tile: each loads its 128 rows of
// every box into both CTAs. A slot is refilled only when the consumers of both have released it (each consumer warp
// arrives on t_empty of both CTAs); before it returns, the producer waits for the releases still to come, so that
// no CTA exits while the other may still arrive on its barriers.
// A box of half-tile rows that lies wholly past M is not loaded: the TMA's zero fill of such boxes is slow (it made the
// whole kernel slower at M <= TOK / 2 than at M = TOK). Its token rows keep stale shared memory, which feeds only
// output columns m >= M, never stored (each token is its own column of the product).
template <class Cfg>
__device__ __forceinline__ void ws_produce_tokens(const CUtensorMap* tmap, const WsSmem<Cfg>& sm, int M, int m_base,
                                                  int k_begin, int n_steps, bool multicast, bool half_boxes) {
    const int rank = multicast ? (int)cluster_rank() : 0;
    const uint32_t dst_off = rank * (Cfg::TOK / 2) * 128;
    const bool upper_half = m_base + Cfg::TOK / 2 < M;             // the second half-tile box holds a token
    const uint32_t tx = multicast || half_boxes ? (upper_half ? 2 : 1) * (Cfg::TOK_HALF_BYTES / 2) : Cfg::TOK_HALF_BYTES;
    for (int j = 0; j < 2 * n_steps; j++) { // half j of this split = k (k_begin + j / 2) * UNIT_K + (j % 2) * HALF_K
        const int ts = j % Cfg::TOK_STAGES;
        mbar_wait(sm.t_empty(ts), ((j / Cfg::TOK_STAGES) & 1) ^ 1);
        mbar_arrive_expect_tx(sm.t_full(ts), tx); // both CTAs' rows
        const int k = k_begin * UNIT_K + j * Cfg::HALF_K;
        if (multicast) {
            if (rank == 0 || upper_half)
                tma_load_2d_multicast(sm.tok_slot(ts) + dst_off, tmap, k, m_base + rank * (Cfg::TOK / 2), sm.t_full(ts),
                                      0x3);
        } else if (half_boxes) { // a pair CTA of a multicast launch (the map's boxes are TOK / 2 rows)
            tma_load_2d(sm.tok_slot(ts), tmap, k, m_base, sm.t_full(ts));
            if (upper_half)
                tma_load_2d(sm.tok_slot(ts) + (Cfg::TOK / 2) * 128, tmap, k, m_base + Cfg::TOK / 2, sm.t_full(ts));
        } else
            tma_load_2d(sm.tok_slot(ts), tmap, k, m_base, sm.t_full(ts));
    }
    if (multicast) // the releases still to come (both CTAs' consumers release up to half 2 n_steps - 1 - LAG)
        for (int h = max(0, 2 * n_steps - Cfg::TOK_STAGES); h < 2 * n_steps - Cfg::FRAG_SLOTS / 2; h++)
            mbar_wait_cluster(sm.t_empty(h % Cfg::TOK_STAGES), (h / Cfg::TOK_STAGES) & 1);
}

// this warp's unit of weight slot s_w: lane words (lane-major 16- / 8-byte chunks, as in global) and the
// absmax of rows g, g + 8 (8 bytes of E4M4 or 16 of fp16 at [g][row half][block])
template <class Cfg>
__device__ __forceinline__ void ws_read_unit(uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS], uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4],
                                             uint32_t s_w, int warp, int lane) {
    lds_unit_words<Cfg>(r_w, s_w + warp * Cfg::UNIT_BYTES, lane);
    lds_unit_absmax<Cfg>(r_abs, s_w + Cfg::CONSUMER_WARPS * Cfg::UNIT_BYTES + warp * Cfg::ABS_UNIT_BYTES +
                                    (lane / 4) * Cfg::ABS_BYTES_PER_LANE);
}

// wait for k-step i's weights, load this warp's unit, release the slot and look up block 0 into raw[0]
template <class Cfg>
__device__ __forceinline__ void ws_fetch_unit(uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS], uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4],
                                              uint32_t (&raw)[2][2][4], const WsSmem<Cfg>& sm, int i, uint32_t lane_off,
                                              int warp, int lane) {
    const int ws = i % Cfg::W_STAGES;
    mbar_wait(sm.w_full(ws), (i / Cfg::W_STAGES) & 1);
    ws_read_unit<Cfg>(r_w, r_abs, sm.w_slot(ws), warp, lane);
    lookup_frag_a<Cfg, 0>(raw[0][0], r_w, sm.lut, lane_off);
    lookup_frag_a<Cfg, 1>(raw[0][1], r_w, sm.lut, lane_off);
    // The slot may be refilled once every consumer warp has arrived: each lane's loads have returned (their values fed
    // the lookups above), __syncwarp orders them before lane 0's arrive (release), and the producer issues its bulk
    // copy only after its wait on w_empty (acquire). compute-sanitizer racecheck does not model this order for bulk
    // copies and reports every refill as a WAR hazard; the sanitizer script does not count exactly that report.
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.w_empty(ws));
}

// block BLK of k-step i; after block 3's wgmmas `fetch_next` loads the next k-step's unit and looks up its block 0,
// so that chain runs while the tensor core works instead of at the start of the next step
template <class Cfg, typename T, int BLK, class FetchNext>
__device__ __forceinline__ void ws_block(float (&acc)[Cfg::ACC], uint32_t (&frag)[Cfg::FRAG_SLOTS][2][4], uint32_t (&raw)[2][2][4],
                                         const uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS],
                                         const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], const WsSmem<Cfg>& sm,
                                         int i, uint32_t lane_off, int lane, uint32_t accumulate, FetchNext&& fetch_next) {
    if constexpr (BLK + 1 < UNIT_BLOCKS) { // LUT reads of the next block first (their latency hides behind this one)
        lookup_frag_a<Cfg, 2 * (BLK + 1)>(raw[(BLK + 1) % 2][0], r_w, sm.lut, lane_off);
        lookup_frag_a<Cfg, 2 * (BLK + 1) + 1>(raw[(BLK + 1) % 2][1], r_w, sm.lut, lane_off);
    }
    const int j = 2 * i + BLK / 2, ts = j % Cfg::TOK_STAGES;
    if constexpr (BLK % 2 == 0) mbar_wait(sm.t_full(ts), (j / Cfg::TOK_STAGES) & 1);
    wgmma_wait<Cfg::FRAG_SLOTS - 1>(); // the group of block BLK - FRAG_SLOTS retired: its fragment slot is free
    if constexpr (BLK % 2 == 1) { // ... and with it the last block of half j - FRAG_SLOTS / 2: release that token slot
        constexpr int LAG = Cfg::FRAG_SLOTS / 2;
        if (j >= LAG && lane == 0) mbar_arrive(sm.t_empty((j - LAG) % Cfg::TOK_STAGES));
    }
    constexpr int F = BLK % Cfg::FRAG_SLOTS;
    const uint32_t sc_g = scale_pair<Cfg, T>(r_abs, BLK), sc_g8 = scale_pair<Cfg, T>(r_abs, 4 + BLK);
#pragma unroll
    for (int s = 0; s < 2; s++)
#pragma unroll
        for (int r = 0; r < 4; r++) frag[F][s][r] = Pack2<T>::mul(raw[BLK % 2][s][r], (r & 1) ? sc_g8 : sc_g);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 2; s++) // k16 step s of the block: bytes 32 ((BLK % 2) * 2 + s) of each 128-byte token row
        WgmmaRSAcc<T, Cfg::TOK>::run(acc, frag[F][s], smem_desc_sw128(sm.tok_slot(ts) + ((BLK % 2) * 2 + s) * 32), s > 0 ? 1u : accumulate);
    wgmma_commit();
    if constexpr (BLK % 2 == 1) // the token slot released above, in the other CTA of a multicast cluster too
        if (sm.peer_t_empty != 0u && j >= Cfg::FRAG_SLOTS / 2 && lane == 0)
            mbar_arrive_cluster(sm.peer_t_empty + 8u * (uint32_t)((j - Cfg::FRAG_SLOTS / 2) % Cfg::TOK_STAGES));
    if constexpr (BLK + 1 == UNIT_BLOCKS) fetch_next(); // after the issue: before it, ptxas serialized the wgmmas (C7513)
}

// k-step i from (r_w, r_abs), block 0 already looked up; fetches step i + 1 into (n_w, n_abs)
template <class Cfg, typename T>
__device__ __forceinline__ void ws_step(float (&acc)[Cfg::ACC], uint32_t (&frag)[Cfg::FRAG_SLOTS][2][4], uint32_t (&raw)[2][2][4],
                                        const uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS],
                                        const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4],
                                        uint32_t (&n_w)[Cfg::Fmt::LANE_WORDS], uint32_t (&n_abs)[Cfg::ABS_BYTES_PER_LANE / 4],
                                        const WsSmem<Cfg>& sm, int i, int k_steps, uint32_t lane_off, int warp, int lane) {
    const auto nothing = [] {};
    const auto fetch_next = [&] {
        if (i + 1 < k_steps) ws_fetch_unit<Cfg>(n_w, n_abs, raw, sm, i + 1, lane_off, warp, lane);
    };
    ws_block<Cfg, T, 0>(acc, frag, raw, r_w, r_abs, sm, i, lane_off, lane, i > 0 ? 1u : 0u, nothing);
    ws_block<Cfg, T, 1>(acc, frag, raw, r_w, r_abs, sm, i, lane_off, lane, 1u, nothing);
    ws_block<Cfg, T, 2>(acc, frag, raw, r_w, r_abs, sm, i, lane_off, lane, 1u, nothing);
    ws_block<Cfg, T, 3>(acc, frag, raw, r_w, r_abs, sm, i, lane_off, lane, 1u, fetch_next);
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::WS_THREADS, 1)
    kbit_gemm_wgmma_ws_kernel(const KbitGemmParams p, const __grid_constant__ CUtensorMap tmap) {
    extern __shared__ __align__(16) uint8_t s_raw[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t s_raw_addr = (uint32_t)__cvta_generic_to_shared(s_raw);
    WsSmem<Cfg> sm;
    sm.tok = (s_raw_addr + 1023u) & ~1023u;
    sm.lut = sm.tok + Cfg::TOK_STAGES * Cfg::TOK_HALF_BYTES;
    sm.w = sm.lut + Cfg::LUT_BYTES;
    sm.bar = sm.w + Cfg::W_STAGES * Cfg::W_STAGE_BYTES;

    // split blockIdx.y of the k-steps (section 2); the host plans no empty split (ws_splits). Without k splits, the
    // tiles of a partial last wave run as two CTAs each, half the k-steps apiece, last in the grid (section 6)
    int tile = blockIdx.x, split = blockIdx.y, n_splits = p.k_splits, ks = p.ks_per_split, slot_tile = blockIdx.x;
    // pair: a split last wave's CTA of a clustered launch, its cluster the two k halves of its tile (section 6)
    bool pair = false;
    if (n_splits == 1 && tile >= p.ws_tail_from) {
        const int j = tile - p.ws_tail_from;
        tile = p.ws_tail_from + j / 2, split = j % 2, n_splits = 2, ks = (p.k_steps + 1) / 2;
        slot_tile = tile - p.ws_tail_from, pair = p.ws_multicast != 0;
    }
    const int k_begin = split * ks;
    const int n_steps = min(ks, p.k_steps - k_begin);
    const int m_tiles = (p.M + Cfg::TOK - 1) / Cfg::TOK;
    const bool clustered = p.ws_multicast != 0; // clusters of 2 along x: the CTAs of weight tiles 2c, 2c + 1, one m tile
    const bool multicast = clustered && !pair;  // (or, pair: the two k halves of one tile)
    const int m_idx = clustered ? (tile / 2) % m_tiles : tile % m_tiles;
    const int n_idx = clustered ? (tile / 2) / m_tiles * 2 + tile % 2 : tile / m_tiles;
    const int m_base = m_idx * Cfg::TOK;
    const int n16_cta = n_idx * Cfg::CONSUMER_WARPS;

    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::TOK_STAGES; s++) {
            mbar_init(sm.t_full(s), 1);
            mbar_init(sm.t_empty(s), Cfg::CONSUMER_WARPS * (multicast ? 2 : 1));
        }
        for (int s = 0; s < Cfg::W_STAGES; s++) {
            mbar_init(sm.w_full(s), 1);
            mbar_init(sm.w_empty(s), Cfg::CONSUMER_WARPS);
        }
        mbar_init(sm.park_full(), Cfg::CONSUMER_THREADS);
        mbar_init(sm.park_read(), Cfg::CONSUMER_THREADS);
        KBIT_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (clustered) cluster_barrier(); // both CTAs' barriers exist before either multicasts or arrives remotely
    else __syncthreads();
    grid_dependency_wait(); // PDL (kbit_gemm.cu): every global read and write comes after the previous kernel
    sm.peer_t_empty = multicast ? map_to_rank(sm.t_empty(0), cluster_rank() ^ 1u) : 0u;

    if (warp >= Cfg::CONSUMER_WARPS) {
        KBIT_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Cfg::PRODUCER_REGS));
        if (warp == Cfg::CONSUMER_WARPS) {
            ws_produce_weights<Cfg>(p, sm, n16_cta, k_begin, n_steps, lane);
            allow_dependent_launch(); // the weights are this CTA's last copies: the next call may take free SMs
        }
        if (warp == Cfg::CONSUMER_WARPS + 1 && lane == 0)
            ws_produce_tokens<Cfg>(&tmap, sm, p.M, m_base, k_begin, n_steps, multicast, clustered);
        return;
    }
    KBIT_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Cfg::CONSUMER_REGS));

    const float cb_entry = load_codebook_entry(p);
    build_lut<Cfg, T, true>(reinterpret_cast<uint32_t*>(s_raw + (sm.lut - s_raw_addr)), cb_entry, p);
    named_barrier_sync(1, Cfg::CONSUMER_THREADS); // the LUT, among the consumers

    const uint32_t lane_off = (uint32_t)(lane % Cfg::LUT_COPIES) * Cfg::LUT_ENTRY_BYTES;
    float acc[Cfg::ACC]; // first written by the tile's first wgmma (accumulate = 0)
    uint32_t frag[Cfg::FRAG_SLOTS][2][4], raw[2][2][4];
    // two register sets for the weights, k-steps alternate between them (the loop is unrolled by 2: no copies)
    uint32_t r_w[2][Cfg::Fmt::LANE_WORDS], r_abs[2][Cfg::ABS_BYTES_PER_LANE / 4];
    ws_fetch_unit<Cfg>(r_w[0], r_abs[0], raw, sm, 0, lane_off, warp, lane);
    for (int i = 0; i < n_steps; i += 2) {
        ws_step<Cfg, T>(acc, frag, raw, r_w[0], r_abs[0], r_w[1], r_abs[1], sm, i, n_steps, lane_off, warp, lane);
        if (i + 1 < n_steps)
            ws_step<Cfg, T>(acc, frag, raw, r_w[1], r_abs[1], r_w[0], r_abs[0], sm, i + 1, n_steps, lane_off, warp, lane);
    }
    wgmma_wait<0>();
    allow_dependent_launch(); // with the producers' (or their exit): every copy of this CTA is issued
    if (pair) { // the two k halves of the tile sum through each other's shared memory (section 6)
        if (split == 0) ws_pair_reduce_store<Cfg, T, 0>(acc, p, sm, n16_cta * UNIT_ROWS, m_base, warp, lane);
        else ws_pair_reduce_store<Cfg, T, 1>(acc, p, sm, n16_cta * UNIT_ROWS, m_base, warp, lane);
        return;
    }
    // = the m16n8 fragments of TOK / 8 token tiles
    float(&acc_tile)[1][Cfg::MB][4] = reinterpret_cast<float(&)[1][Cfg::MB][4]>(acc);
    if (n_splits > 1) { // the workspace slots of kbit_gemm.cuh section 5, among the consumer warps only
        __shared__ int s_flag;
        const auto consumers_sync = [] { named_barrier_sync(1, Cfg::CONSUMER_THREADS); };
        if (!reduce_split_k<Cfg>(acc_tile, p, slot_tile, warp, true, lane, &s_flag, consumers_sync, split, n_splits))
            return;
    }
    ws_store_tile<Cfg, T>(acc, p, sm.tok, n16_cta * UNIT_ROWS, m_base, warp, lane);
}

// ---------------------------------------------------------------------------------------------
// Host side: the tensor map of A (cuTensorMapEncodeTiled through the runtime's driver entry point,
// so the library needs no -lcuda)
// ---------------------------------------------------------------------------------------------
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn encode_tiled_fn() {
    static EncodeTiledFn s_fn = nullptr;
    if (s_fn == nullptr) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            s_fn = reinterpret_cast<EncodeTiledFn>(fn);
    }
    return s_fn;
}

// tokens [rows][K_dim] 16-bit with row stride ld elements (16-byte aligned, ld % 8 == 0),
// boxes of 64 k x 256 rows with the 128-byte swizzle; out-of-range rows and k read as 0
static bool make_token_map(CUtensorMap* map, const void* tokens, int rows, int K_dim, long long ld, int tok) {
    const EncodeTiledFn fn = encode_tiled_fn();
    if (fn == nullptr) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)K_dim, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)tok};
    const cuuint32_t elem_strides[2] = {1, 1};
    return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(tokens), dims, strides, box, elem_strides,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace kbit
