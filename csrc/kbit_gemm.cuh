// kbit_gemm.cuh: fused k-bit dequantize + GEMM (device code only).
//
// ============================================================================================
// DESIGN
// ============================================================================================
// 1. What is computed: C[M, N] = A[M, K_dim] @ W[N, K_dim]^T (+ bias[N]); A, C, bias fp16 or bf16 (one dtype),
//    fp32 accumulation. W is k-bit (K_BITS = 2..5): 32-element blocks along K_dim, one absmax per block (E4M4 uint8
//    or fp16), a float32 codebook of L <= 2^K_BITS entries. No buffer may alias C.
//
// 2. Tiles ("swap AB": the WEIGHT is the MMA A operand, the activations the B operand). mma.sync.m16n8k16:
//    m16 = 16 rows n of W, n8 = 8 tokens, k16 = 16 of K_dim. At M = 1 seven of the 8 token columns are idle, but the
//    tensor core makes the FMAs free: the integer and shared-memory work per weight is what bounds small M.
//      unit = 16 rows x 128 k (a "k-step" of 4 quantization blocks): the repack granule
//      warp = MT units along n x MB token tiles of 8, streaming its own k range
//      CTA  = WARPS_N x WARPS_K warps: along n different rows (same A), along k contiguous chunks of the CTA's
//             k-steps, reduced in shared memory at the end
//      grid = (n_ctas, k_splits, m_tiles); k_splits > 1 reduces across CTAs (section 5)
//    Config families (tables in kbit_gemm.cu): the per-warp ring (kbit_gemm_kernel, config 0: small weights at
//    M <= 16); shared-A (kbit_gemm_shared_a_kernel, configs 2-4 and 8-13: the A tile of a k-step staged once per
//    CTA, MB = 1, 2, 4 token tiles, variants with warps along k or fewer/more warps along n); wgmma
//    (kbit_gemm_wgmma.cuh, config 6, sm_90a) and warp-specialised wgmma (kbit_gemm_wgmma_ws.cuh, config 7, sm_90a),
//    each with its own design block. The dispatcher (kbit_gemm.cu, select_config) picks one per call.
//
// 3. Fragments (lane = 4g + t). Weights a0..a3 = half2 at (row g, k 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
//    (g+8, 2t+8..); activations b0, b1 = (k 2t..2t+1; token g), (k 2t+8..; token g); D d0..d3 = (n g, token 2t),
//    (g, 2t+1), (g+8, 2t), (g+8, 2t+1). Slots are real k: a lane dequantizes, of each block, the 4 pairs
//    (k 8p+2t, 8p+2t+1) of rows g and g+8, and reads the matching token fragments with one ldmatrix.x4 per block
//    from a row-major token tile in shared memory (the wgmma configs read the same layout).
//    Dequant of a pair: its LUT index e (2 K_BITS bits, one shift or funnel shift + one LOP3 from the lane's
//    contiguous fields, TiledFormat) selects a half2 {cb[i0] F, cb[i1] F} from a table replicated LUT_COPIES times
//    (copy = lane % LUT_COPIES, bank-conflict free), then one HMUL2 by the block scale. k = 2 looks up a quad (one
//    byte: the fields of MMA registers 2h, 2h+1) in a 256-entry table of 8-byte entries: one LDS.64 per 4 weights.
//    k = 3 with one token tile scales in fp32 after the MMA (POST_SCALE). One token (BLOCK_COLUMNS: configs 2, 8,
//    10, 12, k <= 4) uses the idle token columns: block b of a k-step is multiplied into column b alone (lane g = b
//    passes its activations, the others zeros), the table holds bare codebook values, and the four block scales
//    multiply the columns in fp32 (4 FFMA per unit); 2 shuffles per row sum the columns after the loop.
//    E4M4 scales need no decode: (code << 6) is an fp16 equal to absmax / 16, (code << 3) a bf16 equal to
//    absmax * 2^-116; the factor F = 16 (or 2^116) is folded into the table. fp16 absmax: F = 1.
//
// 4. Pipeline. Per-warp ring (config 0): each lane cp.async-copies exactly the words and scales it will read
//    into its warp's private ring (2..6 stages), so cp.async.wait_group alone orders it; no CTA barrier in the loop.
//    Shared-A configs: one A ring per CTA (rows padded by 16 bytes: conflict-free ldmatrix), one barrier per refill.
//    MB = 4, 8 stage their weights in per-warp shared rings; MB = 1, 2 (W_REG_STAGES > 0) load them with
//    ld.global.nc into a register ring 2-3 k-steps deep (the loop unrolled by the depth), so the loop has no weight
//    traffic through shared memory and the barrier serves A alone, refilled two k-steps per barrier.
//
// 5. Split-K. Grid split s takes k-steps [s ks_per_split, ...), cut into WARPS_K contiguous chunks, the warps of a
//    CTA summed in shared memory. k_splits > 1: every split writes its partial tile to workspace slot [tile][split];
//    after a CTA barrier thread 0 takes one acq_rel atomic on the tile's counter; the last CTA to arrive sums the
//    slots in split order (bitwise deterministic), stores C and resets the counter. The counters are zeroed once at
//    allocation; one workspace must not serve two GEMMs running concurrently. On sm_90 the shared-A configs run
//    2-split plans as 2-CTA clusters where all are resident: split 1 pushes its partial into split 0's shared memory
//    (st.async + mbarrier, push_split_k) and split 0 adds it: the same sum, without workspace or counter. With
//    WARPS_K > 1 and an odd number of k-steps the second chunk's warp multiplies by zero-filled A for its last step.
//    Consecutive calls overlap on sm_90 (programmatic dependent launch): a kernel waits (griddepcontrol.wait) before
//    its first global access and lets the next launch once its loads are issued; before the wait, one-token-tile
//    CTAs prefetch their first k-steps into L2 (a hint, harmless whatever the previous kernel writes).
//
// 6. Invariants: K_dim % 32 == 0, M, N >= 1, lda >= K_dim (launcher); tiled N padded to 16 and K to 128 with zero
//    absmax (repack); A beyond K_dim is zero-filled, A rows >= M and weight rows >= N feed only outputs that are not
//    stored; B_packed 16-byte aligned; A of any alignment and lda (16-bit load fallback). Shared memory: configs
//    0-4 <= 112 KB (two CTAs per SM), the wide ones 226 KB (sm_90; the dispatcher checks the opt-in limit).
//
// Naming: g_ global, s_ shared, r_ registers; frag_a (weights), frag_b (acts), acc.
// ============================================================================================
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <type_traits>

namespace kbit {

// ---------------------------------------------------------------------------------------------
// Tiled layout (owned here; mirrored by bitsandbytes_kbit/backends/default/tiled_layout.py)
// ---------------------------------------------------------------------------------------------
constexpr int BLOCK_ELEMS = 32;                      // quantization block along K_dim
constexpr int UNIT_ROWS = 16;                        // rows n per unit (= MMA m16)
constexpr int UNIT_K = 128;                          // k per unit (one k-step)
constexpr int UNIT_BLOCKS = UNIT_K / BLOCK_ELEMS;    // 4 quantization blocks per unit row
constexpr int UNIT_ABSMAX = UNIT_ROWS * UNIT_BLOCKS; // 64 absmax entries per unit
static_assert(UNIT_K % BLOCK_ELEMS == 0, "a unit must hold whole quantization blocks");

// Per k-bit width: how a lane's 2*K_BITS words per unit hold its 32 pair fields. pair q = 4*u + j, u = 2*blk + s (MMA
// k16 step), j = MMA register (0: row g, pair 2s; 1: row g+8, pair 2s; 2: row g, pair 2s+1; 3: row g+8, pair 2s+1). A
// pair = elements (8p+2t, 8p+2t+1) of its block: the k the MMA register fragment puts there (section 3), so every
// config reads the tokens in their own order. The pair's field is its LUT index e (FIELD_BITS = 2 K_BITS bits) at bits
// [q FIELD_BITS, + FIELD_BITS) of the lane's words read as one 64 K_BITS-bit little-endian stream (word w = stream
// bits 32w..32w+31); for k = 3, 5 a field may straddle two words (one funnel shift reads it). MMA registers 2h and 2h
// + 1 of MMA u (q = 4u + 2h): one "quad" the GEMM looks up at once into two consecutive registers.
template <int K_BITS> struct TiledFormat {
    static_assert(K_BITS >= 2 && K_BITS <= 5, "K_BITS must be 2..5");
    static constexpr int LO_BITS_PER_ELEM = K_BITS >= 4 ? 4 : 2;
    static constexpr int LO_FIELD_BITS = 2 * LO_BITS_PER_ELEM;          // 4 or 8
    static constexpr int FIELD_BITS = 2 * K_BITS;                        // one pair's LUT index
    static constexpr int PAIRS_PER_LANE = 32;                            // 2 rows x 4 blocks x 4 pairs
    static constexpr int LANE_WORDS = PAIRS_PER_LANE * FIELD_BITS / 32;  // = 2 * K_BITS
    static constexpr int LUT_ENTRIES = 1 << (2 * K_BITS);
    static constexpr int UNIT_WORDS = 32 * LANE_WORDS;                   // 64 * K_BITS
    // a lane's words are stored as NV4 uint4 chunks then (if LANE_WORDS % 4) one uint2 chunk,
    // each chunk lane-major so a warp-wide 16 (8) byte access is contiguous.
    static constexpr int NV4 = LANE_WORDS / 4;
    static constexpr int HAS_V2 = (LANE_WORDS % 4) != 0;
    static_assert(LANE_WORDS % 2 == 0, "tail chunk is one uint2");
    // k = 2: the GEMM looks up quads (QUAD_LUT). Not named QUAD: upstream's kernels.cu #defines that.
    static constexpr bool QUAD_TABLE = K_BITS == 2;
};

// word offset inside a unit of lane word lw of lane `lane`
template <int K_BITS> __host__ __device__ inline int unit_word_offset(int lane, int lw) {
    using F = TiledFormat<K_BITS>;
    return lw < 4 * F::NV4 ? (lw / 4) * 128 + lane * 4 + (lw % 4) : F::NV4 * 128 + lane * 2 + (lw - 4 * F::NV4);
}

// The fields every reader of a tiled weight has (KbitGemmParams, TiledWeight), filled in one place.
template <class W>
inline void set_tiled_weight(W& w, const void* B_packed, const void* B_absmax, const float* codebook, int codebook_len,
                             int N, int K_dim) {
    w.B = reinterpret_cast<const uint32_t*>(B_packed);
    w.B_absmax = B_absmax;
    w.codebook = codebook;
    w.codebook_len = codebook_len;
    w.N = N;
    w.K_dim = K_dim;
    w.k_steps = (K_dim + UNIT_K - 1) / UNIT_K;
    w.n16_tiles = (N + UNIT_ROWS - 1) / UNIT_ROWS;
}

constexpr bool cp_async_wait_groups_supported(int n) { return n >= 0 && n <= 5; }
__host__ __device__ constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }

// ---------------------------------------------------------------------------------------------
// Kernel configuration
// ---------------------------------------------------------------------------------------------
// SHARED_A_: the base of a KbitSharedAConfig (its own ring; the per-warp ring constants are unused)
template <int K_BITS_, int MB_, int MT_, int WARPS_N_, int WARPS_K_, bool ABS_U8_, bool SHARED_A_ = false,
          bool BLOCK_COLUMNS_ = false>
struct KbitGemmConfig {
    static constexpr int K_BITS = K_BITS_;
    static constexpr int MB = MB_;           // n8 token tiles per warp
    static constexpr int MT = MT_;           // 16-row units per warp
    static constexpr int WARPS_N = WARPS_N_; // warps along n (different rows, same k)
    static constexpr int WARPS_K = WARPS_K_; // warps along k (same rows), reduced in smem
    static constexpr bool ABS_U8 = ABS_U8_;
    using Fmt = TiledFormat<K_BITS>;

    static constexpr int WARPS = WARPS_N * WARPS_K;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int TILE_M = 8 * MB;              // tokens per CTA
    static constexpr int TILE_N = UNIT_ROWS * MT * WARPS_N; // rows n per CTA
    static constexpr int ABS_BYTES_PER_LANE = ABS_U8 ? 8 : 16; // rows g, g+8 x 4 blocks

    // per-warp ring stage: [Fmt::LANE_WORDS x 32 lanes] words per unit, then absmax
    static constexpr int STAGE_W_WORDS = MT * Fmt::UNIT_WORDS;
    static constexpr int STAGE_ABS_WORDS = MT * 32 * ABS_BYTES_PER_LANE / 4;
    // A of one k-step: [UNIT_BLOCKS][a_rows][4 chunks][16 bytes], chunk c of row r at c ^ a_chunk_swizzle(r); a_rows =
    // min(M, TILE_M) at run time.
    static constexpr bool A_IN_RING = MB == 1;
    static constexpr int A_WORDS_PER_ROW = A_IN_RING ? UNIT_BLOCKS * 16 : 0;
    // LUT: k = 3..5 a pair table (entry = one half2 / bf162), k = 2 a quad table (entry = two of them, read with one
    // LDS.64: 256 entries). Copies: one per lane (conflict-free) for k = 3, 4; 16 for the quad table (an LDS.64 is
    // served per half warp); k = 5 has 1024 entries: 4 copies (16 KB) in the per-warp configs, 8 (32 KB) in the
    // shared-A ones with weight rings in smem, 16 (64 KB) in the register- weight configs 2 and 3, whose smem holds
    // only the table and A (lanes l, l + 16 share a copy: 2-way conflicts at most, against 4-way with 8).
    static constexpr bool QUAD_LUT = Fmt::QUAD_TABLE;
    // build_lut: one entry per thread (shared-A and wgmma configs) or one 16-byte chunk per thread (per-warp configs)
    static constexpr bool LUT_BUILD_BY_ENTRY = SHARED_A_;
    static constexpr int LUT_ENTRIES = QUAD_LUT ? 256 : Fmt::LUT_ENTRIES;
    static constexpr int LUT_ENTRY_BYTES = QUAD_LUT ? 8 : 4;
    static constexpr int LUT_COPIES = QUAD_LUT ? 16 : K_BITS <= 4 ? 32 : SHARED_A_ && MB <= 2 ? 16 : SHARED_A_ ? 8 : 4;
    static constexpr int LUT_WORDS = LUT_ENTRIES * LUT_COPIES * LUT_ENTRY_BYTES / 4;
    static constexpr int LUT_STRIDE_LOG2 = ilog2(LUT_COPIES * LUT_ENTRY_BYTES); // bytes per entry (all copies)
    static_assert((1 << LUT_STRIDE_LOG2) == LUT_COPIES * LUT_ENTRY_BYTES, "LUT stride = copies x entry bytes");
    // POST_SCALE: the block scale is applied in fp32 after the MMA (per block: 2 MMAs into a zeroed fragment, then 4
    // FFMA per token tile) instead of one HMUL2 per pair (16 per block). Kept for k = 3 only.

