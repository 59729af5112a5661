// kbit_gemm.cu: instantiations, host launchers, the dispatch function and the C ABI of the fused
// k-bit GEMM. The design (tiles, layout, pipeline, split-K) is in the block atop kbit_gemm.cuh.
#include "kbit_gemm.cuh"
#include "kbit_gemm_wgmma.cuh"
#include "kbit_gemm_wgmma_ws.cuh"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kbit {

// ---------------------------------------------------------------------------------------------
// Error reporting: launchers return after the first failure and keep its message here.
// ---------------------------------------------------------------------------------------------
static thread_local char g_last_error[256] = "";

static void set_error(const char* what, const char* detail) {
    snprintf(g_last_error, sizeof(g_last_error), "%s: %s", what, detail);
}

static bool check_launch(const char* what) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        set_error(what, cudaGetErrorString(err));
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Config table. One row = one kernel shape (instantiated for K_BITS 2..5 x fp16/bf16 x u8/fp16 absmax).
//   id  MB MT WARPS_N WARPS_K   reason
// ---------------------------------------------------------------------------------------------
#define KBIT_CONFIG_TABLE(X)                                                                                         \
    X(0, 1, 2, 2, 4) /* small weights, M <= 4: one token tile, A in the ring, 2 units per warp              */ \
    X(1, 2, 2, 2, 4) /* small weights, 4 < M <= 16: 2 token tiles share each fragment, A in registers      */
// Shared-A configs (KbitSharedAConfig: WARPS_N x WARPS_K warps, the A tile of a CTA step in one ring):
//   id  MB MT CTAs/SM WARPS_K WARPS_N   reason
#define KBIT_SHARED_A_TABLE(X)                                                                                       \
    X(2, 1, 2, 2, 1, 8) /* M <= 8:        256 x 8 CTA tile, 112 KB                                          */      \
    X(3, 2, 2, 2, 1, 8) /* 8 < M <= 16:   256 x 16                                                             */      \
    X(4, 4, 2, 2, 1, 8) /* M > 16:        256 x 32 (and M > 32 when the wide tiles would not fill 1/8 of the SMs) */   \
    X(5, 8, 2, 1, 1, 8) /* M > 32 ("wide"): 256 x 64, 226 KB (sm_90)                                            */      \
    X(8, 1, 2, 2, 2, 4) /* config 2 as 128 x 8 CTA tiles, 2 warps along k: half the split-K splits (split-heavy) */    \
    X(9, 2, 2, 2, 2, 4) /* config 3 as 128 x 16                                                                 */      \
    X(10, 1, 2, 2, 1, 7) /* config 2 as 224 x 8 (7 warps): a lighter busiest SM where 256-row tiles leave slots idle */ \
    X(11, 2, 2, 1, 4, 4) /* config 3 as 128 x 16, 16 warps (4 along k), one CTA per SM: no split-K where its tiles fill  \
                            3/4 to all of the SMs (sm_90: 226 KB)                                                    */ \
    X(12, 1, 2, 2, 8, 1) /* config 2 as 32 x 8, 8 warps along k: 4096-row weights in one or two splits at M = 1   */ \
    X(13, 2, 2, 1, 2, 7) /* config 11 as 224 x 16, 14 warps (7 along n x 2 along k), one CTA per SM                 */

// wgmma configs (KbitWgmmaConfig, sm_90a only: kbit_gemm_wgmma.cuh; 8 warps along n, one CTA per SM):
//   id  TOK MT WARPS   reason
#define KBIT_WGMMA_TABLE(X)                                                                                          \
    X(6, 64, 1, 16) /* M > 32 on sm_90a (17..32 where configs 3 / 4 leave slots idle): 256 x 64, 4 warpgroups */
// warp-specialised wgmma config (KbitWsConfig, sm_90a only: kbit_gemm_wgmma_ws.cuh): 7 = 128 rows x 256
// tokens, producer warps (bulk copies of the weights, TMA of the tokens) and 2 consumer warpgroups
constexpr int WS_CONFIG = 7;
constexpr int NUM_CONFIGS = 14;
constexpr int SIXTEEN_WARP_CONFIG = 11;   // config 3 as 16 warps in a CTA per SM
constexpr int FOURTEEN_WARP_CONFIG = 13;  // config 11 as 224-row tiles: 14 warps in a CTA per SM
constexpr int WARPS_K_CONFIG_OFFSET = 6; // configs 8, 9 = configs 2, 3 with two warps along k
constexpr int FIRST_SHARED_A_CONFIG = 2; // + log2(MB)
constexpr int WIDE_CONFIG = 5;            // MB = 8
constexpr int FIRST_WGMMA_CONFIG = 6;

struct ConfigInfo {
    int mb, mt, warps_n, warps_k;
    int shared_a_ctas; // shared-A and wgmma configs: CTAs per SM; 0 for configs 0-1
    int tile_m() const { return 8 * mb; }
    int tile_n() const { return UNIT_ROWS * mt * warps_n; }
    // = KbitGemmConfig::CTAS_PER_SM / KbitSharedAConfig::SHARED_A_CTAS_PER_SM
    int ctas_per_sm() const {
        if (shared_a_ctas) return shared_a_ctas;
        return warps_n * warps_k >= 16 ? 1 : 2;
    }
};

static ConfigInfo config_info(int id) {
    switch (id) {
#define KBIT_INFO(ID, MB, MT, WN, WK)                                                                                \
    case ID: return ConfigInfo{MB, MT, WN, WK, 0};
        KBIT_CONFIG_TABLE(KBIT_INFO)
#undef KBIT_INFO
#define KBIT_SHARED_A_INFO(ID, MB, MT, CTAS, WK, WN)                                                                 \
    case ID: return ConfigInfo{MB, MT, WN, WK, CTAS};
        KBIT_SHARED_A_TABLE(KBIT_SHARED_A_INFO)
#undef KBIT_SHARED_A_INFO
#define KBIT_WGMMA_INFO(ID, TOK, MT, WARPS)                                                                          \
    case ID: return ConfigInfo{TOK / 8, MT, WARPS, 1, 1};
        KBIT_WGMMA_TABLE(KBIT_WGMMA_INFO)
#undef KBIT_WGMMA_INFO
    case WS_CONFIG: return ConfigInfo{32, 1, 8, 1, 1};
    }
    return ConfigInfo{1, 1, 1, 1, 0};
}

static int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }

// device facts come from the device, cached per device ordinal
template <cudaDeviceAttr ATTR> static int cached_device_attribute() {
    static int s_value[64] = {};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev >= 64) dev = 63;
    if (s_value[dev] == 0) cudaDeviceGetAttribute(&s_value[dev], ATTR, dev);
    return s_value[dev];
}
static int device_smem_optin() { return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }
static int device_l2_bytes() { return cached_device_attribute<cudaDevAttrL2CacheSize>(); }


// the wgmma configs run when the library holds sm_90a code (CMake defines KBIT_WGMMA_BUILT when the
// architecture list has 90a) and the current device is compute capability 9.0
static int device_cc() { // 10 * major + minor
    static int s_cc[64] = {};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev >= 64) dev = 63;
    if (s_cc[dev] == 0) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        s_cc[dev] = 10 * major + minor;
    }
    return s_cc[dev];
}