    // BLOCK_COLUMNS (M = 1, one-tile shared-A configs): block b of a k-step is multiplied into token column b
    // (section 3), the scale applied per k-step in fp32
    static constexpr bool BLOCK_COLUMNS = BLOCK_COLUMNS_;
    static_assert(!BLOCK_COLUMNS_ || (SHARED_A_ && MB_ == 1), "block columns: one token tile, shared A");
    static constexpr bool POST_SCALE = !BLOCK_COLUMNS && MB <= 1 && K_BITS == 3;
    // E4M4 and POST_SCALE: the scale is the code's bits << 19 as an fp32 (= absmax * 2^-116, exact,
    // subnormals included), the LUT holds codebook * 16, so acc = C * 2^-112 until the store
    static constexpr float OUT_FACTOR = ABS_U8 && (POST_SCALE || BLOCK_COLUMNS) ? 5.192296858534828e33f : 1.0f; // 2^112
    // smem: two CTAs per SM (2 x (112 + 1 reserved) KB fit H100/H200's 228 KB and A100's 164 KB per
    // CTA limit); a 16-warp CTA would take the SM alone (226 KB, sm_90 only)
    static constexpr int CTAS_PER_SM = WARPS >= 16 ? 1 : 2;
    static constexpr int SMEM_BUDGET_BYTES = CTAS_PER_SM == 1 ? 226 * 1024 : 112 * 1024;
    static constexpr int SMEM_BYTES_MAX = SMEM_BUDGET_BYTES; // every launch asks for at most this
    // ring depth is chosen at launch from a_rows (fewer A rows leave room for more stages)
    static constexpr int MAX_STAGES = 6;
    static __host__ __device__ constexpr int stage_words(int a_rows) {
        return STAGE_W_WORDS + STAGE_ABS_WORDS + a_rows * A_WORDS_PER_ROW;
    }
    static __host__ __device__ constexpr int stages_for(int a_rows) {
        return (SMEM_BUDGET_BYTES / 4 - LUT_WORDS) / (WARPS * stage_words(a_rows)) > MAX_STAGES
                   ? MAX_STAGES
                   : (SMEM_BUDGET_BYTES / 4 - LUT_WORDS) / (WARPS * stage_words(a_rows));
    }
    static __host__ __device__ constexpr int smem_bytes(int a_rows) {
        return 4 * (LUT_WORDS + WARPS * stages_for(a_rows) * stage_words(a_rows));
    }
    static constexpr int STAGES = stages_for(TILE_M); // the fewest (a_rows = TILE_M)
    static_assert(STAGES >= 2 || SHARED_A_, "the ring needs at least 2 stages: shrink MT or WARPS");
    static_assert(cp_async_wait_groups_supported(MAX_STAGES - 1), "cp_async_wait_dyn covers 0..5 pending groups");
    static constexpr int RING_WORDS_MIN = WARPS * STAGES * stage_words(0);
    static constexpr int ACC_FLOATS = MT * MB * 4; // per lane
    static constexpr int RED_WORDS = (WARPS_K - 1) * WARPS_N * ACC_FLOATS * 32;
    static_assert(SHARED_A_ || RED_WORDS <= RING_WORDS_MIN, "the k-reduction buffer aliases the ring");
    static constexpr int TILE_FLOATS = WARPS_N * ACC_FLOATS * 32; // workspace slot per CTA tile
    static constexpr int MIN_CTAS_PER_SM = CTAS_PER_SM;            // caps registers (128 for 8-warp CTAs)
    static_assert(TILE_FLOATS == TILE_M * TILE_N, "a slot holds exactly one C tile");
};

// ---------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------
// cp.async 16 bytes, L2-only (weights are read once); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_16(uint32_t s_addr, const void* g_ptr) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s_addr), "l"(g_ptr));
}
// cp.async 16 bytes, reading src_bytes (0: zero fill); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_16_zfill(uint32_t s_addr, const void* g_ptr, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s_addr), "l"(g_ptr), "r"(src_bytes));
}
// cp.async 4 bytes, reading src_bytes (0: zero fill); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_4_zfill(uint32_t s_addr, const void* g_ptr, uint32_t src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s_addr), "l"(g_ptr), "r"(src_bytes));
}
// cp.async 8 bytes (.ca: .cg only takes 16); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_8(uint32_t s_addr, const void* g_ptr) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s_addr), "l"(g_ptr));
}
// close the current cp.async group; PTX ISA 9.7.9.26
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// wait until at most N cp.async groups of this thread are pending; PTX ISA 9.7.9.27
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// same with a run-time count (the ring depth is chosen at launch); the switch is warp-uniform
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
    switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    default: cp_async_wait<5>(); break;
    }
}
// Programmatic dependent launch (PTX griddepcontrol, sm_90; a no-op before sm_90 and in a plain launch)
// wait: until the grid this launch depends on has completed and its memory is visible to this one
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// the dependent launch may be scheduled once every CTA of this grid has run this (or exited)
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
// a hint: fetch `bytes` (a multiple of 16, 16-byte aligned) into L2. No value reaches the SM, so it may run
// before grid_dependency_wait even on memory the previous grid writes; PTX ISA cp.async.bulk.prefetch
__device__ __forceinline__ void prefetch_l2_bulk(const void* g_ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(g_ptr), "r"(bytes) : "memory");
#endif
}
// Thread-block clusters and mbarriers (sm_90 and later; compiled to nothing before, where no cluster is launched):
// PTX ISA 9.7.12.3 (barrier.cluster), 9.7.9.21 (mapa), 9.7.9.8 (ld.shared::cluster), 9.7.9.12 (st.async),
// 9.7.13.15 (mbarrier), 10.9 (%cluster_ctarank)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KBIT_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define KBIT_SM90_ASM(...) ((void)0)
#endif
__device__ __forceinline__ void cluster_barrier() {
    KBIT_SM90_ASM("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// the two halves of cluster_barrier, for work in between; arrive_relaxed orders nothing but the mbarrier init
// fence (fence.mbarrier_init) that precedes it
__device__ __forceinline__ void cluster_arrive_relaxed() {
    KBIT_SM90_ASM("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { KBIT_SM90_ASM("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
    KBIT_SM90_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// the address of shared-memory word s_addr of this CTA in the CTA of cluster rank `rank`
__device__ __forceinline__ uint32_t map_to_rank(uint32_t s_addr, uint32_t rank) {
    uint32_t d = 0;
    KBIT_SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(d) : "r"(s_addr), "r"(rank));
    return d;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t s_cluster_addr) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    KBIT_SM90_ASM("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                  : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                  : "r"(s_cluster_addr)
                  : "memory");
    return v;
}
// 16 bytes into another CTA's shared memory, completing 16 bytes of the transaction count of its mbarrier
// s_cluster_bar (both addresses: map_to_rank)
__device__ __forceinline__ void st_async_f32x4(uint32_t s_cluster_addr, float a, float b, float c, float d,
                                               uint32_t s_cluster_bar) {
    KBIT_SM90_ASM("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                      s_cluster_addr),
                  "f"(a), "f"(b), "f"(c), "f"(d), "r"(s_cluster_bar)
                  : "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    KBIT_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// the inits of this thread visible to the cluster's other CTAs (before their first remote arrive or st.async)
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
    KBIT_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    KBIT_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// wait for phase `parity` of mbarrier bar, acquiring at cluster scope what other CTAs released into it
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulate, A and B of type T (the tag argument picks the
// overload; the two differ only in the PTX type); PTX ISA 9.7.14.5.8
#define KBIT_DEFINE_MMA_M16N8K16(T, PTX_TYPE)                                                                    \
    __device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, \
                                                 T) {                                                            \
        asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "  \
            "{%8,%9}, {%0,%1,%2,%3};\n"                                                                          \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                     \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                     \
    }
KBIT_DEFINE_MMA_M16N8K16(__half, "f16")
KBIT_DEFINE_MMA_M16N8K16(__nv_bfloat16, "bf16")
#undef KBIT_DEFINE_MMA_M16N8K16
// 32-bit shared load at a byte address; not volatile: the LUT is read-only after its barrier and the
// address depends on ring data, so the load cannot move above either; PTX ISA 9.7.9.8
__device__ __forceinline__ uint32_t lds32(uint32_t s_addr) {
    uint32_t v;
    asm("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(s_addr));
    return v;
}

// 64-bit shared load (a quad LUT entry), same ordering argument as lds32; PTX ISA 9.7.9.8
__device__ __forceinline__ uint2 lds64(uint32_t s_addr) {
    uint2 v;
    asm("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(s_addr));
    return v;
}

// atomic add with release (this thread's writes, and those ordered before it by a CTA barrier) and acquire
// semantics at GPU scope; returns the old value. PTX ISA 9.7.13.5 (atom), 8.10 (release/acquire patterns)
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* addr, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(addr), "r"(v) : "memory");
    return old;
}

// 16-byte shared store; PTX ISA 9.7.9.9
__device__ __forceinline__ void sts128(uint32_t s_addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(s_addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
// 8 consecutive 16-bit A values where A may be misaligned (lda % 8 != 0 or an offset view): eight
// 2-byte loads packed pairwise, the layout a 16-byte load would give
__device__ __forceinline__ uint4 ldg_a_unaligned(const unsigned short* src) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)__ldg(src + 2 * i) | ((uint32_t)__ldg(src + 2 * i + 1) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---------------------------------------------------------------------------------------------
// Small type helpers
// ---------------------------------------------------------------------------------------------
template <typename T> struct Pack2;
template <> struct Pack2<__half> {
    static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
        __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ float to_float(const __half v) { return __half2float(v); }
    static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
    static __device__ __forceinline__ uint32_t dup_lo(uint32_t a) { // {a.lo, a.lo}
        __half2 r = __low2half2(*reinterpret_cast<__half2*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ uint32_t dup_hi(uint32_t a) { // {a.hi, a.hi}
        __half2 r = __high2half2(*reinterpret_cast<__half2*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static constexpr int E4M4_SHIFT = 6;          // (code << 6) as fp16 == absmax / 16
    static constexpr float E4M4_LUT_FACTOR = 16.0f;
};
template <> struct Pack2<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
        __nv_bfloat162 r =
            __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ float to_float(const __nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
    static __device__ __forceinline__ uint32_t dup_lo(uint32_t a) {
        __nv_bfloat162 r = __low2bfloat162(*reinterpret_cast<__nv_bfloat162*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ uint32_t dup_hi(uint32_t a) {
        __nv_bfloat162 r = __high2bfloat162(*reinterpret_cast<__nv_bfloat162*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static constexpr int E4M4_SHIFT = 3;                    // (code << 3) as bf16 == absmax * 2^-116
    static constexpr float E4M4_LUT_FACTOR = 8.3076749736557242e34f; // 2^116
};

// decode LUT index e -> the two codebook indices (see TiledFormat)
template <int K_BITS> __host__ __device__ inline void lut_index_to_pair(int e, int& i0, int& i1) {
    using F = TiledFormat<K_BITS>;
    const int lo = e & ((1 << F::LO_FIELD_BITS) - 1);
    const int hi = e >> F::LO_FIELD_BITS;
    const int lo_mask = (1 << F::LO_BITS_PER_ELEM) - 1;
    i0 = (lo & lo_mask) | ((hi & 1) << F::LO_BITS_PER_ELEM);
    i1 = (lo >> F::LO_BITS_PER_ELEM) | (((hi >> 1) & 1) << F::LO_BITS_PER_ELEM);
}

// ---------------------------------------------------------------------------------------------
// Repack kernels: flat (checkpoint) format -> tiled. One thread per tiled word / absmax entry.
// ---------------------------------------------------------------------------------------------
// which element (row offset in unit, k offset in unit) and index bit a tiled bit holds
template <int K_BITS>
__host__ __device__ inline void tiled_bit_source(int lane, int lw, int bit, int& row, int& kk, int& ibit) {
    using F = TiledFormat<K_BITS>;
    const int pos = 32 * lw + bit; // in the lane's bit stream
    const int q = pos / F::FIELD_BITS, x = pos % F::FIELD_BITS;
    int elem;
    if (x < F::LO_FIELD_BITS) {
        elem = x / F::LO_BITS_PER_ELEM;
        ibit = x % F::LO_BITS_PER_ELEM;
    } else {
        elem = x - F::LO_FIELD_BITS;
        ibit = F::LO_BITS_PER_ELEM;
    }
    const int u = q / 4, j = q % 4;
    const int blk = u / 2, s = u % 2;
    const int half = j & 1, pair = 2 * s + (j >> 1);
    const int g = lane / 4, t = lane % 4;
    row = g + 8 * half;
    kk = blk * BLOCK_ELEMS + 8 * pair + 2 * t + elem;
}

template <int K_BITS>
__global__ void kbit_repack_words_kernel(const uint32_t* __restrict__ g_packed_flat, uint32_t* __restrict__ g_tiled,
                                         int N, int K_dim, int k_steps, long long total_words) {
    using F = TiledFormat<K_BITS>;
    const long long w = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (w >= total_words) return;
    const long long unit = w / F::UNIT_WORDS;
    const int off = (int)(w % F::UNIT_WORDS);
    // invert unit_word_offset
    int lane, lw;
    if (off < F::NV4 * 128) {
        lw = (off / 128) * 4 + (off % 4);
        lane = (off % 128) / 4;
    } else {
        const int o = off - F::NV4 * 128;
        lane = o / 2;
        lw = 4 * F::NV4 + o % 2;
    }
    const long long n16 = unit / k_steps;
    const int kstep = (int)(unit % k_steps);
    uint32_t word = 0;
    for (int bit = 0; bit < 32; bit++) {
        int row, kk, ibit;
        tiled_bit_source<K_BITS>(lane, lw, bit, row, kk, ibit);
        const long long n = n16 * UNIT_ROWS + row;
        const long long k = (long long)kstep * UNIT_K + kk;
        if (n >= N || k >= K_dim) continue;
        const long long flat = n * K_dim + k;
        const long long block = flat / BLOCK_ELEMS;
        const int j = (int)(flat % BLOCK_ELEMS);
        const uint32_t plane = g_packed_flat[block * K_BITS + ibit];
        word |= ((plane >> j) & 1u) << bit;
    }
    g_tiled[w] = word;
}

template <typename AbsT>
__global__ void kbit_repack_absmax_kernel(const AbsT* __restrict__ g_absmax_flat, AbsT* __restrict__ g_absmax_tiled,
                                          int N, int K_dim, int k_steps, long long total) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long unit = i / UNIT_ABSMAX;
    const int off = (int)(i % UNIT_ABSMAX); // [g 0..7][half 0..1][blk 0..3]
    const int g = off / 8, half = (off / 4) % 2, blk = off % 4;
    const long long n = (unit / k_steps) * UNIT_ROWS + g + 8 * half;
    const long long k = (unit % k_steps) * UNIT_K + blk * BLOCK_ELEMS;
    AbsT v;
    memset(&v, 0, sizeof(v));
    if (n < N && k < K_dim) v = g_absmax_flat[(n * K_dim + k) / BLOCK_ELEMS];
    g_absmax_tiled[i] = v;
}

// ---------------------------------------------------------------------------------------------
// Fused dequant + GEMM
// ---------------------------------------------------------------------------------------------
struct KbitGemmParams {
    const void* A;          // [M, lda] fp16/bf16
    const uint32_t* B;      // tiled words
    const void* B_absmax;   // tiled absmax (uint8 E4M4 or fp16)
    const float* codebook;  // [codebook_len]
    int codebook_len;
    const void* bias;       // [N] or nullptr
    void* C;                // [M, N]
    float* partials;        // workspace slots (k_splits > 1)
    int* counters;          // workspace tile counters (k_splits > 1)
    int M, N, K_dim, lda;
    int k_steps;            // K_pad / UNIT_K
    int n16_tiles;          // N_pad / UNIT_ROWS
    int k_splits, ks_per_split;
    int a_vec_ok;           // A 16-byte aligned and lda % 8 == 0
    int a_rows;             // token rows of A staged per k-step: min(M, TILE_M)
    int cluster_reduce;     // the k_splits CTAs of a tile are one cluster and reduce through DSMEM (config 6;
                            // shared-A: pairs of splits as 2-CTA clusters, push_split_k)
    int ws_tail_from;       // config 7 without k_splits: tiles from here on run as two CTAs of half the k-steps
    int ws_multicast;       // config 7: clusters of 2 CTAs share the token tile (TMA multicast)
    int l2_prefetch_steps;  // shared-A configs: k-steps of each warp's split prefetched into L2 before the PDL wait
};

// build the duplicated LUT: entry e (all copies) at byte e << LUT_STRIDE_LOG2, copy c at + c * LUT_ENTRY_BYTES. The
// codebook sits one entry per lane (read with shfl); each thread computes its entry once (2 shuffles, 4 for a quad)
// and writes 16 bytes (4 pair copies, or 2 quad copies) per store. The lane's codebook entry (0 past the end). Config
// 3 (M <= 16) keeps the late load: early, ptxas rematerialized a thread index in its loop and 28672 x 8192 M = 16 ran
// 9-14% slower. The load is predicated, and ptxas multiplies the entry by the LUT factor right after it, so each warp
// waits for the codebook before it issues A and its weights: the L2 prefetch of the first k-steps gets that head
// start. An unpredicated load (select and multiply in build_lut) issues them at once and was 5-10% slower.
__device__ __forceinline__ float load_codebook_entry(const KbitGemmParams& p) {
    const int lane = threadIdx.x % 32;
    return lane < p.codebook_len ? __ldg(p.codebook + lane) : 0.0f;
}

// cb_entry: the lane's load_codebook_entry when EARLY_CODEBOOK, else unused (loaded here)
template <class Cfg, typename T, bool EARLY_CODEBOOK>
__device__ void build_lut(uint32_t* s_lut, float cb_entry, const KbitGemmParams& p) {
    const float factor = !Cfg::ABS_U8 ? 1.0f : Cfg::POST_SCALE || Cfg::BLOCK_COLUMNS ? 16.0f : Pack2<T>::E4M4_LUT_FACTOR;
    const float r_cb = (EARLY_CODEBOOK ? cb_entry : load_codebook_entry(p)) * factor;
    const auto pair_value = [&](int pair_index) { // {cb[i0], cb[i1]} * factor; every lane must call it
        int i0, i1;
        lut_index_to_pair<Cfg::K_BITS>(pair_index, i0, i1);
        return Pack2<T>::from_floats(__shfl_sync(0xffffffffu, r_cb, i0), __shfl_sync(0xffffffffu, r_cb, i1));
    };
    constexpr int CHUNKS_PER_ENTRY = Cfg::LUT_COPIES * Cfg::LUT_ENTRY_BYTES / 16;
    const auto entry_value = [&](int e) { // every lane must call it (pair_value shuffles)
        if constexpr (Cfg::QUAD_LUT) { // quad e = pair (e & 15) then pair (e >> 4): two MMA registers
            const uint32_t lo = pair_value(e & 15), hi = pair_value(e >> 4);
            return make_uint4(lo, hi, lo, hi);
        } else {
            const uint32_t pv = pair_value(e);
            return make_uint4(pv, pv, pv, pv);
        }
    };
    if constexpr (!Cfg::LUT_BUILD_BY_ENTRY) { // each 16-byte chunk computes its entry (per-warp configs, below)
        constexpr int CHUNKS = Cfg::LUT_WORDS / 4;
        static_assert(CHUNKS % 32 == 0 && Cfg::THREADS % 32 == 0, "a warp's lanes all run the last round or none");
#pragma unroll 4
        for (int x = threadIdx.x; x < CHUNKS; x += Cfg::THREADS) {
            const int e = x / CHUNKS_PER_ENTRY;
            const int c = (x + e) % CHUNKS_PER_ENTRY;
            reinterpret_cast<uint4*>(s_lut)[e * CHUNKS_PER_ENTRY + c] = entry_value(e);
        }
    } else {
        // TPE threads per entry (a power of 2: one round where the threads outnumber the entries) compute the
        // entry once and store CHUNKS_PER_ENTRY / TPE of its 16-byte chunks each, rotated so that the 8 lanes of a
        // store phase hit distinct 16-byte bank groups
        constexpr int ENTRIES = Cfg::LUT_ENTRIES;
        constexpr int THREADS_PER_ENTRY_MAX = Cfg::THREADS / ENTRIES; // 0 where the entries outnumber the threads
        constexpr int TPE =
            1 << ilog2(THREADS_PER_ENTRY_MAX < CHUNKS_PER_ENTRY ? THREADS_PER_ENTRY_MAX : CHUNKS_PER_ENTRY);
        constexpr int CHUNKS_PER_THREAD = CHUNKS_PER_ENTRY / TPE;
        constexpr int ROUNDS = (ENTRIES * TPE + Cfg::THREADS - 1) / Cfg::THREADS;
        constexpr int ENTRIES_PER_PHASE = CHUNKS_PER_ENTRY < 8 ? 8 / CHUNKS_PER_ENTRY : 1; // entries of a 128-B row
        static_assert(CHUNKS_PER_ENTRY % TPE == 0 && Cfg::THREADS % 32 == 0, "whole chunks per thread; whole warps");
#pragma unroll
        for (int r = 0; r < ROUNDS; r++) {
            const int idx = r * Cfg::THREADS + (int)threadIdx.x;
            const int e = idx / TPE, part = idx % TPE;
            const uint4 v = entry_value(e < ENTRIES ? e : 0); // every lane shuffles
            if (e < ENTRIES) {
#pragma unroll
                for (int j = 0; j < CHUNKS_PER_THREAD; j++) {
                    const int c = (part * CHUNKS_PER_THREAD + j + e / ENTRIES_PER_PHASE) % CHUNKS_PER_ENTRY;
                    reinterpret_cast<uint4*>(s_lut)[e * CHUNKS_PER_ENTRY + c] = v;
                }
            }
        }
    }
}

// Per-lane global read positions of one warp's stream, advanced by one k-step per call (pointer
// increments only: recomputing unit indices per step cost ~40% of the loop's instructions, H200 SASS).
template <class Cfg> struct StreamCursor {
    const uint32_t* g_w[Cfg::MT];     // this lane's first uint4 chunk of unit (n16_base + mt, kstep)
    const char* g_abs[Cfg::MT];       // this lane's absmax bytes of that unit
    const unsigned short* g_a;        // A: row m_base + g, k = kstep * 128 + 8t (MB == 1 ring path)
    int k_a;                          // k of g_a (block 0), for the K_dim zero fill
    uint32_t valid_mt;                // bit mt: unit row exists (n16 < n16_tiles)
    bool a_row_ok;                    // A row exists (m < M and row < a_rows)

    __device__ __forceinline__ void init(const KbitGemmParams& p, int n16_base, int m_base, int kstep, int lane) {
        using F = typename Cfg::Fmt;
        valid_mt = 0;
#pragma unroll
        for (int mt = 0; mt < Cfg::MT; mt++) {
            const int n16 = n16_base + mt;
            valid_mt |= (n16 < p.n16_tiles ? 1u : 0u) << mt;
            const long long unit = (long long)min(n16, p.n16_tiles - 1) * p.k_steps + kstep;
            g_w[mt] = p.B + unit * F::UNIT_WORDS + lane * 4;
            g_abs[mt] = reinterpret_cast<const char*>(p.B_absmax) +
                        (unit * UNIT_ABSMAX + (lane / 4) * 8) * (Cfg::ABS_U8 ? 1 : 2);
        }
        const int g = lane / 4, t = lane % 4;
        const int m = m_base + g;
        a_row_ok = g < p.a_rows && m < p.M;
        k_a = kstep * UNIT_K + 8 * t;
        g_a = reinterpret_cast<const unsigned short*>(p.A) + (long long)min(m, p.M - 1) * p.lda + k_a;
    }
    __device__ __forceinline__ void advance() {
#pragma unroll
        for (int mt = 0; mt < Cfg::MT; mt++) {
            g_w[mt] += Cfg::Fmt::UNIT_WORDS;
            g_abs[mt] += UNIT_ABSMAX * (Cfg::ABS_U8 ? 1 : 2);
        }
        g_a += UNIT_K;
        k_a += UNIT_K;
    }
};

// issue the cp.async copies of one k-step (MT units: weights + absmax) into ring stage s_stage
template <class Cfg>
__device__ __forceinline__ void load_stage_async(uint32_t s_stage, const StreamCursor<Cfg>& cur, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        if (!((cur.valid_mt >> mt) & 1)) continue; // warp-uniform; stale stage data only feeds unstored rows
        const uint32_t s_unit = s_stage + 4 * (mt * F::UNIT_WORDS + lane * 4);
#pragma unroll
        for (int c = 0; c < F::NV4; c++) cp_async_16(s_unit + 4 * c * 128, cur.g_w[mt] + c * 128);
        if (F::HAS_V2) // tail chunk: lane*2 instead of lane*4
            cp_async_8(s_unit + 4 * (F::NV4 * 128 - lane * 2), cur.g_w[mt] + F::NV4 * 128 - lane * 2);
        const uint32_t s_abs = s_stage + 4 * Cfg::STAGE_W_WORDS + (mt * 32 + lane) * Cfg::ABS_BYTES_PER_LANE;
        if (Cfg::ABS_U8) cp_async_8(s_abs, cur.g_abs[mt]);
        else cp_async_16(s_abs, cur.g_abs[mt]);
    }
}

// Per-warp A slot (configs 0, MB == 1): chunk c (k 8c..8c+7) of token row r of a block sits at chunk c ^ this, so
// the 8 rows of an ldmatrix phase (64 bytes apart) read distinct banks
__device__ __forceinline__ int a_chunk_swizzle(int row) { return (row >> 1) & 3; }

// A of one k-step into the stage (MB == 1): lane (g, t) copies chunk t (k 8t..8t+7) of each block of token row g;
// the warp reads them with ldmatrix after a __syncwarp (load_b_fragments). k >= K_dim is zero-filled (padded
// weights are 0 and 0 * garbage could be NaN); rows >= M are skipped: they only feed unstored columns.
template <class Cfg>
__device__ __forceinline__ void load_a_async(uint32_t s_a, const StreamCursor<Cfg>& cur, const KbitGemmParams& p,
                                             int lane) {
    static_assert(Cfg::MB == 1, "the ring holds A only for one token tile");
    if (!cur.a_row_ok) return;
    const int g = lane / 4, t = lane % 4;
    const uint32_t s_row = s_a + (g * 4 + (t ^ a_chunk_swizzle(g))) * 16;
    if (p.a_vec_ok && cur.k_a + (UNIT_K - 8 * t) <= p.K_dim) { // whole k-step inside K_dim (all but maybe the last)
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++) cp_async_16(s_row + blk * p.a_rows * 64, cur.g_a + blk * BLOCK_ELEMS);
        return;
    }
#pragma unroll
    for (int blk = 0; blk < UNIT_BLOCKS; blk++) {
        const uint32_t s_dst = s_row + blk * p.a_rows * 64;
        const bool in_k = cur.k_a + blk * BLOCK_ELEMS < p.K_dim;
        const unsigned short* src = in_k ? cur.g_a + blk * BLOCK_ELEMS : cur.g_a;
        if (p.a_vec_ok) {
            cp_async_16_zfill(s_dst, src, in_k ? 16u : 0u);
        } else { // A misaligned: 16-bit loads, then a plain store (ordered for the warp by the same __syncwarp)
            sts128(s_dst, in_k ? ldg_a_unaligned(src) : make_uint4(0, 0, 0, 0));
        }
    }
}

// 4 x 4 transpose of 32-bit words among the lanes of a quad: lane t's a[j] becomes lane j's a[t]. Two shuffle rounds,
// each swapping the 2 x 2 blocks (xor 2) or the words inside them (xor 1) that differ from the lane in that bit.
__device__ __forceinline__ void quad_transpose_words(uint32_t (&a)[4], int t) {
#pragma unroll
    for (int m = 2; m >= 1; m /= 2) {
        const bool hi = t & m;
        const int i0 = 0, i1 = m == 2 ? 1 : 2; // the two words whose index has bit m clear
        const uint32_t r0 = __shfl_xor_sync(0xffffffffu, hi ? a[i0] : a[i0 + m], m);
        const uint32_t r1 = __shfl_xor_sync(0xffffffffu, hi ? a[i1] : a[i1 + m], m);
        if (hi) a[i0] = r0, a[i1] = r1;
        else a[i0 + m] = r0, a[i1 + m] = r1;
    }
}
__device__ __forceinline__ void quad_transpose_words(uint4& v, int t) {
    uint32_t a[4] = {v.x, v.y, v.z, v.w};
    quad_transpose_words(a, t);
    v = make_uint4(a[0], a[1], a[2], a[3]);
}

// A_IN_RING == false: A of one k-step straight into registers (L1 shared by the warps): 16-byte chunk t (k 8t..8t+7)
// of each block of token g; quad_transpose_words then makes them the B fragments (words at k 8j + 2t, j = 0..3), as
// ldmatrix_b_frags would give them.
template <class Cfg>
__device__ __forceinline__ void load_a_registers(uint4 (&r_a)[UNIT_BLOCKS][Cfg::MB], const KbitGemmParams& p,
                                                 int m_base, int kstep, int lane) {
    const int g = lane / 4, t = lane % 4;
    const unsigned short* g_A = reinterpret_cast<const unsigned short*>(p.A);
#pragma unroll
    for (int mb = 0; mb < Cfg::MB; mb++) {
        const int m = m_base + mb * 8 + g;
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++) {
            const int k = kstep * UNIT_K + blk * BLOCK_ELEMS;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (m < p.M && k < p.K_dim) {
                const unsigned short* src = g_A + (long long)m * p.lda + k + 8 * t;
                v = p.a_vec_ok ? __ldg(reinterpret_cast<const uint4*>(src)) : ldg_a_unaligned(src);
            }
            r_a[blk][mb] = v;
        }
    }
}

// The B fragments of one block for 8 tokens: the four 8 x 8 matrices (tokens x k 8j..8j+7, j = 0..3) whose row
// addresses lanes 8j..8j+7 give. Lane (g, t) gets token g, k 8j + 2t, +1 in register j: b0, b1 of k16 step 0, then
// of step 1 (section 3). PTX ISA 9.7.14.5.15 (ldmatrix)
__device__ __forceinline__ void ldmatrix_b_frags(uint4& r, uint32_t s_row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "r"(s_row_addr));
}

// 128-bit shared load of ring data (A), ordered like ldmatrix_b_frags (volatile: the ring is rewritten between
// barriers); PTX ISA 9.7.9.8
__device__ __forceinline__ uint4 lds128_ring(uint32_t s_addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(s_addr));
    return v;
}

// B-operand (activation) fragments of one block from the stage: b0,b1 of k16 step 0 = .x,.y, step 1 = .z,.w
template <class Cfg>
__device__ __forceinline__ void load_b_fragments(uint4 (&r_a)[Cfg::MB], uint32_t s_a, int a_rows, int blk, int lane) {
    const int chunk = lane / 8;
#pragma unroll
    for (int mb = 0; mb < Cfg::MB; mb++) {
        // rows >= a_rows only feed unstored columns: read a valid row instead of out of range
        const int row = min(mb * 8 + lane % 8, a_rows - 1);
        ldmatrix_b_frags(r_a[mb], s_a + ((blk * a_rows + row) * 4 + (chunk ^ a_chunk_swizzle(row))) * 16);
    }
}

template <class Cfg> __device__ __forceinline__ void zero_acc(float (&acc)[Cfg::MT][Cfg::MB][4]) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[mt][mb][r] = 0.0f;
}

// this lane's 2*K_BITS words of the unit at s_unit (lane-major 16-byte chunks, then 8-byte ones, as in global)
template <class Cfg>
__device__ __forceinline__ void lds_unit_words(uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS], uint32_t s_unit, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int c = 0; c < F::NV4; c++)
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r_w[4 * c]), "=r"(r_w[4 * c + 1]), "=r"(r_w[4 * c + 2]), "=r"(r_w[4 * c + 3])
                     : "r"(s_unit + 4 * (c * 128 + lane * 4)));
    if constexpr (F::HAS_V2)
        asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n"
                     : "=r"(r_w[4 * F::NV4]), "=r"(r_w[4 * F::NV4 + 1])
                     : "r"(s_unit + 4 * (F::NV4 * 128 + lane * 2)));
}

// ... and back (kbit_gemm_wgmma_ws.cuh: the weight transpose in shared memory)
template <class Cfg>
__device__ __forceinline__ void sts_unit_words(const uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS], uint32_t s_unit, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int c = 0; c < F::NV4; c++)
        sts128(s_unit + 4 * (c * 128 + lane * 4), make_uint4(r_w[4 * c], r_w[4 * c + 1], r_w[4 * c + 2], r_w[4 * c + 3]));
    if constexpr (F::HAS_V2)
        asm volatile("st.shared.v2.b32 [%0], {%1,%2};\n" ::"r"(s_unit + 4 * (F::NV4 * 128 + lane * 2)), "r"(r_w[4 * F::NV4]),
                     "r"(r_w[4 * F::NV4 + 1]));
}

// this lane's absmax of rows g, g + 8 (8 bytes of E4M4 or 16 of fp16) at s_abs
template <class Cfg>
__device__ __forceinline__ void lds_unit_absmax(uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], uint32_t s_abs) {
    if constexpr (Cfg::ABS_U8)
        asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(r_abs[0]), "=r"(r_abs[1]) : "r"(s_abs));
    else
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r_abs[0]), "=r"(r_abs[1]), "=r"(r_abs[2]), "=r"(r_abs[3])
                     : "r"(s_abs));
}