static bool wgmma_available() {
#ifdef KBIT_WGMMA_BUILT
    return device_cc() == 90;
#else
    return false;
#endif
}
static bool config_available(int id) {
    if (id < 0 || id >= NUM_CONFIGS) return false;
    if (id == FIRST_WGMMA_CONFIG || id == WS_CONFIG) return wgmma_available();
    if (id == WIDE_CONFIG || id == SIXTEEN_WARP_CONFIG || id == FOURTEEN_WARP_CONFIG)
        return device_smem_optin() >= 226 * 1024;
    return true;
}
// ---------------------------------------------------------------------------------------------
// Dispatch: the ONE place that maps a problem to a kernel config and a split count.
// ---------------------------------------------------------------------------------------------
// The numbers below were each chosen by forcing the candidate configs on the shapes at the rule's edge (the design
// doc's dispatcher section). Work is counted in CTA tiles x k-steps against the SM count.
// A shared-A config (and the wide tile over the 32-token one) needs at least this much work per SM, so that split-K
// keeps its 256-row CTAs busy.
constexpr int SHARED_A_MIN_STEPS_PER_SM = 6;
// At M <= 16 the per-warp configs 0-1 (64-row CTAs, 4x the CTAs) take over below 1.5 x SMs of shared-A work...
constexpr int PER_WARP_MAX_STEPS_PER_2_SMS = 3;
// ...and at M = 9..16 below 0.75 x SMs (k = 5: 1.5 x SMs). Above that, weights of at most ONE_TILE_MID_M_MAX_WEIGHT
// elements take one token tile per CTA, two tiles on the grid, the second tile reading the weight from L2. Larger
// weights keep two tiles per CTA.
constexpr int PER_WARP_MID_M_MAX_STEPS_PER_4_SMS = 3;
constexpr long long ONE_TILE_MID_M_MAX_WEIGHT = 1LL << 23;
// With few wide tiles the wgmma config takes M > 32 (below, the 32-token config 4).
constexpr int WGMMA_SMALL_WORK_MIN_M = 32;
// Small weights (fewer than 32 x SMs units) stay in L2, so re-reading them per 16 tokens costs little and config 3's
// 8x more CTAs win up to M = 128 (k = 5: 64).
constexpr int SMALL_WEIGHT_MAX_UNITS_PER_SM = 32;
constexpr int SMALL_WEIGHT_MB2_MAX_M = 128;
constexpr int SMALL_WEIGHT_MB2_MAX_M_K5 = 64;
// 17..32 tokens (config 4's range, 256 x 32 tiles with the weights in a shared-memory ring). A weight that fits in
// half the L2 is read by the second 16-token tile from there, so config 3 (register weights) wins; on larger weights
// the wgmma config wins at k = 3, and at k = 4 on weights of MID_M_WGMMA_K4_MIN_WEIGHT elements or more. Two more
// rules at 17..32 tokens:
constexpr int MID_M_MAX = 32;
constexpr long long MID_M_WGMMA_K4_MIN_WEIGHT = 1LL << 27;
// (1) Config 11 (two 16-token tiles of 128 rows on the grid, one 16-warp CTA per SM) where its CTAs fill 90-100% of
// the SMs in one wave and each warp along k runs 4-8 k-steps: that is less split-K than config 3's.
constexpr int MID_M_SIXTEEN_WARP_MIN_FILL_PCT = 90;
constexpr int MID_M_SIXTEEN_WARP_MAX_CHUNK = 8;
// (2) The wgmma config where config 3 or 4 fills less than 90% of its CTA slots and config 6 fills at least as large a
// share of its own, on weights of 2^24 elements or more (below, e.g. 2048 x 2048, config 3 stays faster).
constexpr int MID_M_MIN_FILL_PCT = 90;
constexpr long long MID_M_FILL_RULE_MIN_WEIGHT = 1LL << 24;
// configs 0 (one token tile, A in the ring) up to here, then 1 (two tiles)
constexpr int PER_WARP_SMALL_M_MAX = 8;
// Small weights at M = 5..16: M = 5..8 above PER_WARP_RING_A_MAX_N rows take the shared-A plan, not config 1 (its
// second token tile is empty; below, each 64-row CTA of config 0 copies its own A, so its A traffic grows with N);
// k = 5 with a short K keeps config 1 (SHORT_K_ONE_SPLIT_MID_M_MIN_N). M = 9..16 on weights of at most
// PER_WARP_RING_A_MID_M_MAX_N rows and PER_WARP_RING_A_MID_M_MAX_WEIGHT elements: config 0, one token tile per CTA,
// two on the grid.
constexpr int PER_WARP_RING_A_MAX_N = 2048;
constexpr int PER_WARP_RING_A_MID_M_MAX_N = 1024;
constexpr long long PER_WARP_RING_A_MID_M_MAX_WEIGHT = 1LL << 21;
// Short K (8..15 k-steps): config 8 needs no split-K there, at M <= 16 from this many rows...
constexpr int SHORT_K_ONE_SPLIT_MIN_N = 4096;
// ...and from here at M = 5..16 for k <= 4
constexpr int SHORT_K_ONE_SPLIT_MID_M_MIN_N = 2048;
constexpr int PER_WARP_MAX_M = 16;       // above: shared-A even for small weights (never slower)
constexpr int SPLIT_K_MAX_M = 256;               // split-K up to 256 tokens: at M = 128 on H200 without it the wide
                                                 // config had 64 CTAs for 132 SMs (N = 8192: 0.33x cuBLAS)
constexpr int MIN_STEPS_PER_WARP = 1;            // a warp streams at least 1 k-step of 128: with 2, N=1024 K=4096
// The register-weight configs (2, 3; mb <= 2) fill a 2-3 k-step ring before their first MMA: give each CTA at least 4
// k-steps.
constexpr int MIN_STEPS_PER_REG_WEIGHT_CTA = 4;
constexpr int MAX_SPLITS = 16;
// Configs 2 and 3 with two warps along k (configs 8, 9: 128-row CTA tiles, each warp a contiguous half of the CTA's
// k-steps, summed in shared memory) where split-K weighs most: their plan has >= 8 splits of < 8 k-steps each. Four or
// eight warps along k were slower everywhere. k = 5 took them only for splits of 4 k-steps or fewer: with splits of 7
// the second warp along k lost at M = 8 and 16 (even at M = 1). These are the rules above 16 tokens (config 3 for
// small weights) and, at k = 5, at M = 9..16; the sweep below replaced them at M <= 8 and, for k <= 4, at M = 9..16.
constexpr int WARPS_K_MIN_SPLITS = 8, WARPS_K_MAX_SPLIT_STEPS = 7, WARPS_K_MAX_SPLIT_STEPS_K5 = 4;
// A sweep of 22 LLM shapes widened two cases: one token tile at M <= WARPS_K_ANY_STEPS_MAX_M takes config 8 once
// config 2 (or 10) plans >= 8 splits, of any length and at any k; two token tiles (M = 9..16) at k <= 4 take config 9
// from WARPS_K_MB2_MIN_SPLITS splits of up to WARPS_K_MB2_MAX_SPLIT_STEPS k-steps.
constexpr int WARPS_K_ANY_STEPS_MAX_M = 8;
// One token with its A slot read by one LDS.128 per warp and k-step (block columns, k <= 4; kbit_gemm.cuh section 3):
// config 8 also where config 2 or 10 plans fewer than 8 splits, as long as its CTAs (half the splits of 128-row tiles)
// fill at least ONE_TOKEN_WARPS_K_MIN_FILL_RATIO_PCT (k = 2; _K34 at k = 3, 4) of the share of SM slots that the other
// plan fills. Its halved split-K tail weighs most against k = 2's short loop.
constexpr int ONE_TOKEN_WARPS_K_MIN_FILL_RATIO_PCT = 80, ONE_TOKEN_WARPS_K_MIN_FILL_RATIO_PCT_K34 = 90;
// One token, k = 3, 4: config 12 (32-row tiles, all 8 warps along k) where it plans 1 or 2 splits (2: pushed through
// 2-CTA clusters on sm_90, kbit_gemm.cuh push_split_k) in one wave that loads the SMs evenly (the busiest SM's CTAs at
// most 1.4x the average) and each warp's chunk is at most 7 k-steps.
constexpr int ONE_TOKEN_DEEP_CONFIG = 12;
constexpr int ONE_TOKEN_DEEP_MAX_IMBALANCE_PCT = 140, ONE_TOKEN_DEEP_MAX_CHUNK = 7;
static int split_k_push_max_splits();
// ...where config 9 keeps 90% of config 3's CTAs: its warps along k need 8 k-steps per split, so 3584 x 3584 gets 3
// splits (84 CTAs) where config 3 runs 7 (98), and config 3 is faster there.
constexpr int WARPS_K_MB2_MIN_SPLITS = 4, WARPS_K_MB2_MAX_SPLIT_STEPS = 10, WARPS_K_MB2_MIN_CTAS_PCT = 90;
constexpr size_t MAX_WORKSPACE_BYTES = 32u << 20; // worst case any dispatch asks for (M <= 256: 2 splits of 256 x 8192 fp32)
// The tile counters sit in a fixed region at the start of the workspace, the partial sums after it.
// (A counter region sized per call let one call's partial sums land where a later call with more
// CTAs keeps counters: workspaces are reused, counters must read 0. Seen on H200: M=17 N=14336 after
// larger calls left tail tiles unwritten.)
constexpr size_t COUNTER_REGION_BYTES = 256u << 10;
constexpr long long MAX_SPLIT_CTAS = COUNTER_REGION_BYTES / sizeof(int);

struct Dispatch {
    int config;
    int k_splits;
};