// this lane's 2*K_BITS words and absmax bytes of unit mt of a ring stage (the layout load_stage_async wrote)
template <class Cfg>
__device__ __forceinline__ void read_unit_from_stage(uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS],
                                                     uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], uint32_t s_stage,
                                                     int mt, int lane) {
    lds_unit_words<Cfg>(r_w, s_stage + 4 * mt * Cfg::Fmt::UNIT_WORDS, lane);
    lds_unit_absmax<Cfg>(r_abs, s_stage + 4 * Cfg::STAGE_W_WORDS + (mt * 32 + lane) * Cfg::ABS_BYTES_PER_LANE);
}

// scale pair {s, s} for (half, blk) of one unit, as the compute dtype; the E4M4 factor is in the LUT.
// E4M4: the 4 codes of a row half sit in one word (byte b = block b); a rotation by E4M4_SHIFT and one mask turn it
// into the half2 {s0, s2} (bytes 0, 2 at bits SH.. and 16 + SH..), a rotation the other way into {s1, s3}, and
// each scale is the low or high half of one of them, broadcast (a .H0_H0 / .H1_H1 operand of the HMUL2, no
// instruction). The rotations are shared by the 4 blocks: 4 instructions per row half instead of a PRMT (dup) and
// a shift per block.
template <class Cfg, typename T>
__device__ __forceinline__ uint32_t scale_pair(const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], int idx) {
    if constexpr (Cfg::ABS_U8) {
        constexpr int SH = Pack2<T>::E4M4_SHIFT;
        constexpr uint32_t MASK = (0xFFu << SH) * 0x10001u;
        const uint32_t word = r_abs[idx / 4];
        const int b = idx % 4;
        const uint32_t pairs = b % 2 == 0 ? __funnelshift_l(word, word, SH) & MASK   // {s0, s2}
                                          : __funnelshift_r(word, word, 8 - SH) & MASK; // {s1, s3}
        return b < 2 ? Pack2<T>::dup_lo(pairs) : Pack2<T>::dup_hi(pairs);
    } else {
        const uint32_t word = r_abs[idx / 2];
        if constexpr (sizeof(T) == 2 && std::is_same<T, __half>::value) {
            return __byte_perm(word, 0u, (idx % 2) ? 0x3232u : 0x1010u);
        } else {
            const uint32_t hbits = (idx % 2) ? (word >> 16) : (word & 0xffffu);
            const float f = __half2float(__ushort_as_half((unsigned short)hbits));
            return Pack2<T>::from_floats(f, f);
        }
    }
}

// LUT byte address of pair q of a lane (q compile-time after unrolling): one shift (a funnel shift where the
// field straddles two words) moves field bit 0 to bit LS, one LOP3 masks it and adds the lane's copy
template <class Cfg, int Q> __device__ __forceinline__ uint32_t lut_addr(const uint32_t* r_w, uint32_t lane_off) {
    using F = typename Cfg::Fmt;
    constexpr int LS = Cfg::LUT_STRIDE_LOG2;
    constexpr int POS = Q * F::FIELD_BITS;
    constexpr int W = POS / 32, B = POS % 32; // field bit 0 = bit B of word W
    constexpr uint32_t MASK = ((1u << F::FIELD_BITS) - 1) << LS;
    uint32_t x;
    if constexpr (B + F::FIELD_BITS > 32) { // straddles: B > 32 - FIELD_BITS >= 22 > LS
        static_assert(B >= LS, "a straddling field shifts right");
        x = __funnelshift_r(r_w[W], r_w[W + 1], B - LS);
    } else {
        x = B >= LS ? r_w[W] >> (B >= LS ? B - LS : 0) : r_w[W] << (B < LS ? LS - B : 0);
    }
    return (x & MASK) | lane_off;
}

// the block scale of (half, blk) as an fp32 (POST_SCALE): E4M4 = the code's bits << 19 (absmax * 2^-116,
// OUT_FACTOR restores it at the store); fp16 absmax converted exactly
template <class Cfg>
__device__ __forceinline__ float scale_f32(const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], int idx) {
    if constexpr (Cfg::ABS_U8) {
        const uint32_t word = r_abs[idx / 4];
        const int sh = 19 - 8 * (idx % 4);
        return __uint_as_float((sh >= 0 ? word << sh : word >> -sh) & (0xFFu << 19));
    } else {
        const uint32_t word = r_abs[idx / 2];
        return __half2float(__ushort_as_half((unsigned short)((idx % 2) ? word >> 16 : word & 0xffffu)));
    }
}

// quad LUT byte address of quad R = 2u + h of a lane (k = 2: pairs 4u + 2h, + 1): byte R % 4 of lo word R / 4
template <class Cfg, int R> __device__ __forceinline__ uint32_t quad_lut_addr(const uint32_t* r_w, uint32_t lane_off) {
    constexpr int LS = Cfg::LUT_STRIDE_LOG2;
    constexpr int SH = 8 * (R % 4) - LS;
    const uint32_t w = r_w[R / 4];
    return ((SH >= 0 ? w >> (SH >= 0 ? SH : 0) : w << (SH < 0 ? -SH : 0)) & (0xFFu << LS)) | lane_off;
}

// the unscaled A-operand fragment (codebook values, times the LUT factor) of MMA u = 2*blk + s of a unit
template <class Cfg, int U>
__device__ __forceinline__ void lookup_frag_a(uint32_t (&frag_a)[4], const uint32_t* r_w, uint32_t s_lut,
                                              uint32_t lane_off) {
    if constexpr (Cfg::QUAD_LUT) { // quad 2U + h = registers 2h, 2h + 1: consecutive, no moves for the MMA
        const uint2 q0 = lds64(s_lut + quad_lut_addr<Cfg, 2 * U>(r_w, lane_off));
        const uint2 q1 = lds64(s_lut + quad_lut_addr<Cfg, 2 * U + 1>(r_w, lane_off));
        frag_a[0] = q0.x;
        frag_a[1] = q0.y;
        frag_a[2] = q1.x;
        frag_a[3] = q1.y;
    } else {
        frag_a[0] = lds32(s_lut + lut_addr<Cfg, 4 * U + 0>(r_w, lane_off));
        frag_a[1] = lds32(s_lut + lut_addr<Cfg, 4 * U + 1>(r_w, lane_off));
        frag_a[2] = lds32(s_lut + lut_addr<Cfg, 4 * U + 2>(r_w, lane_off));
        frag_a[3] = lds32(s_lut + lut_addr<Cfg, 4 * U + 3>(r_w, lane_off));
    }
}

// the scaled A-operand fragments of quantization block BLK (MMAs u = 2 BLK, 2 BLK + 1) of one unit
template <class Cfg, typename T, int BLK>
__device__ __forceinline__ void dequant_block(uint32_t (&frag0)[4], uint32_t (&frag1)[4], const uint32_t* r_w,
                                              const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], uint32_t s_lut,
                                              uint32_t lane_off) {
    lookup_frag_a<Cfg, 2 * BLK>(frag0, r_w, s_lut, lane_off);
    lookup_frag_a<Cfg, 2 * BLK + 1>(frag1, r_w, s_lut, lane_off);
    const uint32_t sc_g = scale_pair<Cfg, T>(r_abs, BLK), sc_g8 = scale_pair<Cfg, T>(r_abs, 4 + BLK);
#pragma unroll
    for (int j = 0; j < 4; j++) { // register j: row g (j even) or g + 8 (j odd)
        frag0[j] = Pack2<T>::mul(frag0[j], (j & 1) ? sc_g8 : sc_g);
        frag1[j] = Pack2<T>::mul(frag1[j], (j & 1) ? sc_g8 : sc_g);
    }
}

// dequant + MMAs of quantization block BLK (MMAs u = 2 BLK, 2 BLK + 1) of one unit, for MB token tiles
// whose B fragments are r_b[mb] (.x, .y: k16 step 0; .z, .w: step 1)
template <class Cfg, typename T, int BLK>
__device__ __forceinline__ void block_mma(float (&acc)[Cfg::MB][4], const uint32_t* r_w,
                                          const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4],
                                          const uint4 (&r_b)[Cfg::MB], uint32_t s_lut, uint32_t lane_off) {
    uint32_t frag0[4], frag1[4];
    if constexpr (Cfg::POST_SCALE) {
        lookup_frag_a<Cfg, 2 * BLK>(frag0, r_w, s_lut, lane_off);
        lookup_frag_a<Cfg, 2 * BLK + 1>(frag1, r_w, s_lut, lane_off);
        const float s_g = scale_f32<Cfg>(r_abs, BLK), s_g8 = scale_f32<Cfg>(r_abs, 4 + BLK);
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_m16n8k16(d, frag0, r_b[mb].x, r_b[mb].y, T());
            mma_m16n8k16(d, frag1, r_b[mb].z, r_b[mb].w, T());
            acc[mb][0] = fmaf(s_g, d[0], acc[mb][0]); // d0, d1: row g; d2, d3: row g + 8
            acc[mb][1] = fmaf(s_g, d[1], acc[mb][1]);
            acc[mb][2] = fmaf(s_g8, d[2], acc[mb][2]);
            acc[mb][3] = fmaf(s_g8, d[3], acc[mb][3]);
        }
    } else {
        dequant_block<Cfg, T, BLK>(frag0, frag1, r_w, r_abs, s_lut, lane_off);
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++) {
            mma_m16n8k16(acc[mb], frag0, r_b[mb].x, r_b[mb].y, T());
            mma_m16n8k16(acc[mb], frag1, r_b[mb].z, r_b[mb].w, T());
        }
    }
}

// dequant + MMA of one k-step held in ring stage s_stage
template <class Cfg, typename T>
__device__ __forceinline__ void compute_stage(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t s_stage, uint32_t s_lut,
                                              uint32_t lane_off, int a_rows, const uint4 (&r_a_regs)[UNIT_BLOCKS][Cfg::MB],
                                              int lane) {
    using F = typename Cfg::Fmt;
    uint4 r_a[UNIT_BLOCKS][Cfg::MB];
    if constexpr (Cfg::A_IN_RING) {
        const uint32_t s_a = s_stage + 4 * (Cfg::STAGE_W_WORDS + Cfg::STAGE_ABS_WORDS);
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++) load_b_fragments<Cfg>(r_a[blk], s_a, a_rows, blk, lane);
    } else {
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++)
#pragma unroll
            for (int mb = 0; mb < Cfg::MB; mb++) r_a[blk][mb] = r_a_regs[blk][mb];
    }
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        uint32_t r_w[F::LANE_WORDS];
        uint32_t r_abs[Cfg::ABS_BYTES_PER_LANE / 4];
        read_unit_from_stage<Cfg>(r_w, r_abs, s_stage, mt, lane);
        block_mma<Cfg, T, 0>(acc[mt], r_w, r_abs, r_a[0], s_lut, lane_off);
        block_mma<Cfg, T, 1>(acc[mt], r_w, r_abs, r_a[1], s_lut, lane_off);
        block_mma<Cfg, T, 2>(acc[mt], r_w, r_abs, r_a[2], s_lut, lane_off);
        block_mma<Cfg, T, 3>(acc[mt], r_w, r_abs, r_a[3], s_lut, lane_off);
    }
}

// store the CTA tile (acc of warp wn after the k-reduction) to C, + bias
template <class Cfg, typename T>
__device__ __forceinline__ void store_output(const float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                             int n_base_warp, int m_base, int lane) {
    const int g = lane / 4, t = lane % 4;
    T* g_C = reinterpret_cast<T*>(p.C);
    const T* g_bias = reinterpret_cast<const T*>(p.bias);
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int n = n_base_warp + mt * UNIT_ROWS + g + 8 * (r / 2);
            if (n >= p.N) continue;
            const float b = g_bias ? Pack2<T>::to_float(g_bias[n]) : 0.0f;
#pragma unroll
            for (int mb = 0; mb < Cfg::MB; mb++) {
                const int m = m_base + mb * 8 + 2 * t + (r % 2);
                if (m < p.M) g_C[(long long)m * p.N + n] = Pack2<T>::from_float(acc[mt][mb][r] * Cfg::OUT_FACTOR + b);
            }
        }
    }
}

// One token (BLOCK_COLUMNS, after fold_block_columns): the live sums of row group g (unit mt, rows g and g + 8:
// acc[mt][0][0] and [2]) sit in every lane of quad g. With COMPACT_SLOT_MIN_SPLITS splits or more, lane t of the quad
// carries value t (unit t / 2, rows g + 8 (t % 2)) through the split-K slots: a CTA's slot is one float per lane
// instead of the whole fragment (8), and the last CTA loads one float per lane and split instead of 8. MT = 2 (configs
// 2, 8, 10, 12).
constexpr int COMPACT_SLOT_MIN_SPLITS = 6; // one-token split-K slots of one float per lane from this many splits
template <class Cfg> __device__ __forceinline__ float one_token_slot_value(const float (&acc)[Cfg::MT][Cfg::MB][4], int lane) {
    static_assert(Cfg::MT == 2 && Cfg::MB == 1, "four live values per quad");
    const int t = lane % 4;
    const float u0 = t % 2 ? acc[0][0][2] : acc[0][0][0], u1 = t % 2 ? acc[1][0][2] : acc[1][0][0];
    return t / 2 ? u1 : u0;
}
// the inverse: every lane of quad g gets its quad's four values back where store_output reads them
template <class Cfg> __device__ __forceinline__ void one_token_slot_unpack(float (&acc)[Cfg::MT][Cfg::MB][4], float v, int lane) {
    const int quad = lane & ~3;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        acc[mt][0][0] = __shfl_sync(0xffffffffu, v, quad + 2 * mt);
        acc[mt][0][2] = __shfl_sync(0xffffffffu, v, quad + 2 * mt + 1);
        acc[mt][0][1] = acc[mt][0][3] = 0.0f;
    }
}

// split-K across CTAs: write this split's slot; the last CTA of the tile sums all slots in order.
// `sync`: a barrier over every thread that calls this (__syncthreads; config 7: its consumer warps)
struct CtaSync {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
// (split, n_splits: blockIdx.y and p.k_splits unless the caller names others: config 7's split last wave)
template <class Cfg, class Sync = CtaSync>
__device__ __forceinline__ bool reduce_split_k(float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                               int tile_id, int wn, bool is_writer, int lane, int* s_flag,
                                               Sync sync = Sync(), int split = -1, int n_splits = 0, int reader = 0,
                                               int readers = 1) {
    constexpr int F = Cfg::ACC_FLOATS;
    if (split < 0) split = blockIdx.y, n_splits = p.k_splits;
    const long long slot_base = (long long)tile_id * n_splits * Cfg::TILE_FLOATS;
    const bool compact = Cfg::BLOCK_COLUMNS && n_splits >= COMPACT_SLOT_MIN_SPLITS; // one float per lane
    if (is_writer) {
        float* g_slot = p.partials + slot_base + (long long)split * Cfg::TILE_FLOATS + wn * F * 32;
        bool stored = false;
        if constexpr (Cfg::BLOCK_COLUMNS) {
            if (compact) __stcg(g_slot + lane, one_token_slot_value<Cfg>(acc, lane)), stored = true;
        }
        if (!stored) {
#pragma unroll
            for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                    for (int r = 0; r < 4; r++)
                        __stcg(g_slot + ((mt * Cfg::MB + mb) * 4 + r) * 32 + lane, acc[mt][mb][r]);
        }
    }
    sync(); // the CTA's slot stores happen before thread 0's release below
    if (threadIdx.x == 0) {
        const int prev = atomic_add_acq_rel_gpu(p.counters + tile_id, 1); // release our slot, acquire the others'
        const int last = prev == n_splits - 1;
        if (last) p.counters[tile_id] = 0; // self-reset for the next call (kernel boundaries order it)
        *s_flag = last;
    }
    sync(); // thread 0's acquire happens before every thread's slot reads
    if (!*s_flag) return false;
    if (readers > 1 || is_writer) {
        // readers > 1: the warps along k of a row split the slots, reader r the r-th contiguous share, to be summed
        // in reader order by the caller (reduce_warps_k): each warp's loads then leave in one batch
        const int share = (n_splits + readers - 1) / readers;
        const int sp_end = min(n_splits, (reader + 1) * share);
        if constexpr (Cfg::BLOCK_COLUMNS) {
            if (compact) { // one float per lane and split, every split's load issued at once
                constexpr int MAX_SPLITS_LOADED = 16; // the dispatcher's MAX_SPLITS
                const float* g_slot = p.partials + slot_base + wn * F * 32 + lane;
                float v = 0.0f;
#pragma unroll
                for (int sp = 0; sp < MAX_SPLITS_LOADED; sp++)
                    if (sp < n_splits) v += __ldcg(g_slot + (long long)sp * Cfg::TILE_FLOATS);
                one_token_slot_unpack<Cfg>(acc, v, lane);
                return true;
            }
        }
        zero_acc<Cfg>(acc);
        for (int sp = reader * share; sp < sp_end; sp++) { // ptxas unrolls by 4 and issues 4 slots' loads together
            const float* g_slot = p.partials + slot_base + (long long)sp * Cfg::TILE_FLOATS + wn * F * 32;
#pragma unroll
            for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                    for (int r = 0; r < 4; r++)
                        acc[mt][mb][r] += __ldcg(g_slot + ((mt * Cfg::MB + mb) * 4 + r) * 32 + lane);
        }
    }
    return true;
}

// k-reduction across the WARPS_K warps of a CTA into warp wk = 0, in wk order. s_red: [WARPS_K-1][WARPS_N]
// [ACC_FLOATS][32] floats of shared memory that no thread reads or writes any more (the caller's barrier)
template <class Cfg>
__device__ __forceinline__ void reduce_warps_k(float (&acc)[Cfg::MT][Cfg::MB][4], float* s_red, int wn, int wk,
                                               int lane) {
    if constexpr (Cfg::WARPS_K > 1) {
        if (wk > 0) {
            float* dst = s_red + ((wk - 1) * Cfg::WARPS_N + wn) * Cfg::ACC_FLOATS * 32;
#pragma unroll
            for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                    for (int r = 0; r < 4; r++) dst[((mt * Cfg::MB + mb) * 4 + r) * 32 + lane] = acc[mt][mb][r];
        }
        __syncthreads();
        if (wk == 0) {
            for (int w = 1; w < Cfg::WARPS_K; w++) {
                const float* src = s_red + ((w - 1) * Cfg::WARPS_N + wn) * Cfg::ACC_FLOATS * 32;
#pragma unroll
                for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                    for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                        for (int r = 0; r < 4; r++) acc[mt][mb][r] += src[((mt * Cfg::MB + mb) * 4 + r) * 32 + lane];
            }
        }
    }
}

// Split-K of a shared-A tile in 2-CTA clusters (p.cluster_reduce; launch_shared_a in kbit_gemm.cu, an even number
// of splits): the odd split's writer warps (wk = 0, after the k-warp sum) store their partial into the even split's
// receive slot (s_recv: [WARPS_N][ACC_FLOATS / 4][32] float4) with st.async, which completes bytes on the even
// split's mbarrier s_bar, and the odd CTA leaves (false). The even split's writer warps wait for the tile's bytes
// and add the slot to their own partial (split 2j + split 2j + 1; with 2 splits the order and bits of the workspace
// path); the caller then reduces the pairs' sums through the workspace where there are more than 2 splits. Every
// thread of both CTAs calls it: its cluster_wait pairs with the cluster_arrive_relaxed after the even split
// initialised s_bar (kernel start).
template <class Cfg>
__device__ __forceinline__ bool push_split_k(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t s_recv, uint32_t s_bar,
                                             int wn, bool is_writer, int lane) {
    constexpr int F = Cfg::ACC_FLOATS;
    static_assert(F % 4 == 0, "the slot moves float4");
    float* a = &acc[0][0][0];
    const uint32_t slot = s_recv + 16u * (uint32_t)(wn * (F / 4) * 32 + lane);
    cluster_wait();
    if (blockIdx.y % 2 != 0) {
        if (is_writer) {
            const uint32_t dst = map_to_rank(slot, 0), bar = map_to_rank(s_bar, 0);
#pragma unroll
            for (int q = 0; q < F / 4; q++)
                st_async_f32x4(dst + 16u * 32u * (uint32_t)q, a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3], bar);
        }
        return false;
    }
    if (!is_writer) return true;
    if (threadIdx.x == 0) mbar_arrive_expect_tx(s_bar, (uint32_t)Cfg::TILE_FLOATS * 4u);
    mbar_wait_cluster(s_bar, 0);
#pragma unroll
    for (int q = 0; q < F / 4; q++) {
        float4 v;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "r"(slot + 16u * 32u * (uint32_t)q)
                     : "memory");
        a[4 * q] += v.x, a[4 * q + 1] += v.y, a[4 * q + 2] += v.z, a[4 * q + 3] += v.w;
    }
    return true;
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS_PER_SM) kbit_gemm_kernel(const KbitGemmParams p) {
    extern __shared__ __align__(16) uint32_t s_mem[];
    grid_dependency_wait(); // PDL (kbit_gemm.cu): every read and write of this grid comes after the previous kernel
    const float cb_entry = Cfg::MB == 1 ? load_codebook_entry(p) : 0.0f; // first: overlaps the prologue
    __shared__ int s_flag;
    uint32_t* s_lut_ptr = s_mem;                    // [LUT_ENTRIES][LUT_COPIES] packed pairs
    uint32_t* s_ring_ptr = s_mem + Cfg::LUT_WORDS;  // [WARPS][STAGES][STAGE_WORDS]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wn = warp % Cfg::WARPS_N, wk = warp / Cfg::WARPS_N;
    const int n16_base = (blockIdx.x * Cfg::WARPS_N + wn) * Cfg::MT;
    const int m_base = blockIdx.z * Cfg::TILE_M;
    // k-steps of this warp: split chunk, then contiguous sub-chunk of warp wk
    const int split_begin = blockIdx.y * p.ks_per_split;
    const int split_end = min(split_begin + p.ks_per_split, p.k_steps);
    const int split_len = max(split_end - split_begin, 0);
    const int per_warp = (split_len + Cfg::WARPS_K - 1) / Cfg::WARPS_K;
    const int k_begin = split_begin + wk * per_warp;
    const int k_end = min(k_begin + per_warp, split_end);
    const int n_steps = max(k_end - k_begin, 0);

    const uint32_t s_lut = (uint32_t)__cvta_generic_to_shared(s_lut_ptr);
    const int stage_words = Cfg::stage_words(p.a_rows);
    const int stages = Cfg::stages_for(p.a_rows);
    const uint32_t s_ring = (uint32_t)__cvta_generic_to_shared(s_ring_ptr) + 4 * warp * stages * stage_words;
    constexpr int A_OFF_BYTES = 4 * (Cfg::STAGE_W_WORDS + Cfg::STAGE_ABS_WORDS);
    const uint32_t lane_off = (uint32_t)(lane % Cfg::LUT_COPIES) * Cfg::LUT_ENTRY_BYTES;

    float acc[Cfg::MT][Cfg::MB][4];
    zero_acc<Cfg>(acc);

    // prologue: stages-1 k-steps in flight (empty groups keep the wait count uniform)
    StreamCursor<Cfg> cur;
    cur.init(p, n16_base, m_base, k_begin, lane);
    for (int st = 0; st < stages - 1; st++) {
        if (st < n_steps) {
            load_stage_async<Cfg>(s_ring + 4 * st * stage_words, cur, lane);
            if constexpr (Cfg::A_IN_RING) load_a_async<Cfg>(s_ring + 4 * st * stage_words + A_OFF_BYTES, cur, p, lane);
            cur.advance();
        }
        cp_async_commit();
    }
    uint4 r_a[UNIT_BLOCKS][Cfg::MB]; // A_IN_RING == false: this k-step's fragments
    if (!Cfg::A_IN_RING && n_steps > 0) load_a_registers<Cfg>(r_a, p, m_base, k_begin, lane);
    build_lut<Cfg, T, Cfg::MB == 1>(s_lut_ptr, cb_entry, p); // overlaps the prologue's DRAM latency
    __syncthreads();                                         // LUT complete
    if (!Cfg::A_IN_RING && n_steps > 0) // the first k-step's A chunks into B fragments (after the loads' latency)
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++)
#pragma unroll
            for (int mb = 0; mb < Cfg::MB; mb++) quad_transpose_words(r_a[blk][mb], lane % 4);

    uint32_t s_st_load = s_ring + 4 * (stages - 1) * stage_words; // ring slot of step i + stages - 1
    uint32_t s_st_comp = s_ring;                                   // ring slot of step i
    const uint32_t s_ring_end = s_ring + 4 * stages * stage_words;
    for (int i = 0; i < n_steps; i++) {
        if constexpr (Cfg::A_IN_RING) __syncwarp(); // every lane's reads of the slot refilled next are done
        if (i + stages - 1 < n_steps) {
            load_stage_async<Cfg>(s_st_load, cur, lane);
            if constexpr (Cfg::A_IN_RING) load_a_async<Cfg>(s_st_load + A_OFF_BYTES, cur, p, lane);
            cur.advance();
        }
        cp_async_commit();
        s_st_load += 4 * stage_words;
        if (s_st_load == s_ring_end) s_st_load = s_ring;
        uint4 r_a_next[UNIT_BLOCKS][Cfg::MB];
        if (!Cfg::A_IN_RING && i + 1 < n_steps) load_a_registers<Cfg>(r_a_next, p, m_base, k_begin + i + 1, lane);
        cp_async_wait_dyn(stages - 1); // this lane's copies of step i have landed
        if constexpr (Cfg::A_IN_RING) __syncwarp(); // ... and the other lanes' A chunks, which ldmatrix reads
        compute_stage<Cfg, T>(acc, s_st_comp, s_lut, lane_off, p.a_rows, r_a, lane);
        s_st_comp += 4 * stage_words;
        if (s_st_comp == s_ring_end) s_st_comp = s_ring;
        if (!Cfg::A_IN_RING && i + 1 < n_steps) {
#pragma unroll
            for (int blk = 0; blk < UNIT_BLOCKS; blk++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++) { // loaded a k-step ago: the shuffles do not wait
                    r_a[blk][mb] = r_a_next[blk][mb];
                    quad_transpose_words(r_a[blk][mb], lane % 4);
                }
        }
    }
    cp_async_wait<0>();
    allow_dependent_launch(); // past its loads: the next GEMM may take the SM slots this grid's CTAs leave
    __syncthreads(); // ring free: reuse it for the k-reduction

    // k-reduction across the WARPS_K warps of the CTA, in wk order (the ring is free: reuse it)
    reduce_warps_k<Cfg>(acc, reinterpret_cast<float*>(s_ring_ptr), wn, wk, lane);
    const int n_base_warp = n16_base * UNIT_ROWS;
    if (p.k_splits > 1) {
        const int tile_id = blockIdx.z * gridDim.x + blockIdx.x;
        if (!reduce_split_k<Cfg>(acc, p, tile_id, wn, wk == 0, lane, &s_flag)) return;
    }
    if (wk == 0) store_output<Cfg, T>(acc, p, n_base_warp, m_base, lane);
}