static size_t workspace_bytes_for(const ConfigInfo& c, int M, int N, int k_splits) {
    if (k_splits <= 1) return 0;
    const long long n_ctas = ceil_div(ceil_div(N, UNIT_ROWS), c.mt * c.warps_n);
    const long long ctas = n_ctas * ceil_div(M, c.tile_m());
    return COUNTER_REGION_BYTES + (size_t)k_splits * ctas * c.tile_m() * c.tile_n() * 4;
}

// Whole splits per tile leave slots idle where tiles do not divide them (14336 x 4096: 56 tiles x 4 = 224 CTAs for 264
// slots). Stream-K for configs 2-3 (equal runs of (tile, k-step) pairs) was built and measured slower on all but 28672
// x 8192.
static int choose_splits(const ConfigInfo& c, int M, int N, int K_dim, int sm_count) {
    if (M > SPLIT_K_MAX_M || c.mb > 8) return 1; // mb 32: config 7, its splits come from ws_splits
    const int k_steps = ceil_div(K_dim, UNIT_K);
    const long long n_ctas = ceil_div(ceil_div(N, UNIT_ROWS), c.mt * c.warps_n);
    const long long ctas = n_ctas * ceil_div(M, c.tile_m());
    const long long target = (long long)c.ctas_per_sm() * (sm_count > 0 ? sm_count : 1);
    if (ctas >= target || ctas > MAX_SPLIT_CTAS) return 1;
    int splits = (int)(target / ctas); // floor: all CTAs resident in one wave (a second, partial wave costs ~2x)
    const bool reg_weights = c.shared_a_ctas > 0 && c.mb <= 2; // configs 2, 3
    const int max_by_k = k_steps / (c.warps_k * (reg_weights ? MIN_STEPS_PER_REG_WEIGHT_CTA : MIN_STEPS_PER_WARP));
    if (splits > max_by_k) splits = max_by_k;
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    while (splits > 1 && workspace_bytes_for(c, M, N, splits) > MAX_WORKSPACE_BYTES + COUNTER_REGION_BYTES) splits--;
    return splits < 1 ? 1 : splits;
}

// Config 7 (warp-specialised, 128 rows x 256 tokens) from WS_MIN_M tokens up to WS_MAX_M, when its CTAs (tiles x
// ws_splits) fill at least 3/4 of the SMs. Before it had split-K (the numbers below), only its tiles counted.
constexpr int WS_MIN_M = 129;
constexpr int WS_MAX_M = 4096;
constexpr int WS_MAX_M_SMALL_WEIGHT = 1024;
constexpr long long WS_LARGE_WEIGHT = 1LL << 25; // 4096 x 8192 and up, not 4096 x 4096
// Config 7 tiles of a launch
static long long ws_tiles(int M, int N) { return (long long)ceil_div(N, 128) * ceil_div(M, 256); }
// Config 7 split along k where its tiles leave SMs idle: as many splits as fit one CTA per SM, each of at least
// WS_MIN_SPLIT_STEPS k-steps (the LUT build and ring fill are paid per CTA), no empty split; partial tiles (128 KB of
// fp32 each) through the workspace slots of kbit_gemm.cuh section 5. Hence at least 24 k-steps.
constexpr int WS_MIN_SPLIT_STEPS = 24;
constexpr size_t WS_TILE_BYTES = 256 * 128 * 4; // one fp32 partial tile
// Without k splits, a partial last wave of config 7 that would leave more than half the SMs idle runs its tiles as
// two CTAs of half the k-steps each (kbit_gemm_wgmma_ws.cuh section 6): the tiles of the last
// wave of `tiles`, each half at least 8 k-steps.
static int ws_tail_tiles(long long tiles, int k_steps, int sm_count) {
    const long long sms = sm_count > 0 ? sm_count : 1;
    const long long tail = tiles % sms;
    return tiles > sms && tail > 0 && 2 * tail <= sms && k_steps >= 2 * WS_MIN_SPLIT_STEPS / 3 ? (int)tail : 0;
}
static size_t ws_partial_bytes(int M, int N, int K_dim, int k_splits, int sm_count) {
    if (k_splits > 1) return (size_t)k_splits * ws_tiles(M, N) * WS_TILE_BYTES;
    return (size_t)ws_tail_tiles(ws_tiles(M, N), ceil_div(K_dim, UNIT_K), sm_count) * 2 * WS_TILE_BYTES;
}
static int ws_splits(int M, int N, int K_dim, int sm_count) {
    const long long tiles = ws_tiles(M, N);
    const int k_steps = ceil_div(K_dim, UNIT_K);
    const long long sms = sm_count > 0 ? sm_count : 1;
    if (tiles >= sms || tiles > MAX_SPLIT_CTAS) return 1;
    long long splits = sms / tiles;
    if (splits > k_steps / WS_MIN_SPLIT_STEPS) splits = k_steps / WS_MIN_SPLIT_STEPS;
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    while (splits > 1 && ws_partial_bytes(M, N, K_dim, (int)splits, sm_count) > MAX_WORKSPACE_BYTES) splits--;
    if (splits <= 1) return 1;
    return ceil_div(k_steps, ceil_div(k_steps, splits)); // the last split is never empty
}
// counters and the partial tiles (k splits, or the halves of a split last wave); 0 when none is needed
static size_t ws_workspace_bytes(int M, int N, int K_dim, int k_splits, int sm_count) {
    const size_t partial = ws_partial_bytes(M, N, K_dim, k_splits, sm_count);
    return partial == 0 ? 0 : COUNTER_REGION_BYTES + partial;
}
// Above WS_MAX_M_SMALL_WEIGHT tokens a smaller weight keeps config 7 where its CTAs fill at least 9/10 of every wave,
// the last one included, k <= 4 and no k splits (ws_config_fits; what was measured): there the staged path pays its
// dequantize for no better waves.
static bool ws_small_weight_full_waves(long long ctas, int k_bits, int sm_count) {
    const long long sms = sm_count > 0 ? sm_count : 1, last_wave = ctas % sms;
    return k_bits <= 4 && 10 * ctas >= 9 * sms && (last_wave == 0 || 10 * last_wave >= 9 * sms);
}
static bool ws_config_fits(int M, int N, int K_dim, int k_bits, int sm_count) {
    if (M < WS_MIN_M || M > WS_MAX_M || !wgmma_available()) return false;
    const int splits = ws_splits(M, N, K_dim, sm_count);
    const long long ctas = ws_tiles(M, N) * splits;
    if (M > WS_MAX_M_SMALL_WEIGHT && (long long)N * K_dim < WS_LARGE_WEIGHT) // measured without k splits only
        return splits == 1 && ws_small_weight_full_waves(ctas, k_bits, sm_count);
    return 4 * ctas >= 3LL * (sm_count > 0 ? sm_count : 1);
}
// The staged path (dequantize + cuBLAS, backends/cuda/ops.py) above 256 tokens, unless config 7 takes the call
constexpr int FUSED_MAX_M = 256;
static bool staged_preferred(int M, int N, int K_dim, int k_bits, int sm_count) {
    return M > FUSED_MAX_M && !ws_config_fits(M, N, K_dim, k_bits, sm_count);
}

// Config 2 with 7 warps (config 10: 224-row tiles) where that takes work off the busiest SM. Split-K gives every tile
// the same whole number of splits in one wave, so 14336 x 4096 runs 56 tiles x 4 = 224 CTAs on 264 slots, and its
// busiest SMs stream 2 CTAs x 8 warps x 8 k-steps; as 64 tiles of 224 rows x 4 splits (256 CTAs) they stream 2 x 7 x
// 8. The load of the busiest SM: CTAs per SM (breadth-first placement) x warps x k-steps.
constexpr int SEVEN_WARP_CONFIG = 10;
// Config 3 as one 16-warp CTA per SM (config 11: 128-row tiles, 4 warps along n x 4 along k, the k warps summed in
// shared memory) where its tiles need no split-K and fill at least the share of the SMs that config 3's CTAs fill of
// its slots: 14336 x 4096 at M = 16 runs 112 CTAs of 32 k-steps instead of 56 tiles x 4 splits of 8 (224 CTAs on 264
// slots: the same 85%) and pays no workspace round trip.
constexpr int SIXTEEN_WARP_MIN_STEPS_PER_WARP = 4;
// Config 11 also where config 3 would cut K into >= 12 splits and config 11's CTAs (4x fewer splits) fill 70% of the
// SMs: at k = 5, where config 9 is slow, and at any k where its warps' chunks are 4 k-steps or shorter.
constexpr int SIXTEEN_WARP_MANY_SPLITS = 12, SIXTEEN_WARP_MIN_FILL_PCT = 70, SIXTEEN_WARP_SHORT_CHUNK = 4;
// And config 11 as 2 splits pushed through 2-CTA clusters (push_split_k) where those CTAs fill 90% of the SMs in one
// wave with chunks of 4-8 k-steps per warp along k: 8192 x 8192 at M = 16 runs 64 tiles x 2 splits (128 CTAs) instead
// of config 9's 4 splits through the workspace (or config 3's 8 at k = 5).
constexpr int SIXTEEN_WARP_PUSH_MIN_FILL_PCT = 90, SIXTEEN_WARP_PUSH_MAX_CHUNK = 8;
// Config 13 (224-row tiles, 7 warps along n x 2 along k, one CTA per SM) instead of config 11 at M = 9..16 where its
// plan (one split, or two pushed through 2-CTA clusters) puts CTAs on more SMs than config 11's and on at least
// FOURTEEN_WARP_MIN_FILL_PCT of them: a call is as long as one CTA, so less work on each of more SMs (14336 x 4096:
// 112 CTAs of 128 rows -> 128 of 224 rows x half of K).
constexpr int FOURTEEN_WARP_MIN_FILL_PCT = 95;
static long long sm_load(int config, int M, int N, int K_dim, int sm_count) {
    const ConfigInfo c = config_info(config);
    const int splits = choose_splits(c, M, N, K_dim, sm_count);
    const long long ctas = (long long)ceil_div(N, c.tile_n()) * ceil_div(M, c.tile_m()) * splits;
    const long long per_sm = ceil_div(ctas, sm_count > 0 ? sm_count : 1);
    return per_sm * c.warps_n * c.warps_k * ceil_div(ceil_div(K_dim, UNIT_K), splits);
}

// Share of a config's CTA slots (CTAs per SM x SMs) that its CTAs fill, in percent of its last wave
static long long slot_fill_pct(int config, int M, int N, int K_dim, int sm_count) {
    const ConfigInfo c = config_info(config);
    const long long ctas = (long long)ceil_div(N, c.tile_n()) * ceil_div(M, c.tile_m()) *
                           choose_splits(c, M, N, K_dim, sm_count);
    const long long slots = (long long)c.ctas_per_sm() * (sm_count > 0 ? sm_count : 1);
    return 100 * ctas / (ceil_div(ctas, slots) * slots);
}

static Dispatch select_config(int M, int N, int K_dim, int k_bits, int sm_count) {
    const long long sms = sm_count > 0 ? sm_count : 1;
    if (ws_config_fits(M, N, K_dim, k_bits, sm_count)) return Dispatch{WS_CONFIG, ws_splits(M, N, K_dim, sm_count)};
    const auto tiles = [&](int config) {
        const ConfigInfo c = config_info(config);
        return (long long)ceil_div(N, c.tile_n()) * ceil_div(M, c.tile_m());
    };
    const long long k_steps = ceil_div(K_dim, UNIT_K);
    const auto enough_work = [&](int config) { return tiles(config) * k_steps >= SHARED_A_MIN_STEPS_PER_SM * sms; };
    int config = FIRST_SHARED_A_CONFIG + (M <= 8 ? 0 : M <= 16 ? 1 : M <= 32 ? 2 : 3);
    if (config == WIDE_CONFIG && wgmma_available() && (enough_work(config) || M > WGMMA_SMALL_WORK_MIN_M))
        config = FIRST_WGMMA_CONFIG; // the wide tile with wgmma (kbit_gemm_wgmma.cuh), every k
    if (config == WIDE_CONFIG && (device_smem_optin() < 226 * 1024 || !enough_work(config)))
        config = WIDE_CONFIG - 1; // 32-token tiles: twice the CTAs, 112 KB
    if (M <= PER_WARP_MAX_M &&
        (M <= 8 || k_bits == 5 ? 2 * tiles(config) * k_steps < PER_WARP_MAX_STEPS_PER_2_SMS * sms
                               : 4 * tiles(config) * k_steps < PER_WARP_MID_M_MAX_STEPS_PER_4_SMS * sms))
    {
        if (M <= 4 || (M <= PER_WARP_SMALL_M_MAX && N <= PER_WARP_RING_A_MAX_N) ||
            (M > PER_WARP_SMALL_M_MAX && N <= PER_WARP_RING_A_MID_M_MAX_N &&
             (long long)N * K_dim <= PER_WARP_RING_A_MID_M_MAX_WEIGHT))
            config = 0;
        else if (M > PER_WARP_SMALL_M_MAX || (k_bits == 5 && k_steps < 2 * 2 * MIN_STEPS_PER_REG_WEIGHT_CTA))
            config = 1;
        // else M = 5..8 on more than PER_WARP_RING_A_MAX_N rows: the shared-A plan (config 2, 8 or 10 below)
    } else if (M > 8 && M <= PER_WARP_MAX_M && (long long)N * K_dim <= ONE_TILE_MID_M_MAX_WEIGHT)
        config = FIRST_SHARED_A_CONFIG; // one token tile per CTA, two on the grid
    // short K: config 8's two warps along k (>= 4 k-steps each) cannot be split further
    if (M <= PER_WARP_MAX_M &&
        (N >= SHORT_K_ONE_SPLIT_MIN_N || (M > 4 && k_bits <= 4 && N > SHORT_K_ONE_SPLIT_MID_M_MIN_N)) &&
        k_steps >= 2 * MIN_STEPS_PER_REG_WEIGHT_CTA &&
        k_steps < 2 * 2 * MIN_STEPS_PER_REG_WEIGHT_CTA)
        return Dispatch{FIRST_SHARED_A_CONFIG + WARPS_K_CONFIG_OFFSET, 1};
    const long long units = (long long)ceil_div(N, UNIT_ROWS) * k_steps;
    if (M > PER_WARP_MAX_M && M <= (k_bits == 5 ? SMALL_WEIGHT_MB2_MAX_M_K5 : SMALL_WEIGHT_MB2_MAX_M) &&
        units < SMALL_WEIGHT_MAX_UNITS_PER_SM * sms)
        config = FIRST_SHARED_A_CONFIG + 1; // 16-token tiles
    bool mid_m_l2 = false; // config 3 for 17..32 tokens from L2 (measured without the warps along k below)
    if (config == FIRST_SHARED_A_CONFIG + 2 && M <= MID_M_MAX) { // config 4 (17..32 tokens): the rule above the constants
        const long long weight_bytes = (long long)N * K_dim * (4 * k_bits + 1) / 32; // N K (k / 8 + 1 / 32)
        if (2 * weight_bytes <= device_l2_bytes())
            config = FIRST_SHARED_A_CONFIG + 1, mid_m_l2 = true; // 16-token tiles: the second reads the weight from L2
        else if (wgmma_available() &&
                 (k_bits == 3 || (k_bits == 4 && (long long)N * K_dim >= MID_M_WGMMA_K4_MIN_WEIGHT)))
            config = FIRST_WGMMA_CONFIG;
        // config 11 where its CTAs fill 90-100% of the SMs in one wave with short k chunks (the rule's constants)
        if (config_available(SIXTEEN_WARP_CONFIG)) {
            const int splits11 = choose_splits(config_info(SIXTEEN_WARP_CONFIG), M, N, K_dim, sm_count);
            const long long ctas11 = tiles(SIXTEEN_WARP_CONFIG) * splits11;
            const long long chunk = ceil_div(ceil_div(k_steps, splits11), 4); // k-steps per warp along k
            if (ctas11 <= sms && 100 * ctas11 >= MID_M_SIXTEEN_WARP_MIN_FILL_PCT * sms &&
                chunk >= SIXTEEN_WARP_MIN_STEPS_PER_WARP && chunk <= MID_M_SIXTEEN_WARP_MAX_CHUNK)
                return Dispatch{SIXTEEN_WARP_CONFIG, splits11};
        }
        // the wgmma config where configs 3 / 4 fill under 90% of their slots and it fills as many of its own
        if (config != FIRST_WGMMA_CONFIG && wgmma_available() && (long long)N * K_dim >= MID_M_FILL_RULE_MIN_WEIGHT &&
            slot_fill_pct(config, M, N, K_dim, sm_count) < MID_M_MIN_FILL_PCT &&
            slot_fill_pct(FIRST_WGMMA_CONFIG, M, N, K_dim, sm_count) >= slot_fill_pct(config, M, N, K_dim, sm_count))
            config = FIRST_WGMMA_CONFIG, mid_m_l2 = false;
    }
    // config 11 (128-row tiles, one 16-warp CTA per SM) for config 3's work planned as `splits3` splits
    const auto sixteen_warps_win = [&](int splits3) {
        if (!config_available(SIXTEEN_WARP_CONFIG)) return false;
        const long long t = tiles(SIXTEEN_WARP_CONFIG), ctas3 = tiles(FIRST_SHARED_A_CONFIG + 1) * splits3;
        // all resident without split-K, filling as large a share of the SMs as config 3's CTAs fill of its slots
        if (t <= sms && 2 * t >= ctas3 && 100 * t >= SIXTEEN_WARP_MIN_FILL_PCT * sms &&
            k_steps >= SIXTEEN_WARP_MIN_STEPS_PER_WARP * 4)
            return true;
        // or a quarter of config 3's many splits (SIXTEEN_WARP_MANY_SPLITS), or at k = 5 of the short ones that would
        // take config 9 at k <= 4
        const bool short_k5 = k_bits == 5 && splits3 >= WARPS_K_MIN_SPLITS &&
                              ceil_div(k_steps, splits3) <= WARPS_K_MAX_SPLIT_STEPS_K5;
        if (M > PER_WARP_MAX_M) return false;
        const int splits11 = choose_splits(config_info(SIXTEEN_WARP_CONFIG), M, N, K_dim, sm_count);
        const long long chunk = ceil_div(ceil_div(k_steps, splits11), 4); // k-steps per warp along k
        if (splits11 == 2 && split_k_push_max_splits() >= 2 && 2 * t <= sms &&
            100 * 2 * t >= SIXTEEN_WARP_PUSH_MIN_FILL_PCT * sms && chunk >= SIXTEEN_WARP_MIN_STEPS_PER_WARP &&
            chunk <= SIXTEEN_WARP_PUSH_MAX_CHUNK)
            return true;
        if (splits3 < SIXTEEN_WARP_MANY_SPLITS && !short_k5) return false;
        return 100 * t * splits11 >= SIXTEEN_WARP_MIN_FILL_PCT * sms &&
               (k_bits == 5 || chunk <= SIXTEEN_WARP_SHORT_CHUNK);
    };
    if (config == FIRST_SHARED_A_CONFIG || config == FIRST_SHARED_A_CONFIG + 1) {
        const int splits = choose_splits(config_info(config), M, N, K_dim, sm_count);
        const long long split_steps = ceil_div(k_steps, splits);
        bool warps_k; // two warps along k (configs 8, 9): half the splits
        if (config == FIRST_SHARED_A_CONFIG && M <= WARPS_K_ANY_STEPS_MAX_M)
            warps_k = splits >= WARPS_K_MIN_SPLITS;
        else if (config == FIRST_SHARED_A_CONFIG + 1 && M <= PER_WARP_MAX_M && k_bits != 5)
            warps_k = splits >= WARPS_K_MB2_MIN_SPLITS && split_steps <= WARPS_K_MB2_MAX_SPLIT_STEPS &&
                      100 * tiles(config + WARPS_K_CONFIG_OFFSET) *
                              choose_splits(config_info(config + WARPS_K_CONFIG_OFFSET), M, N, K_dim, sm_count) >=
                          WARPS_K_MB2_MIN_CTAS_PCT * tiles(config) * splits;
        else
            warps_k = splits >= WARPS_K_MIN_SPLITS &&
                      split_steps <= (k_bits == 5 ? WARPS_K_MAX_SPLIT_STEPS_K5 : WARPS_K_MAX_SPLIT_STEPS);
        if (config == FIRST_SHARED_A_CONFIG + 1 && !mid_m_l2 && sixteen_warps_win(splits)) {
            config = SIXTEEN_WARP_CONFIG; // the k chunks summed in shared memory instead of (most of the) split-K
            if (FOURTEEN_WARP_MIN_FILL_PCT > 0 && M > 8 && M <= PER_WARP_MAX_M &&
                config_available(FOURTEEN_WARP_CONFIG)) {
                const int splits13 = choose_splits(config_info(FOURTEEN_WARP_CONFIG), M, N, K_dim, sm_count);
                const long long ctas13 = tiles(FOURTEEN_WARP_CONFIG) * splits13,
                                ctas11 = tiles(SIXTEEN_WARP_CONFIG) *
                                         choose_splits(config_info(SIXTEEN_WARP_CONFIG), M, N, K_dim, sm_count);
                if ((splits13 == 1 || (splits13 == 2 && split_k_push_max_splits() >= 2)) && ctas13 <= sms &&
                    ctas13 > ctas11 && 100 * ctas13 >= FOURTEEN_WARP_MIN_FILL_PCT * sms)
                    return Dispatch{FOURTEEN_WARP_CONFIG, splits13};
            }
        } else if (!mid_m_l2 && warps_k)
            config += WARPS_K_CONFIG_OFFSET;
        else if (config == FIRST_SHARED_A_CONFIG &&
                 sm_load(SEVEN_WARP_CONFIG, M, N, K_dim, sm_count) < sm_load(config, M, N, K_dim, sm_count))
            config = SEVEN_WARP_CONFIG; // 224-row tiles: less work on the busiest SM
        const int warps_k_one_token = FIRST_SHARED_A_CONFIG + WARPS_K_CONFIG_OFFSET;
        if (M == 1 && k_bits <= 4 && (config == FIRST_SHARED_A_CONFIG || config == SEVEN_WARP_CONFIG) &&
            100 * slot_fill_pct(warps_k_one_token, M, N, K_dim, sm_count) >=
                (k_bits == 2 ? ONE_TOKEN_WARPS_K_MIN_FILL_RATIO_PCT : ONE_TOKEN_WARPS_K_MIN_FILL_RATIO_PCT_K34) *
                    slot_fill_pct(config, M, N, K_dim, sm_count))
            config = warps_k_one_token; // one token: half the splits (block columns, k <= 4)
        if (M == 1 && (k_bits == 3 || k_bits == 4) && split_k_push_max_splits() >= 2) {
            const int splits12 = choose_splits(config_info(ONE_TOKEN_DEEP_CONFIG), M, N, K_dim, sm_count);
            const long long chunk = ceil_div(ceil_div(k_steps, splits12), 8); // k-steps per warp
            const long long ctas12 = tiles(ONE_TOKEN_DEEP_CONFIG) * splits12;
            if (splits12 <= 2 && ctas12 <= 2 * sms && 100 * ceil_div(ctas12, sms) * sms <= ONE_TOKEN_DEEP_MAX_IMBALANCE_PCT * ctas12 &&
                chunk <= ONE_TOKEN_DEEP_MAX_CHUNK)
                return Dispatch{ONE_TOKEN_DEEP_CONFIG, splits12};
        }
    }
    return Dispatch{config, choose_splits(config_info(config), M, N, K_dim, sm_count)};
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
template <int K_BITS, typename AbsT>
static void repack(const int* packed_flat, const void* absmax_flat, int* B_packed, void* B_absmax, int N, int K_dim,
                   cudaStream_t stream) {
    using F = TiledFormat<K_BITS>;
    if (N < 1 || K_dim < 32 || K_dim % 32 != 0) {
        char d[96];
        snprintf(d, sizeof(d), "N=%d must be >= 1 and K_dim=%d a positive multiple of 32", N, K_dim);
        set_error("ckbit_repack", d);
        return;
    }
    const int k_steps = ceil_div(K_dim, UNIT_K);
    const long long units = (long long)ceil_div(N, UNIT_ROWS) * k_steps;
    const long long words = units * F::UNIT_WORDS;
    const long long absn = units * UNIT_ABSMAX;
    kbit_repack_words_kernel<K_BITS><<<(unsigned)((words + 255) / 256), 256, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(packed_flat), reinterpret_cast<uint32_t*>(B_packed), N, K_dim, k_steps, words);
    if (!check_launch("ckbit_repack words")) return;
    kbit_repack_absmax_kernel<AbsT><<<(unsigned)((absn + 255) / 256), 256, 0, stream>>>(
        reinterpret_cast<const AbsT*>(absmax_flat), reinterpret_cast<AbsT*>(B_absmax), N, K_dim, k_steps, absn);
    check_launch("ckbit_repack absmax");
}