// ---------------------------------------------------------------------------------------------
// Shared-A path: the same per-warp weight stream and LUT dequant, but the A tile of each k-step is
// staged ONCE per CTA in a shared cp.async ring (all 8 warps, along n, use the same k-step, so the CTA
// is synchronized once per k-step) and read with ldmatrix (rows padded by 16 bytes: conflict-free).
// MB = 8 ("wide", TILE_M = 64, 226 KB: one CTA per SM, sm_90) serves M > 32; MB = 1, 2, 4 (TILE_M =
// 8, 16, 32, 112 KB: two CTAs per SM) serve M <= 32 on all but small weights (and MB = 2 small
// weights up to M = 128). Each dequantized fragment feeds MB MMAs. Split-K up to M = 256, through the
// same workspace slots as config 0. MB = 1, 2 keep their weights in registers instead of the smem
// ring (W_REG_STAGES, section 4).
// ---------------------------------------------------------------------------------------------
// k-steps of weights in flight in registers at MB = 1 (0: the smem ring): 2, but 3 for k = 2 with one warp along k
// (configs 2, 10).
template <int K_BITS_, int MB_, int MT_, int CTAS_PER_SM_, bool ABS_U8_, int WARPS_K_ = 1, int WARPS_N_ = 8 / WARPS_K_,
          bool BLOCK_COLUMNS_ = false>
struct KbitSharedAConfig : KbitGemmConfig<K_BITS_, MB_, MT_, WARPS_N_, WARPS_K_, ABS_U8_, true, BLOCK_COLUMNS_> {
    using Base = KbitGemmConfig<K_BITS_, MB_, MT_, WARPS_N_, WARPS_K_, ABS_U8_, true, BLOCK_COLUMNS_>;
    static_assert(WARPS_N_ * WARPS_K_ == 8 || (WARPS_K_ == 1 && WARPS_N_ == 7) ||
                      ((WARPS_N_ * WARPS_K_ == 16 || WARPS_N_ * WARPS_K_ == 14) && CTAS_PER_SM_ == 1),
                  "8 warps = WARPS_N x WARPS_K, 7 along n (224-row tiles), or 16 or 14 in a CTA per SM (configs 11, 13)");
    // With WARPS_K > 1 the CTA's k-steps are cut into WARPS_K contiguous chunks (one per warp along k, so each warp
    // streams its weight rows in order); a "CTA step" is step i of every chunk: an A slot holds WARPS_K k-steps
    static constexpr int A_STEP_K = UNIT_K * WARPS_K_;
    // + 16 bytes: the 8 rows of an ldmatrix phase (16 bytes each, an odd number of chunks apart) hit distinct banks
    static constexpr int A_ROW_BYTES = 2 * A_STEP_K + 16;
    static constexpr int A_STAGE_WORDS = Base::TILE_M * A_ROW_BYTES / 4;
    static constexpr int W_STAGE_WORDS = Base::STAGE_W_WORDS + Base::STAGE_ABS_WORDS; // per warp
    // W_REG_STAGES > 0: the weights skip shared memory; each lane loads its own words (ld.global.nc) into a
    // register ring that many k-steps deep (section 4) and the smem ring holds only A
    static constexpr int W_REG_STAGES = MB_ == 1 ? (K_BITS_ == 2 && WARPS_K_ == 1 ? 3 : 2) : MB_ == 2 ? 2 : 0;
    static_assert(WARPS_K_ == 1 || W_REG_STAGES > 0, "warps along k only with the weights in registers");
    static constexpr int W_SMEM_STAGE_WORDS = W_REG_STAGES > 0 ? 0 : W_STAGE_WORDS;
    static constexpr int SHARED_A_CTAS_PER_SM = CTAS_PER_SM_;
    static_assert(CTAS_PER_SM_ == 1 || CTAS_PER_SM_ == 2, "one CTA per SM (226 KB, sm_90) or two (112 KB)");
    static constexpr int SHARED_A_BUDGET_BYTES = CTAS_PER_SM_ == 1 ? 226 * 1024 : 112 * 1024;
    static constexpr int SHARED_A_STAGES_FIT =
        (SHARED_A_BUDGET_BYTES / 4 - Base::LUT_WORDS) / (A_STAGE_WORDS + Base::WARPS * W_SMEM_STAGE_WORDS);
    // the register-weight configs refill A P CTA steps at a time, one barrier per P steps (section 4), where
    // two refills fit (wide A slots of WARPS_K k-steps may not: then a barrier per step)
    static constexpr int A_STEPS_PER_BARRIER = W_REG_STAGES > 0 && SHARED_A_STAGES_FIT >= 2 * 2 ? 2 : 1;
    static constexpr int STAGES_CAP = 4;
    static constexpr int SHARED_A_STAGES =
        (SHARED_A_STAGES_FIT > STAGES_CAP ? STAGES_CAP : SHARED_A_STAGES_FIT) / A_STEPS_PER_BARRIER * A_STEPS_PER_BARRIER;
    static_assert(SHARED_A_STAGES % A_STEPS_PER_BARRIER == 0 && SHARED_A_STAGES >= 2 * A_STEPS_PER_BARRIER,
                  "the A ring holds whole refills, two or more");
    // 2 stages still overlap (the barrier of step i frees the slot of step i-1 for step i+1) but keep one
    // k-step in flight; MB = 4 at k >= 4 (and fp16 absmax at MB = 2) only fit 2 in 112 KB
    static_assert(SHARED_A_STAGES >= 2, "the shared ring needs >= 2 stages (one barrier per k-step)");
    static constexpr int SHARED_A_SMEM_BYTES =
        4 * (Base::LUT_WORDS + SHARED_A_STAGES * (A_STAGE_WORDS + Base::WARPS * W_SMEM_STAGE_WORDS));
    // push_split_k's receive slot (one C tile of fp32) after the rest, in launches of 2-CTA clusters only
    static constexpr int PUSH_RECV_OFFSET = (SHARED_A_SMEM_BYTES + 15) / 16 * 16;
    static constexpr int PUSH_SMEM_BYTES = PUSH_RECV_OFFSET + 4 * Base::TILE_FLOATS;
    static_assert(Base::RED_WORDS <= SHARED_A_STAGES * A_STAGE_WORDS, "the k-reduction buffer aliases the A ring");
    static constexpr int A_CHUNKS = Base::TILE_M * (A_STEP_K / 8); // 16-byte chunks of one A stage
    static constexpr int A_CHUNKS_PER_THREAD = (A_CHUNKS + Base::THREADS - 1) / Base::THREADS;
    // the last round of a tile's chunks leaves threads idle where THREADS does not divide A_CHUNKS (7-warp CTAs)
    static constexpr bool A_CHUNKS_RAGGED = A_CHUNKS % Base::THREADS != 0;
    // Two token tiles (configs 3, 9): each lane's codebook entry is the kernel's first copy (cp.async, 4 bytes, into
    // its warp's 128 bytes of the last A slot, which the prefill leaves free until the loop's first refill), and A's
    // prefill goes out before the weights. The codebook alone by cp.async, A still after the weights, had A's first
    // wait grow by as much (k = 3 slower).
    static constexpr bool CODEBOOK_BY_CP_ASYNC = MB_ == 2 && W_REG_STAGES > 0;
    static_assert(!CODEBOOK_BY_CP_ASYNC || Base::WARPS * 128 <= 4 * A_STAGE_WORDS,
                  "the codebook copies fit the last A slot, which the prefill (S - P slots) leaves free");
};

// this lane's word of the codebook copies in the last A slot (CODEBOOK_BY_CP_ASYNC)
template <class Cfg> __device__ __forceinline__ uint32_t codebook_slot(uint32_t s_a_ring) {
    return s_a_ring + 4 * (Cfg::SHARED_A_STAGES - 1) * Cfg::A_STAGE_WORDS + (threadIdx.x / 32) * 128 +
           (threadIdx.x % 32) * 4;
}

// cooperative copy of the A tile [TILE_M tokens][A_STEP_K k] of one CTA step into the shared ring: k-step
// kstep + wk * chunk_steps for each warp wk along k, zero past k_end (the split's end: the last chunk may be
// shorter, and its warp multiplies whatever its weight registers hold by these zeros)
template <class Cfg>
__device__ __forceinline__ void load_a_shared_async(uint32_t s_a, const KbitGemmParams& p, int m_base, int kstep,
                                                    int chunk_steps = 0, int k_end = 0) {
    const unsigned short* g_A = reinterpret_cast<const unsigned short*>(p.A);
    if constexpr (Cfg::BLOCK_COLUMNS) {
        // One token (M = 1): the k-step's 64 words of each warp along k, word 4j + t of block b (k 32b + 8j + 2t, +1:
        // register j of lane (b, t)'s B fragment) stored at word 4t + j of the block's 64 bytes, so lane (b, t) reads
        // its four registers with one 16-byte load (compute_units_block_columns)
        constexpr int WORDS = Cfg::WARPS_K * (UNIT_K / 2); // 64 per warp along k: more than THREADS for config 12
#pragma unroll
        for (int r = 0; r < (WORDS + Cfg::THREADS - 1) / Cfg::THREADS; r++) {
            const int x = threadIdx.x + r * Cfg::THREADS;
            if (x >= WORDS) return;
            const int seg = x / (UNIT_K / 2), w = x % (UNIT_K / 2);
            const int blk = w / 16, j = (w % 16) / 4, t = w % 4;
            const int k = (kstep + seg * chunk_steps) * UNIT_K + 2 * (w % 16) + blk * BLOCK_ELEMS;
            const bool ok = k < p.K_dim && (Cfg::WARPS_K == 1 || k < k_end * UNIT_K);
            const unsigned short* src = ok ? g_A + (long long)m_base * p.lda + k : g_A;
            const uint32_t s_dst = s_a + seg * 2 * UNIT_K + blk * 64 + (4 * t + j) * 4;
            if (p.a_vec_ok) {
                cp_async_4_zfill(s_dst, src, ok ? 4u : 0u);
            } else { // A only 2-byte aligned: two loads and a 4-byte store (ordered by the ring's barrier)
                const uint32_t v = ok ? (uint32_t)src[0] | ((uint32_t)src[1] << 16) : 0u;
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_dst), "r"(v));
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < Cfg::A_CHUNKS_PER_THREAD; j++) {
            const int c = threadIdx.x + j * Cfg::THREADS;
            if (Cfg::A_CHUNKS_RAGGED && c >= Cfg::A_CHUNKS) break; // MB = 1: half the threads copy
            const int row = c / (Cfg::A_STEP_K / 8), piece = c % (Cfg::A_STEP_K / 8);
            const int seg = Cfg::WARPS_K == 1 ? 0 : piece / (UNIT_K / 8); // the warp along k that reads it
            const int m = m_base + row, k = (kstep + seg * chunk_steps) * UNIT_K + (piece % (UNIT_K / 8)) * 8;
            if (m >= p.M) continue;                  // rows >= M are never read (compute clamps to the last row)
            const bool ok = k < p.K_dim && (Cfg::WARPS_K == 1 || k < k_end * UNIT_K); // zero fill: padded k must be 0
            const unsigned short* src = ok ? g_A + (long long)m * p.lda + k : g_A;
            const uint32_t s_dst = s_a + row * Cfg::A_ROW_BYTES + piece * 16;
            if (p.a_vec_ok) {
                cp_async_16_zfill(s_dst, src, ok ? 16u : 0u);
            } else {
                sts128(s_dst, ok ? ldg_a_unaligned(src) : make_uint4(0, 0, 0, 0));
            }
        }
    }
}

// dequant + MMA of one k-step: this lane's weight words and absmax of its MT units (from the smem ring or
// the register ring), A from the shared slot s_a.
// a_off[mb]: this lane's ldmatrix row address (token mb*8 + lane % 8, clamped to the tile's last row < M: rows
// past M are not copied; at M < 8 the lanes then share rows and the read broadcasts; chunk lane / 8 of a block)
template <class Cfg, typename T>
__device__ __forceinline__ void compute_units_shared_a(float (&acc)[Cfg::MT][Cfg::MB][4],
                                                       const uint32_t (&r_w)[Cfg::MT][Cfg::Fmt::LANE_WORDS],
                                                       const uint32_t (&r_abs)[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4],
                                                       uint32_t s_a, const uint32_t (&a_off)[Cfg::MB], uint32_t s_lut,
                                                       uint32_t lane_off) {
    constexpr uint32_t A_BLOCK_BYTES = 2 * BLOCK_ELEMS; // a quantization block of one token row
#define KBIT_SHARED_A_BLOCK(BLK)                                                                                    \
    {                                                                                                           \
        uint4 r_b[Cfg::MB];                                                                                     \
        _Pragma("unroll") for (int mb = 0; mb < Cfg::MB; mb++) ldmatrix_b_frags(r_b[mb], s_a + a_off[mb] + (BLK) * A_BLOCK_BYTES); \
        _Pragma("unroll") for (int mt = 0; mt < Cfg::MT; mt++)                                                  \
            block_mma<Cfg, T, BLK>(acc[mt], r_w[mt], r_abs[mt], r_b, s_lut, lane_off);                          \
    }
    KBIT_SHARED_A_BLOCK(0) KBIT_SHARED_A_BLOCK(1) KBIT_SHARED_A_BLOCK(2) KBIT_SHARED_A_BLOCK(3)
#undef KBIT_SHARED_A_BLOCK
}

// BLOCK_COLUMNS (M = 1; section 3): the MMA's 8 token columns are idle but one, so block BLK of a k-step is
// multiplied into column BLK alone: lane (g, t) of g < 4 loads its four B-fragment registers of block g with one
// 16-byte load (the A slot's quad-major order, load_a_shared_async; a_off = block g, lane t), and its B fragment is
// that in block g's MMAs and zero in the others (lanes g >= 4: zero throughout). d[mt] then holds the k-step's 4
// unscaled block sums of each row (the LUT holds bare codebook values), scaled once per k-step in fp32: 4 FFMA per
// unit instead of 32 HMUL2 and 8 scale pairs. fold_block_columns sums the columns of each row after the loop.
template <class Cfg, typename T>
__device__ __forceinline__ void compute_units_block_columns(float (&acc)[Cfg::MT][Cfg::MB][4],
                                                            const uint32_t (&r_w)[Cfg::MT][Cfg::Fmt::LANE_WORDS],
                                                            const uint32_t (&r_abs)[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4],
                                                            uint32_t s_a, uint32_t a_off, uint32_t s_lut,
                                                            uint32_t lane_off, int lane) {
    float d[Cfg::MT][4];
    uint4 r_a = make_uint4(0u, 0u, 0u, 0u);
    if (lane < 16) r_a = lds128_ring(s_a + a_off); // 2 wavefronts per k-step, against 16 for 4 ldmatrix.x4
    const int g = lane / 4;
#define KBIT_BLOCK_COLUMN(BLK)                                                                                      \
    {                                                                                                           \
        const bool mine = g == (BLK);                                                                           \
        const uint4 r_b = make_uint4(mine ? r_a.x : 0u, mine ? r_a.y : 0u, mine ? r_a.z : 0u, mine ? r_a.w : 0u); \
        _Pragma("unroll") for (int mt = 0; mt < Cfg::MT; mt++) {                                                \
            uint32_t frag0[4], frag1[4];                                                                        \
            lookup_frag_a<Cfg, 2 * (BLK)>(frag0, r_w[mt], s_lut, lane_off);                                     \
            lookup_frag_a<Cfg, 2 * (BLK) + 1>(frag1, r_w[mt], s_lut, lane_off);                                 \
            if ((BLK) == 0) d[mt][0] = d[mt][1] = d[mt][2] = d[mt][3] = 0.0f;                                   \
            mma_m16n8k16(d[mt], frag0, r_b.x, r_b.y, T());                                                      \
            mma_m16n8k16(d[mt], frag1, r_b.z, r_b.w, T());                                                      \
        }                                                                                                       \
    }
    KBIT_BLOCK_COLUMN(0) KBIT_BLOCK_COLUMN(1) KBIT_BLOCK_COLUMN(2) KBIT_BLOCK_COLUMN(3)
#undef KBIT_BLOCK_COLUMN
    // d0, d1: row g, columns (blocks) 2t, 2t + 1; d2, d3: row g + 8. Lanes t = 2, 3 hold the empty columns 4..7.
    const bool odd = lane & 1;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        uint32_t r_sel[Cfg::ABS_BYTES_PER_LANE / 4]; // this lane's two blocks moved to blocks 0, 1 of each row
        if constexpr (Cfg::ABS_U8) {
            r_sel[0] = r_abs[mt][0] >> (odd ? 16 : 0);
            r_sel[1] = r_abs[mt][1] >> (odd ? 16 : 0);
        } else {
            r_sel[0] = odd ? r_abs[mt][1] : r_abs[mt][0];
            r_sel[1] = 0u;
            r_sel[2] = odd ? r_abs[mt][3] : r_abs[mt][2];
            r_sel[3] = 0u;
        }
        acc[mt][0][0] = fmaf(scale_f32<Cfg>(r_sel, 0), d[mt][0], acc[mt][0][0]);
        acc[mt][0][1] = fmaf(scale_f32<Cfg>(r_sel, 1), d[mt][1], acc[mt][0][1]);
        acc[mt][0][2] = fmaf(scale_f32<Cfg>(r_sel, 4), d[mt][2], acc[mt][0][2]);
        acc[mt][0][3] = fmaf(scale_f32<Cfg>(r_sel, 5), d[mt][3], acc[mt][0][3]);
    }
}

// BLOCK_COLUMNS after the loop: each row's sum over its 8 columns (4 lanes x 2 registers) as token 0's value
template <class Cfg> __device__ __forceinline__ void fold_block_columns(float (&acc)[Cfg::MT][Cfg::MB][4]) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        float r_g = acc[mt][0][0] + acc[mt][0][1], r_g8 = acc[mt][0][2] + acc[mt][0][3];
        r_g += __shfl_xor_sync(0xffffffffu, r_g, 1);
        r_g8 += __shfl_xor_sync(0xffffffffu, r_g8, 1);
        r_g += __shfl_xor_sync(0xffffffffu, r_g, 2);
        r_g8 += __shfl_xor_sync(0xffffffffu, r_g8, 2);
        acc[mt][0][0] = r_g;
        acc[mt][0][1] = 0.0f;
        acc[mt][0][2] = r_g8;
        acc[mt][0][3] = 0.0f;
    }
}

// A lane's weights of one k-step (MT units) in registers: one slot of the W_REG_STAGES-deep register ring
template <class Cfg> struct StepWeightRegs {
    uint32_t w[Cfg::MT][Cfg::Fmt::LANE_WORDS];
    uint32_t abs[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4];
};

// non-coherent global loads that do not allocate in L1 (each weight byte is read once); PTX ISA 9.7.9.8
__device__ __forceinline__ void ldg_stream_v4(uint32_t* r, const void* g_ptr) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(g_ptr));
}
__device__ __forceinline__ void ldg_stream_v2(uint32_t* r, const void* g_ptr) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "l"(g_ptr));
}

// the same words load_stage_async copies into the smem ring, into registers
template <class Cfg>
__device__ __forceinline__ void load_units_to_regs(StepWeightRegs<Cfg>& r, const StreamCursor<Cfg>& cur, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        // One token tile loads absent units (n16 >= n16_tiles) too: their pointer is clamped to the last unit row, and
        // the unpredicated loads let ptxas use the cursor registers as they are (the skip cost 2 moves per pointer and
        // k-step).
        if (Cfg::MB > 1 && !((cur.valid_mt >> mt) & 1)) continue; // warp-uniform; stale registers only feed unstored rows
#pragma unroll
        for (int c = 0; c < F::NV4; c++) ldg_stream_v4(&r.w[mt][4 * c], cur.g_w[mt] + c * 128);
        if constexpr (F::HAS_V2) ldg_stream_v2(&r.w[mt][4 * F::NV4], cur.g_w[mt] + F::NV4 * 128 - lane * 2);
        if constexpr (Cfg::ABS_U8) ldg_stream_v2(r.abs[mt], cur.g_abs[mt]);
        else ldg_stream_v4(r.abs[mt], cur.g_abs[mt]);
    }
}

// the k-loop with the weights in the smem ring: step i waits for its stage, one barrier, refills the slot
// step i-1 used with step i+S-1 (weights + A), then dequantizes + multiplies step i
template <class Cfg, typename T>
__device__ __forceinline__ void shared_a_loop_smem_ring(float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                                        StreamCursor<Cfg>& cur, int k_begin, int n_steps, int m_base,
                                                        uint32_t s_a_ring, uint32_t s_w_ring,
                                                        const uint32_t (&a_off)[Cfg::MB], uint32_t* s_lut_ptr,
                                                        float cb_entry, uint32_t lane_off, int lane) {
    constexpr int S = Cfg::SHARED_A_STAGES;
    const uint32_t s_lut = (uint32_t)__cvta_generic_to_shared(s_lut_ptr);
    for (int st = 0; st < S - 1; st++) { // prologue: S-1 k-steps in flight
        if (st < n_steps) {
            load_stage_async<Cfg>(s_w_ring + 4 * st * Cfg::W_STAGE_WORDS, cur, lane);
            load_a_shared_async<Cfg>(s_a_ring + 4 * st * Cfg::A_STAGE_WORDS, p, m_base, k_begin + st);
            cur.advance();
        }
        cp_async_commit();
    }
    build_lut<Cfg, T, Cfg::MB == 1>(s_lut_ptr, cb_entry, p);

    for (int i = 0; i < n_steps; i++) {
        cp_async_wait<S - 2>(); // step i landed (this thread's copies) ...
        __syncthreads();        // ... everyone's, and everyone is done with step i-1's slot (and the LUT)
        const int st_load = (i + S - 1) % S;
        if (i + S - 1 < n_steps) {
            load_stage_async<Cfg>(s_w_ring + 4 * st_load * Cfg::W_STAGE_WORDS, cur, lane);
            load_a_shared_async<Cfg>(s_a_ring + 4 * st_load * Cfg::A_STAGE_WORDS, p, m_base, k_begin + i + S - 1);
            cur.advance();
        }
        cp_async_commit();
        const int st = i % S;
        uint32_t r_w[Cfg::MT][Cfg::Fmt::LANE_WORDS];
        uint32_t r_abs[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4];
#pragma unroll
        for (int mt = 0; mt < Cfg::MT; mt++)
            read_unit_from_stage<Cfg>(r_w[mt], r_abs[mt], s_w_ring + 4 * st * Cfg::W_STAGE_WORDS, mt, lane);
        compute_units_shared_a<Cfg, T>(acc, r_w, r_abs, s_a_ring + 4 * st * Cfg::A_STAGE_WORDS, a_off, s_lut, lane_off);
    }
}