// Opt `kernel` into `bytes` of dynamic shared memory on the current device, once per device
// (`done`: the caller's per-instantiation flags). false, with the message set, if the device refuses.
template <typename Kernel> static bool allow_dynamic_smem(Kernel kernel, int bytes, bool (&done)[64]) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 64 && done[dev]) return true;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) {
        check_launch("ckbit_gemm set smem attribute");
        return false;
    }
    if (dev < 64) done[dev] = true;
    return true;
}

// What every launcher does first: check that the config's shared memory fits the device, opt the kernel into
// it (once per device; `attr_set`: the launcher's per-instantiation flags) and write the split plan into p.
// false, with the message set, when the device cannot run it.
template <typename Kernel>
static bool prepare_launch(Kernel kernel, int smem_bytes, bool (&attr_set)[64], KbitGemmParams& p, int k_splits,
                           const char* config_kind) {
    const int optin = device_smem_optin();
    if (smem_bytes > optin) {
        char d[160];
        snprintf(d, sizeof(d), "this %s config needs %d bytes of shared memory per block; the device allows %d",
                 config_kind, smem_bytes, optin);
        set_error("ckbit_gemm", d);
        return false;
    }
    if (!allow_dynamic_smem(kernel, smem_bytes, attr_set)) return false;
    p.k_splits = k_splits;
    p.ks_per_split = ceil_div(p.k_steps, k_splits);
    return true;
}