// the k-loop with the weights in registers (W_REG_STAGES = D): the loads of step i+D are issued right
// after step i's compute, into the registers it just used, so D k-steps of weights are in flight per
// lane; A still travels through the smem ring (S-1 steps ahead, one barrier per P steps). The loop is
// unrolled by D so every ring slot is a fixed set of registers. Steps are CTA steps (step i of each of the
// WARPS_K chunks of n_steps k-steps from k_begin to k_end, one per warp along k); this warp's chunk has
// my_steps of them (fewer in the last chunk of a split): past them it loads no weights and computes on zero A
// (no branch around the compute: one cost ptxas the overlap of consecutive steps).
template <class Cfg, typename T>
__device__ __forceinline__ void shared_a_loop_weight_regs(float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                                          StreamCursor<Cfg>& cur, int k_begin, int k_end,
                                                          int n_steps, int my_steps, int m_base, uint32_t s_a_ring,
                                                          const uint32_t (&a_off)[Cfg::MB], uint32_t* s_lut_ptr,
                                                          float cb_entry, uint32_t lane_off, int lane) {
    constexpr int S = Cfg::SHARED_A_STAGES;
    constexpr int D = Cfg::W_REG_STAGES;
    const uint32_t s_lut = (uint32_t)__cvta_generic_to_shared(s_lut_ptr);
    constexpr int P = Cfg::A_STEPS_PER_BARRIER; // A arrives in refills of P k-steps, one commit group each
    const auto prefill_a = [&] {
        for (int st = 0; st < S - P; st++) {
            if (st < n_steps)
                load_a_shared_async<Cfg>(s_a_ring + 4 * st * Cfg::A_STAGE_WORDS, p, m_base, k_begin + st, n_steps, k_end);
            if (st % P == P - 1) cp_async_commit();
        }
    };
    // With two token tiles this pays only with the codebook copied first (CODEBOOK_BY_CP_ASYNC).
    prefill_a();
    StepWeightRegs<Cfg> ring[D] = {}; // zeroed: slots of absent units (rows >= N) are never loaded
#pragma unroll
    for (int d = 0; d < D; d++)
        if (d < my_steps) {
            load_units_to_regs<Cfg>(ring[d], cur, lane);
            cur.advance();
        }
    if constexpr (Cfg::CODEBOOK_BY_CP_ASYNC) { // the kernel's first copy group: all but the A prefill's
        cp_async_wait<(S - P) / P>();
        build_lut<Cfg, T, true>(s_lut_ptr, __uint_as_float(lds32(codebook_slot<Cfg>(s_a_ring))), p);
    } else {
        build_lut<Cfg, T, Cfg::MB == 1>(s_lut_ptr, cb_entry, p);
    }

    for (int i0 = 0; i0 < n_steps; i0 += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int i = i0 + d;
            if (i >= n_steps) break;
            if (i % P == 0) {
                cp_async_wait<S / P - 2>(); // A of steps i .. i+P-1 landed (this thread's copies) ...
                __syncthreads(); // ... everyone's, and everyone is done with steps i-P .. i-1 (and the LUT)
#pragma unroll
                for (int q = 0; q < P; q++) { // steps i+S-P .. i+S-1 into the slots of i-P .. i-1
                    const int st = i + S - P + q;
                    if (st < n_steps)
                        load_a_shared_async<Cfg>(s_a_ring + 4 * (st % S) * Cfg::A_STAGE_WORDS, p, m_base, k_begin + st,
                                                 n_steps, k_end);
                }
                cp_async_commit();
            }
            // every load of this CTA is issued: the next GEMM may launch (PDL) while the last step computes.
            if (i == n_steps - 1) allow_dependent_launch();
            if constexpr (Cfg::BLOCK_COLUMNS)
                compute_units_block_columns<Cfg, T>(acc, ring[d].w, ring[d].abs,
                                                    s_a_ring + 4 * (i % S) * Cfg::A_STAGE_WORDS, a_off[0], s_lut,
                                                    lane_off, lane);
            else
                compute_units_shared_a<Cfg, T>(acc, ring[d].w, ring[d].abs, s_a_ring + 4 * (i % S) * Cfg::A_STAGE_WORDS,
                                               a_off, s_lut, lane_off);
            if (i + D < my_steps) {
                load_units_to_regs<Cfg>(ring[d], cur, lane);
                cur.advance();
            }
        }
    }
}

// The first `steps` of this warp's k-steps from `kstep` on (weights and scales of its MT rows: one contiguous span
// each) into L2, one bulk prefetch per span (lanes 0..MT-1 the weights, MT..2MT-1 the scales).
template <class Cfg>
__device__ __forceinline__ void prefetch_warp_split_l2(const KbitGemmParams& p, int n16_base, int kstep, int steps,
                                                       int lane) {
    using F = typename Cfg::Fmt;
    constexpr int ABS_ELEM_BYTES = Cfg::ABS_U8 ? 1 : 2;
    const int mt = lane % Cfg::MT, n16 = n16_base + mt;
    if (steps <= 0 || lane >= 2 * Cfg::MT || n16 >= p.n16_tiles) return;
    const long long unit = (long long)n16 * p.k_steps + kstep;
    const char* g = lane < Cfg::MT ? reinterpret_cast<const char*>(p.B + unit * F::UNIT_WORDS)
                                   : reinterpret_cast<const char*>(p.B_absmax) + unit * UNIT_ABSMAX * ABS_ELEM_BYTES;
    const uint32_t bytes = (uint32_t)steps * (lane < Cfg::MT ? F::UNIT_WORDS * 4 : UNIT_ABSMAX * ABS_ELEM_BYTES);
    if ((reinterpret_cast<uintptr_t>(g) & 15) == 0) prefetch_l2_bulk(g, bytes);
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::SHARED_A_CTAS_PER_SM) kbit_gemm_shared_a_kernel(const KbitGemmParams p) {
    extern __shared__ __align__(16) uint32_t s_mem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wn = Cfg::WARPS_K == 1 ? warp : warp % Cfg::WARPS_N, wk = Cfg::WARPS_K == 1 ? 0 : warp / Cfg::WARPS_N;
    const int n16_base = (blockIdx.x * Cfg::WARPS_N + wn) * Cfg::MT;
    // k-steps of this split (blockIdx.y), cut into WARPS_K chunks of n_steps (warp wk: chunk wk, my_steps of
    // them); the whole CTA walks the same n_steps CTA steps
    constexpr int WK = Cfg::WARPS_K;
    const int k_begin = blockIdx.y * p.ks_per_split;
    const int split_len = max(min(k_begin + p.ks_per_split, p.k_steps) - k_begin, 0);
    const int n_steps = WK == 1 ? split_len : (split_len + WK - 1) / WK;
    const int my_steps = WK == 1 ? n_steps : min(max(split_len - wk * n_steps, 0), n_steps);
    __shared__ __align__(8) uint64_t s_push_bar; // push_split_k: an even split's receive barrier
    const uint32_t s_push_bar_addr = (uint32_t)__cvta_generic_to_shared(&s_push_bar);
    if (p.cluster_reduce) { // the even split's barrier exists before the odd one pushes (cluster_wait, push_split_k)
        if (threadIdx.x == 0 && blockIdx.y % 2 == 0) mbar_init(s_push_bar_addr, 1), fence_mbarrier_init_cluster();
        cluster_arrive_relaxed();
    }
    if (p.l2_prefetch_steps > 0 && blockIdx.z == 0) // before the PDL wait: a hint, no value comes back
        prefetch_warp_split_l2<Cfg>(p, n16_base, k_begin + wk * n_steps, min(my_steps, p.l2_prefetch_steps), lane);
    grid_dependency_wait(); // PDL (kbit_gemm.cu): every read and write of this grid comes after the previous kernel
    constexpr int S = Cfg::SHARED_A_STAGES;
    const float cb_entry = Cfg::MB == 1 ? load_codebook_entry(p) : 0.0f; // first: overlaps the prologue
    if constexpr (Cfg::CODEBOOK_BY_CP_ASYNC) {
        const uint32_t s_a_ring = (uint32_t)__cvta_generic_to_shared(s_mem) + 4 * Cfg::LUT_WORDS;
        const int l = threadIdx.x % 32;
        cp_async_4_zfill(codebook_slot<Cfg>(s_a_ring), p.codebook + (l < p.codebook_len ? l : 0),
                         l < p.codebook_len ? 4u : 0u);
        cp_async_commit();
    }
    uint32_t* s_lut_ptr = s_mem;                                                 // [LUT_ENTRIES][LUT_COPIES]
    const uint32_t s_a_ring = (uint32_t)__cvta_generic_to_shared(s_mem) + 4 * Cfg::LUT_WORDS; // [S][TILE_M][A_ROW_BYTES]
    // this warp's weight ring [S][W_STAGE_WORDS] (none when the weights travel in registers)
    const uint32_t s_w_ring = s_a_ring + 4 * S * Cfg::A_STAGE_WORDS + 4 * warp * S * Cfg::W_SMEM_STAGE_WORDS;
    const int m_base = blockIdx.z * Cfg::TILE_M;
    __shared__ int s_flag;
    const uint32_t lane_off = (uint32_t)(lane % Cfg::LUT_COPIES) * Cfg::LUT_ENTRY_BYTES;
    uint32_t a_off[Cfg::MB];
    const int a_last_row = min(p.M - m_base, Cfg::TILE_M) - 1;
#pragma unroll
    for (int mb = 0; mb < Cfg::MB; mb++)
        a_off[mb] = Cfg::BLOCK_COLUMNS ? wk * 2 * UNIT_K + (lane % 16 / 4) * 64 + (lane % 4) * 16 // quad-major slot
                                       : min(mb * 8 + lane % 8, a_last_row) * Cfg::A_ROW_BYTES + wk * 2 * UNIT_K +
                                             (lane / 8) * 16;

    float acc[Cfg::MT][Cfg::MB][4];
    zero_acc<Cfg>(acc);

    StreamCursor<Cfg> cur;
    // One token tile: the weight streams start after the codebook's round trip. ptxas chose that order by itself until
    // an epilogue change moved it; a zero that depends on the loaded entry (codebook_len <= 32) makes it part of the
    // weights' addresses.
    const int after_codebook = Cfg::MB == 1 ? (int)(__float_as_uint(cb_entry) & ((uint32_t)p.codebook_len >> 16)) : 0;
    cur.init(p, n16_base, m_base, k_begin + wk * n_steps + after_codebook, lane);
    if constexpr (Cfg::W_REG_STAGES > 0)
        shared_a_loop_weight_regs<Cfg, T>(acc, p, cur, k_begin, k_begin + split_len, n_steps, my_steps, m_base, s_a_ring,
                                          a_off, s_lut_ptr, cb_entry, lane_off, lane);
    else
        shared_a_loop_smem_ring<Cfg, T>(acc, p, cur, k_begin, n_steps, m_base, s_a_ring, s_w_ring, a_off, s_lut_ptr,
                                        cb_entry, lane_off, lane);
    cp_async_wait<0>();
    if constexpr (Cfg::BLOCK_COLUMNS) fold_block_columns<Cfg>(acc);
    allow_dependent_launch(); // past its loads (the register loop allowed it at its last step already): the next GEMM
                              // may take the SM slots this grid's CTAs leave
    if constexpr (WK > 1) { // the A ring is free once every warp is past its last step: sum the k warps there
        __syncthreads();
        reduce_warps_k<Cfg>(acc, reinterpret_cast<float*>(s_mem + Cfg::LUT_WORDS), wn, wk, lane);
    }
    int split = blockIdx.y, n_splits = p.k_splits;
    if (p.cluster_reduce) { // pairs of splits as 2-CTA clusters: the odd one pushes its partial into the even one
        if (!push_split_k<Cfg>(acc, (uint32_t)__cvta_generic_to_shared(s_mem) + Cfg::PUSH_RECV_OFFSET, s_push_bar_addr,
                               wn, wk == 0, lane)) {
            return;
        }
        split /= 2, n_splits /= 2;
    }
    if (n_splits > 1) { // M <= 256 with few n tiles: same deterministic slot reduction as configs 0-2
        __syncthreads();
        const int tile_id = blockIdx.z * gridDim.x + blockIdx.x;
        constexpr int READERS = Cfg::MB >= 2 ? WK : 1;
        const bool last = reduce_split_k<Cfg>(acc, p, tile_id, wn, wk == 0, lane, &s_flag, CtaSync(), split, n_splits,
                                              READERS > 1 ? wk : 0, READERS);
        if (!last) return;
        if constexpr (READERS > 1) // the slot barriers above ordered the first k-reduction's reads before this
            reduce_warps_k<Cfg>(acc, reinterpret_cast<float*>(s_mem + Cfg::LUT_WORDS), wn, wk, lane);
    }
    if (wk == 0) store_output<Cfg, T>(acc, p, n16_base * UNIT_ROWS, m_base, lane);
}

} // namespace kbit