// Programmatic dependent launch (PDL, sm_90): the per-warp and shared-A kernels (configs 0-5, 8-11) are launched
// with programmatic stream serialization. A kernel allows its dependents once its own loads are issued (after its
// k-loop; the register-weight loop at its last k-step), so the next call's CTAs take the SM slots this call's CTAs
// leave during its split-K arrivals, last reductions and grid completion, and start their prologue there;
// grid_dependency_wait, before a kernel's first read or write of global memory, holds them until this call is
// complete and its memory visible. Before the wait, one-token-tile CTAs with long splits prefetch their first
// weights into L2 (l2_prefetch_steps). Programmatic serialization needs sm_90.
static bool pdl_enabled() { return device_cc() >= 90; }

// k-steps of each warp's split that a shared-A kernel prefetches into L2 before its dependency wait (a hint: no value
// reaches an SM before the wait, so even weights the previous kernel wrote stay correct), with one token tile: the
// first 2 where a warp has at least 8 k-steps, the first 1 where it has 4 to 7. Launched early, the CTAs fill the
// previous call's idle tail with their first loads; launched after a plain kernel (no idle tail), the prefetch is a
// quarter of the warp's weights at most, fetched at once.
static int l2_prefetch_steps(int token_tiles, int steps_per_warp) {
    if (!pdl_enabled() || token_tiles > 1) return 0;
    return steps_per_warp >= 8 ? 2 : steps_per_warp >= 4 ? 1 : 0;
}

// launch, with programmatic stream serialization where pdl_enabled()
template <typename... Args>
static void launch_dependent(void (*kernel)(Args...), dim3 grid, int threads, int smem, cudaStream_t stream,
                             Args... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <class Cfg, typename T>
static void launch_gemm(KbitGemmParams& p, int k_splits, cudaStream_t stream) {
    static bool s_attr_set[64] = {};
    if (!prepare_launch(kbit_gemm_kernel<Cfg, T>, Cfg::SMEM_BYTES_MAX, s_attr_set, p, k_splits, "per-warp")) return;
    p.a_rows = p.M < Cfg::TILE_M ? p.M : Cfg::TILE_M;
    const dim3 grid(ceil_div(p.n16_tiles, Cfg::MT * Cfg::WARPS_N), k_splits, ceil_div(p.M, Cfg::TILE_M));
    launch_dependent(kbit_gemm_kernel<Cfg, T>, grid, Cfg::THREADS, Cfg::smem_bytes(p.a_rows), stream, p);
    check_launch("ckbit_gemm");
}

// Split-K through thread-block clusters. Config 6 (kbit_gemm_wgmma.cuh section 7) sums its splits over distributed
// shared memory; the shared-A configs, with exactly 2 splits, push split 1's partial into split 0's shared memory
// (push_split_k in kbit_gemm.cuh). Either only where every tile's cluster is resident at once
// (cudaOccupancyMaxActiveClusters, cached per kernel, device and split count); otherwise through the workspace.
// a launch of grid (x, k_splits) as clusters of cluster_y CTAs along the splits (attr: the caller's, it must outlive
// cfg)
static cudaLaunchConfig_t split_cluster_launch(dim3 grid, int cluster_y, int threads, int smem_bytes,
                                               cudaStream_t stream, cudaLaunchAttribute& attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads, 1, 1);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 1;
    attr.val.clusterDim.y = cluster_y;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cfg;
}

// whether `clusters` clusters of cluster_y CTAs of `kernel` are resident at once (cache: per device and cluster size)
template <typename Kernel>
static bool cluster_reduce_fits(Kernel kernel, long long clusters, int cluster_y, int threads, int smem_bytes,
                                short (&cache)[64][MAX_SPLITS + 1]) {
    if (cluster_y < 2 || cluster_y > 8) return false;
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev >= 64) return false;
    short& known = cache[dev][cluster_y];
    if (known == 0) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = split_cluster_launch(dim3(1, cluster_y), cluster_y, threads, smem_bytes, nullptr,
                                                            attr);
        int resident = 0;
        if (cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg) != cudaSuccess) {
            cudaGetLastError(); // a refusal only means: reduce through the workspace
            resident = 0;
        }
        known = resident <= 0 ? -1 : (short)(resident > 32767 ? 32767 : resident);
    }
    return known > 0 && (long long)known >= clusters;
}

// The shared-A push: 2-split launches run as 2-CTA clusters, split 1 pushing its partial into split 0's shared memory
// (push_split_k in kbit_gemm.cuh; no workspace, fence or counter). Only 2 splits push: more splits as pushing pairs
// whose sums meet in the workspace were no faster. Clusters need sm_90.
static int split_k_push_max_splits() { return device_cc() >= 90 ? 2 : 0; }

template <class Cfg, typename T> static void launch_shared_a(KbitGemmParams& p, int k_splits, cudaStream_t stream) {
    static bool s_attr_set[64] = {};
    if (!prepare_launch(kbit_gemm_shared_a_kernel<Cfg, T>, Cfg::SHARED_A_SMEM_BYTES, s_attr_set, p, k_splits, "shared-A"))
        return;
    p.a_rows = Cfg::TILE_M;
    p.l2_prefetch_steps = l2_prefetch_steps(Cfg::MB, ceil_div(p.ks_per_split, Cfg::WARPS_K));
    const dim3 grid(ceil_div(p.n16_tiles, Cfg::MT * Cfg::WARPS_N), k_splits, ceil_div(p.M, Cfg::TILE_M));
    static bool s_push_attr_set[64] = {};
    static short s_push_clusters[64][MAX_SPLITS + 1] = {};
    p.cluster_reduce = k_splits % 2 == 0 && k_splits <= split_k_push_max_splits() &&
                       Cfg::PUSH_SMEM_BYTES <= device_smem_optin() &&
                       allow_dynamic_smem(kbit_gemm_shared_a_kernel<Cfg, T>, Cfg::PUSH_SMEM_BYTES, s_push_attr_set) &&
                       cluster_reduce_fits(kbit_gemm_shared_a_kernel<Cfg, T>, (long long)grid.x * grid.z * k_splits / 2,
                                           2, Cfg::THREADS, Cfg::PUSH_SMEM_BYTES, s_push_clusters);
    if (p.cluster_reduce) {
        cudaLaunchAttribute attr[2];
        cudaLaunchConfig_t cfg = split_cluster_launch(grid, 2, Cfg::THREADS, Cfg::PUSH_SMEM_BYTES, stream, attr[0]);
        attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[1].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = pdl_enabled() ? 2 : 1;
        cudaLaunchKernelEx(&cfg, kbit_gemm_shared_a_kernel<Cfg, T>, p);
    } else {
        launch_dependent(kbit_gemm_shared_a_kernel<Cfg, T>, grid, Cfg::THREADS, Cfg::SHARED_A_SMEM_BYTES, stream, p);
    }
    check_launch("ckbit_gemm shared-A");
}

// One token on a one-tile config (M = 1) multiplies each quantization block into its own token column (BLOCK_COLUMNS,
// kbit_gemm.cuh section 3), for k = 2..4.
template <int K_BITS> constexpr bool block_columns_for(int mb) { return mb == 1 && K_BITS <= 4; }

template <int K_BITS, int MB, int MT, int CTAS, bool ABS_U8, int WK, int WN, typename T>
static void launch_shared_a_for_m(KbitGemmParams& p, int k_splits, cudaStream_t stream) {
    if constexpr (block_columns_for<K_BITS>(MB)) {
        if (p.M == 1) {
            launch_shared_a<KbitSharedAConfig<K_BITS, MB, MT, CTAS, ABS_U8, WK, WN, true>, T>(p, k_splits, stream);
            return;
        }
    }
    launch_shared_a<KbitSharedAConfig<K_BITS, MB, MT, CTAS, ABS_U8, WK, WN>, T>(p, k_splits, stream);
}

// Config 6 reduces split-K through a thread-block cluster when the k_splits CTAs of a tile can form a portable
// cluster (<= 8) and all are resident at once (cluster_reduce_fits)
constexpr int CLUSTER_MAX_STEPS = 32, CLUSTER_MAX_STEPS_FEWER = 8;
// grid: m tile fastest (kbit_gemm_wgmma.cuh section 5)
template <class Cfg, typename T> static void launch_wgmma(KbitGemmParams& p, int k_splits, cudaStream_t stream) {
    if (!wgmma_available()) {
        set_error("ckbit_gemm", "the wgmma configs need a compute capability 9.0 GPU and a library built for sm_90a");
        return;
    }
    static bool s_attr_set[64] = {};
    if (!prepare_launch(kbit_gemm_wgmma_kernel<Cfg, T>, Cfg::SMEM_BYTES, s_attr_set, p, k_splits, "wgmma")) return;
    p.a_rows = Cfg::TOK;
    const int tiles = ceil_div(p.n16_tiles, Cfg::MT * Cfg::WARPS_N) * ceil_div(p.M, Cfg::TOK);
    // the most splits, down to half the planned ones, whose clusters are all resident at once, where the reduction
    // weighs: CTAs of at most CLUSTER_MAX_STEPS k-steps (CLUSTER_MAX_STEPS_FEWER with fewer splits than planned)
    static short s_cluster[64][MAX_SPLITS + 1] = {};
    p.cluster_reduce = 0;
    for (int s = k_splits < 8 ? k_splits : 8; s >= 2 && 2 * s >= k_splits && !p.cluster_reduce; s--)
        if (ceil_div(p.k_steps, s) <= (s == k_splits ? CLUSTER_MAX_STEPS : CLUSTER_MAX_STEPS_FEWER) &&
            cluster_reduce_fits(kbit_gemm_wgmma_kernel<Cfg, T>, tiles, s, Cfg::THREADS, Cfg::SMEM_BYTES, s_cluster)) {
            p.cluster_reduce = 1;
            k_splits = s;
            p.k_splits = s;
            p.ks_per_split = ceil_div(p.k_steps, s);
        }
    const dim3 grid(tiles, k_splits);
    if (p.cluster_reduce) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = split_cluster_launch(grid, k_splits, Cfg::THREADS, Cfg::SMEM_BYTES, stream, attr);
        cudaLaunchKernelEx(&cfg, kbit_gemm_wgmma_kernel<Cfg, T>, p);
    } else {
        kbit_gemm_wgmma_kernel<Cfg, T><<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(p);
    }
    check_launch("ckbit_gemm wgmma");
}

// Config 7's token multicast (kbit_gemm_wgmma_ws.cuh section 8) launches clusters of 2 CTAs: whether the kernel can
// run them at all on this device (cached per device)
template <typename Kernel> static bool ws_multicast_fits(Kernel kernel, int threads, int smem_bytes) {
    static signed char s_known[64] = {};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev >= 64) return false;
    if (s_known[dev] == 0) {
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = split_cluster_launch(dim3(2, 1), 1, threads, smem_bytes, nullptr, attr);
        attr.val.clusterDim.x = 2, attr.val.clusterDim.y = 1;
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
            cudaGetLastError(); // a refusal only means: no multicast
            clusters = 0;
        }
        s_known[dev] = clusters > 0 ? 1 : -1;
    }
    return s_known[dev] > 0;
}

// config 7: encode the tensor map of A, launch one CTA per (128-row, 256-token) tile and k split, m tile fastest
template <class Cfg, typename T>
static void launch_wgmma_ws(KbitGemmParams& p, int k_splits, void* workspace, size_t workspace_bytes, int sm_count,
                            cudaStream_t stream) {
    if (!wgmma_available()) {
        set_error("ckbit_gemm", "the wgmma configs need a compute capability 9.0 GPU and a library built for sm_90a");
        return;
    }
    static bool s_attr_set[64] = {};
    if (!prepare_launch(kbit_gemm_wgmma_ws_kernel<Cfg, T>, Cfg::SMEM_BYTES, s_attr_set, p, k_splits, "wgmma-ws"))
        return;
    const size_t need = ws_workspace_bytes(p.M, p.N, p.K_dim, k_splits, sm_count);
    if (need > 0 && (workspace == nullptr || workspace_bytes < need)) {
        set_error("ckbit_gemm", "config 7 needs a workspace of ckbit_gemm_workspace_bytes");
        return;
    }
    p.counters = reinterpret_cast<int*>(workspace);
    p.partials = need > 0 ? reinterpret_cast<float*>(reinterpret_cast<char*>(workspace) + COUNTER_REGION_BYTES) : nullptr;
    const int n_tiles = ceil_div(p.n16_tiles, Cfg::CONSUMER_WARPS), tiles = n_tiles * ceil_div(p.M, Cfg::TOK);
    const int tail = k_splits > 1 ? 0 : ws_tail_tiles(tiles, p.k_steps, sm_count);
    p.ws_tail_from = tiles - tail;
    p.ws_multicast = k_splits == 1 && tail % 2 == 0 && n_tiles % 2 == 0 &&
                     ws_multicast_fits(kbit_gemm_wgmma_ws_kernel<Cfg, T>, Cfg::WS_THREADS, Cfg::SMEM_BYTES);
    CUtensorMap map;
    if (!make_token_map(&map, p.A, p.M, p.K_dim, p.lda, p.ws_multicast ? Cfg::TOK / 2 : Cfg::TOK)) {
        set_error("ckbit_gemm", "cuTensorMapEncodeTiled failed for the tokens");
        return;
    }
    const dim3 grid(tiles + tail, k_splits);
    if (p.ws_multicast) {
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = split_cluster_launch(grid, 1, Cfg::WS_THREADS, Cfg::SMEM_BYTES, stream, attr);
        attr.val.clusterDim.x = 2, attr.val.clusterDim.y = 1;
        cudaLaunchKernelEx(&cfg, kbit_gemm_wgmma_ws_kernel<Cfg, T>, p, map);
    } else {
        kbit_gemm_wgmma_ws_kernel<Cfg, T><<<grid, Cfg::WS_THREADS, Cfg::SMEM_BYTES, stream>>>(p, map);
    }
    check_launch("ckbit_gemm wgmma-ws");
}

template <int K_BITS, typename T, bool ABS_U8>
static void gemm(const void* A, const int* B_packed, const void* B_absmax, const float* codebook, int codebook_len,
                 const void* bias, void* C, int M, int N, int K_dim, int lda, void* workspace, size_t workspace_bytes,
                 int sm_count, int config_override, cudaStream_t stream) {
    g_last_error[0] = 0;
    if (M < 1 || N < 1 || K_dim < 32 || K_dim % 32 != 0 || lda < K_dim) {
        char d[160];
        snprintf(d, sizeof(d), "M=%d, N=%d must be >= 1, K_dim=%d a positive multiple of 32, lda=%d >= K_dim", M, N,
                 K_dim, lda);
        set_error("ckbit_gemm", d);
        return;
    }
    if (M > 65535 * 8 * 4) {
        set_error("ckbit_gemm", "M too large for the grid's z dimension");
        return;
    }
    Dispatch d = select_config(M, N, K_dim, K_BITS, sm_count);
    if (config_override >= 0) {
        if (config_override >= NUM_CONFIGS) {
            set_error("ckbit_gemm", "config_override out of range (see ckbit_gemm_num_configs)");
            return;
        }
        d.config = config_override;
        d.k_splits = d.config == WS_CONFIG ? ws_splits(M, N, K_dim, sm_count)
                                           : choose_splits(config_info(d.config), M, N, K_dim, sm_count);
    }
    if (d.config == WS_CONFIG) { // fewer splits, finally none, then config 6 when the caller's workspace is smaller
        while (d.k_splits > 1 && ws_workspace_bytes(M, N, K_dim, d.k_splits, sm_count) > workspace_bytes) d.k_splits--;
        const size_t need = ws_workspace_bytes(M, N, K_dim, 1, sm_count);
        const bool a_tma_ok = (reinterpret_cast<uintptr_t>(A) % 16 == 0) && (lda % 8 == 0);
        // no room for a split last wave (a workspace grown before, under capture), or an A the tensor map cannot read
        // (the op copies such views to contiguous first): config 6
        const bool no_room = need > 0 && (workspace == nullptr || workspace_bytes < need);
        if (no_room || !a_tma_ok) {
            d.config = FIRST_WGMMA_CONFIG;
            d.k_splits = choose_splits(config_info(d.config), M, N, K_dim, sm_count);
        }
    }
    if (d.config == FIRST_WGMMA_CONFIG && ((long long)M + 64) * lda * 2 >= (1ll << 32)) { // 32-bit token offsets (after
        // config 7's fallback to config 6 above)
        d.config = WIDE_CONFIG;
        d.k_splits = choose_splits(config_info(d.config), M, N, K_dim, sm_count);
    }
    const ConfigInfo ci = config_info(d.config);
    // fall back to fewer splits (finally none) when the caller's workspace is too small
    while (d.config != WS_CONFIG && d.k_splits > 1 && workspace_bytes_for(ci, M, N, d.k_splits) > workspace_bytes)
        d.k_splits--;
    if (d.k_splits > 1 && workspace == nullptr) d.k_splits = 1;

    KbitGemmParams p;
    set_tiled_weight(p, B_packed, B_absmax, codebook, codebook_len, N, K_dim);
    p.cluster_reduce = 0;
    p.ws_tail_from = 0x7fffffff;
    p.ws_multicast = 0;
    p.l2_prefetch_steps = 0;
    p.A = A;
    p.bias = bias;
    p.C = C;
    p.M = M;
    p.lda = lda;
    p.a_vec_ok = (reinterpret_cast<uintptr_t>(A) % 16 == 0) && (lda % 8 == 0);
    if (d.k_splits > 1) {
        p.counters = reinterpret_cast<int*>(workspace);  // [ctas], ctas <= MAX_SPLIT_CTAS
        p.partials = reinterpret_cast<float*>(reinterpret_cast<char*>(workspace) + COUNTER_REGION_BYTES);
    } else {
        p.counters = nullptr;
        p.partials = nullptr;
    }
    if (d.config == WS_CONFIG) {
        launch_wgmma_ws<KbitWsConfig<K_BITS, ABS_U8>, T>(p, d.k_splits, workspace, workspace_bytes, sm_count, stream);
        return;
    }
    switch (d.config) {
#define KBIT_LAUNCH(ID, MB, MT, WN, WK)                                                                              \
    case ID: launch_gemm<KbitGemmConfig<K_BITS, MB, MT, WN, WK, ABS_U8>, T>(p, d.k_splits, stream); break;
        KBIT_CONFIG_TABLE(KBIT_LAUNCH)
#undef KBIT_LAUNCH
#define KBIT_LAUNCH_SHARED_A(ID, MB, MT, CTAS, WK, WN)                                                               \
    case ID: launch_shared_a_for_m<K_BITS, MB, MT, CTAS, ABS_U8, WK, WN, T>(p, d.k_splits, stream); break;
        KBIT_SHARED_A_TABLE(KBIT_LAUNCH_SHARED_A)
#undef KBIT_LAUNCH_SHARED_A
#define KBIT_LAUNCH_WGMMA(ID, TOK, MT, WARPS)                                                                        \
    case ID: launch_wgmma<KbitWgmmaConfig<K_BITS, TOK, MT, WARPS, ABS_U8>, T>(p, d.k_splits, stream); break;
        KBIT_WGMMA_TABLE(KBIT_LAUNCH_WGMMA)
#undef KBIT_LAUNCH_WGMMA
    }
}

static size_t workspace_bytes(int M, int N, int K_dim, int k_bits, int sm_count) {
    size_t worst = 0;
    // the dispatcher's choice, and every override (so a test forcing a config gets its splits too)
    for (int c = 0; c < NUM_CONFIGS; c++) {
        const size_t b = workspace_bytes_for(config_info(c), M, N, choose_splits(config_info(c), M, N, K_dim, sm_count));
        if (b > worst) worst = b;
    }
    // config 7's partial tiles (the same for every k: a cached workspace then never grows between calls of
    // different k, and a CUDA graph captured with it keeps its address)
    if (wgmma_available()) {
        const size_t ws = ws_workspace_bytes(M, N, K_dim, ws_splits(M, N, K_dim, sm_count), sm_count);
        if (ws > worst) worst = ws;
    }
    (void)k_bits;
    return worst;
}

} // namespace kbit

// =============================================================================================
// C ABI
// =============================================================================================
extern "C" {

#define KBIT_REPACK_ENTRY(K, SUFFIX, ABST)                                                                           \
    int ckbit_repack_k##K##_##SUFFIX(const int* packed_flat, const void* absmax_flat, int* B_packed,                \
                                     void* B_absmax, int N, int K_dim, cudaStream_t stream) {                       \
        kbit::g_last_error[0] = 0;                                                                                   \
        kbit::repack<K, ABST>(packed_flat, absmax_flat, B_packed, B_absmax, N, K_dim, stream);                       \
        return kbit::g_last_error[0] != 0; /* 1: see ckbit_last_error */                                              \
    }
#define KBIT_REPACK_ENTRIES(K) KBIT_REPACK_ENTRY(K, u8abs, uint8_t) KBIT_REPACK_ENTRY(K, fp16abs, uint16_t)
KBIT_REPACK_ENTRIES(2)
KBIT_REPACK_ENTRIES(3)
KBIT_REPACK_ENTRIES(4)
KBIT_REPACK_ENTRIES(5)

#define KBIT_GEMM_ENTRY(DT, T, ABS, ABS_U8, K)                                                                       \
    int ckbit_gemm_##DT##_##ABS##_k##K(const void* A, const int* B_packed, const void* B_absmax,                    \
                                        const float* codebook, int codebook_len, const void* bias, void* C, int M,   \
                                        int N, int K_dim, int lda, void* workspace, size_t workspace_bytes,          \
                                        int sm_count, int config_override, cudaStream_t stream) {                    \
        kbit::g_last_error[0] = 0;                                                                                   \
        kbit::gemm<K, T, ABS_U8>(A, B_packed, B_absmax, codebook, codebook_len, bias, C, M, N, K_dim, lda,          \
                                 workspace, workspace_bytes, sm_count, config_override, stream);                    \
        return kbit::g_last_error[0] != 0; /* 1: see ckbit_last_error */                                              \
    }
#define KBIT_GEMM_ENTRIES(K)                                                                                         \
    KBIT_GEMM_ENTRY(fp16, __half, u8abs, true, K)                                                                    \
    KBIT_GEMM_ENTRY(fp16, __half, fp16abs, false, K)                                                                 \
    KBIT_GEMM_ENTRY(bf16, __nv_bfloat16, u8abs, true, K)                                                             \
    KBIT_GEMM_ENTRY(bf16, __nv_bfloat16, fp16abs, false, K)
KBIT_GEMM_ENTRIES(2)
KBIT_GEMM_ENTRIES(3)
KBIT_GEMM_ENTRIES(4)
KBIT_GEMM_ENTRIES(5)


size_t ckbit_gemm_workspace_bytes(int M, int N, int K_dim, int k_bits, int sm_count) {
    return kbit::workspace_bytes(M, N, K_dim, k_bits, sm_count);
}

int ckbit_gemm_num_configs(void) { return kbit::NUM_CONFIGS; }

// the dispatcher's plan for this call on the current device: config + 256 * k splits (benchmarks and tests print it)
int ckbit_gemm_plan(int M, int N, int K_dim, int k_bits, int sm_count) {
    const kbit::Dispatch d = kbit::select_config(M, N, K_dim, k_bits, sm_count);
    return d.config + 256 * d.k_splits;
}

// 1 when the dispatcher wants the staged path (dequantize + cuBLAS) for this call on the current device
int ckbit_gemm_staged_preferred(int M, int N, int K_dim, int k_bits, int sm_count) {
    return kbit::staged_preferred(M, N, K_dim, k_bits, sm_count) ? 1 : 0;
}

int ckbit_gemm_config_available(int config) { return kbit::config_available(config) ? 1 : 0; }

size_t ckbit_tiled_words(int k_bits, int N, int K_dim) {
    const size_t units = (size_t)((N + kbit::UNIT_ROWS - 1) / kbit::UNIT_ROWS) * ((K_dim + kbit::UNIT_K - 1) / kbit::UNIT_K);
    return units * 64 * (size_t)k_bits;
}

size_t ckbit_tiled_absmax(int N, int K_dim) {
    const size_t units = (size_t)((N + kbit::UNIT_ROWS - 1) / kbit::UNIT_ROWS) * ((K_dim + kbit::UNIT_K - 1) / kbit::UNIT_K);
    return units * kbit::UNIT_ABSMAX;
}

const char* ckbit_last_error(void) { return kbit::g_last_error; }

} // extern "C"
