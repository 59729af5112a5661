// kbit_gemm.cu: instantiations, host launchers, the dispatch function and the C ABI of the fused
// k-bit GEMM. The design (tiles, layout, pipeline, split-K) is in the block atop kbit_gemm.cuh.
#include "kbit_gemm.cuh"
#include "kbit_gemm_wgmma.cuh"
#include "kbit_gemm_wgmma_ws.cuh"
#include "ops.cuh"

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
    X(0, 1, 2, 2, 4) /* small weights, few tokens: one token tile, A in the ring, 2 units per warp           */
// Shared-A configs (KbitSharedAConfig: WARPS_N x WARPS_K warps, the A tile of a CTA step in one ring):
//   id  MB MT CTAs/SM WARPS_K WARPS_N   reason
#define KBIT_SHARED_A_TABLE(X)                                                                                       \
    X(2, 1, 2, 2, 1, 8) /* M <= 8:        256 x 8 CTA tile, 112 KB                                          */      \
    X(3, 2, 2, 2, 1, 8) /* 8 < M <= 16:   256 x 16                                                             */      \
    X(4, 4, 2, 2, 1, 8) /* M > 16:        256 x 32 (and M > 32 when the wide tiles would not fill 1/8 of the SMs) */   \
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
// warp-specialised wgmma configs (KbitWsConfig, sm_90a only: kbit_gemm_wgmma_ws.cuh): producer warps (bulk copies of
// the weights, TMA of the tokens) and 2 consumer warpgroups; 7 = 128 rows x 256 tokens, 14 = 128 rows x 128 tokens
// (half the padded MMA work of 7 where M <= 128 or 257..384, each weight dequantized once per 128 tokens)
constexpr int WS_CONFIG = 7, WS_CONFIG_128 = 14;
constexpr int NUM_CONFIGS = 15;
static bool is_ws(int config) { return config == WS_CONFIG || config == WS_CONFIG_128; }
static int ws_tok(int config) { return config == WS_CONFIG_128 ? 128 : 256; }
constexpr int SIXTEEN_WARP_CONFIG = 11;   // config 3 as 16 warps in a CTA per SM
constexpr int FOURTEEN_WARP_CONFIG = 13;  // config 11 as 224-row tiles: 14 warps in a CTA per SM
constexpr int FIRST_SHARED_A_CONFIG = 2; // + log2(MB)
// Ids 1 (per-warp, two token tiles) and 5 (shared-A, 256 x 64) are retired: in no cell of the dispatcher's calibration
// sweep was either 3% faster than every other candidate. The ids stay unused so the others keep theirs.
constexpr int RETIRED_CONFIG_A = 1, RETIRED_CONFIG_B = 5;
constexpr int FIRST_WGMMA_CONFIG = 6;

struct ConfigInfo {
    int mb, mt, warps_n, warps_k;
    int shared_a_ctas; // shared-A and wgmma configs: CTAs per SM; 0 for the per-warp config 0
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
    case WS_CONFIG_128: return ConfigInfo{16, 1, 8, 1, 1};
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
    if (id < 0 || id >= NUM_CONFIGS || id == RETIRED_CONFIG_A || id == RETIRED_CONFIG_B) return false;
    if (id == FIRST_WGMMA_CONFIG || is_ws(id)) return wgmma_available();
    if (id == SIXTEEN_WARP_CONFIG || id == FOURTEEN_WARP_CONFIG)
        return device_smem_optin() >= 226 * 1024;
    return true;
}
// ---------------------------------------------------------------------------------------------
// Dispatch: the ONE place that maps a problem to a kernel config and a split count.
// ---------------------------------------------------------------------------------------------
// A config's k splits follow from the hardware and the problem (plan_splits). Which config runs is a cost model. For every config this device runs, and for
// the staged path (dequantize + cuBLAS, backends/cuda/ops.py), the predicted time is a linear function of a few
// features of the problem under that config's tiling (cost_features: CTA waves, the busiest SM's warp k-steps,
// weight bytes, split-K partial bytes, padded MMA work); the least predicted time wins. The coefficients, per config
// and k, are fitted to measurements by the calibration script calibrate_dispatch.py (every config forced on model
// shapes x M x k, non-negative least squares on relative error) and live in kbit_dispatch_coef.inc; a config without
// coefficients is never picked. The sweep bounds where the model is trusted: a path up to the largest M it was
// measured at (COST_MAX_M in the table), at any M where that is the sweep's largest.
constexpr int SPLIT_K_MAX_M = 256;    // the mma.sync configs split k up to 256 tokens
constexpr int MIN_STEPS_PER_WARP = 1; // a warp streams at least 1 k-step of 128
// The register-weight configs (2, 3; mb <= 2) fill a 2-3 k-step ring before their first MMA: give each CTA at least 4
// k-steps.
constexpr int MIN_STEPS_PER_REG_WEIGHT_CTA = 4;
constexpr int MAX_SPLITS = 16;
static int split_k_push_max_splits();
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
    if (M > SPLIT_K_MAX_M || c.mb > 8) return 1; // mb 16, 32: configs 14, 7, their splits come from ws_splits
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

// Tiles of a launch of the warp-specialised configs (128 rows x tok tokens: 256 for config 7, 128 for 14)
static long long ws_tiles(int M, int N, int tok) { return (long long)ceil_div(N, 128) * ceil_div(M, tok); }
static size_t ws_tile_bytes(int tok) { return (size_t)tok * 128 * 4; } // one fp32 partial tile
// A k split of configs 7 / 14 runs at least WS_MIN_SPLIT_STEPS k-steps: it fills the 4-stage rings once.
constexpr int WS_MIN_SPLIT_STEPS = 4;
// Without k splits, a partial last wave of configs 7 / 14 that would leave more than half the SMs idle runs its tiles as
// two CTAs of half the k-steps each (kbit_gemm_wgmma_ws.cuh section 6): the tiles of the last wave of `tiles`, each
// half at least WS_MIN_HALF_STEPS k-steps.
constexpr int WS_MIN_HALF_STEPS = 8;
static int ws_tail_tiles(long long tiles, int k_steps, int sm_count) {
    const long long sms = sm_count > 0 ? sm_count : 1;
    const long long tail = tiles % sms;
    return tiles > sms && tail > 0 && 2 * tail <= sms && k_steps >= 2 * WS_MIN_HALF_STEPS ? (int)tail : 0;
}
static size_t ws_partial_bytes(int M, int N, int K_dim, int k_splits, int sm_count, int tok) {
    if (k_splits > 1) return (size_t)k_splits * ws_tiles(M, N, tok) * ws_tile_bytes(tok);
    return (size_t)ws_tail_tiles(ws_tiles(M, N, tok), ceil_div(K_dim, UNIT_K), sm_count) * 2 * ws_tile_bytes(tok);
}

// Splits along k for the tensor-core configs (6, 7, 14: one CTA per SM, tiles of thousands of MMAs per k-step), chosen
// by the busiest SM's time in k-steps:
//     waves(tiles x s) x (ceil(k_steps / s) + WAVE_CTA_STEPS) + (s > 1 ? s x WAVE_REDUCE_STEPS : 0)
// over s = 1 .. 16 with at least min_steps k-steps per split (a plan of more splits must cost 5% less). Whole waves count whole, so a second wave of more, shorter
// splits can win over one wave of few (4672 x 4544 at 256 tokens, config 14: 74 tiles on 132 SMs run 3 splits in 2
// waves of 12 k-steps instead of one wave of 36). WAVE_CTA_STEPS is a CTA's fixed cost (LUT build, ring fill,
// epilogue), WAVE_REDUCE_STEPS the last CTA's read of one split's fp32 partial tile (64-128 KB at one SM's share of L2
// bandwidth), both in k-steps of these tiles. The cost model (cost_features) then weighs the plans of every config.
constexpr double WAVE_CTA_STEPS = 3.0, WAVE_REDUCE_STEPS = 0.75, WAVE_GAIN = 0.95;
static double wave_cost(long long ctas, long long slots, int steps, int splits) {
    return (double)((ctas + slots - 1) / slots) * (steps + WAVE_CTA_STEPS) + (splits > 1 ? splits * WAVE_REDUCE_STEPS : 0.0);
}
template <class Fits>
static int wave_splits(long long tiles, int k_steps, long long slots, int min_steps, Fits&& fits, double cost_1) {
    int best = 1;
    double best_cost = cost_1;
    for (int s = 2; s <= MAX_SPLITS && tiles * s <= MAX_SPLIT_CTAS; s++) {
        const int steps = ceil_div(k_steps, s);
        if (steps < min_steps) break;
        if (ceil_div(k_steps, steps) < s) continue; // s splits of `steps` would leave one empty: s - 1 covers it
        if (!fits(s)) break;
        const double c = wave_cost(tiles * s, slots, steps, s);
        if (c < WAVE_GAIN * best_cost) best_cost = c, best = s; // more splits must win clearly: their traffic is real

    }
    return best;
}
static int ws_splits(int M, int N, int K_dim, int sm_count, int tok) {
    const long long tiles = ws_tiles(M, N, tok);
    const int k_steps = ceil_div(K_dim, UNIT_K);
    const long long sms = sm_count > 0 ? sm_count : 1;
    // one split: whole waves, and a partial last wave either whole or as two halves (ws_tail_tiles)
    const int tail = ws_tail_tiles(tiles, k_steps, sm_count);
    const double cost_1 = tail > 0 ? wave_cost(tiles - tail, sms, k_steps, 1) +
                                         (ceil_div(k_steps, 2) + WAVE_CTA_STEPS + 2 * WAVE_REDUCE_STEPS)
                                   : wave_cost(tiles, sms, k_steps, 1);
    const auto fits = [&](int s) { return ws_partial_bytes(M, N, K_dim, s, sm_count, tok) <= MAX_WORKSPACE_BYTES; };
    return wave_splits(tiles, k_steps, sms, WS_MIN_SPLIT_STEPS, fits, cost_1);
}
// config 6 (256 x 64 tiles, one CTA per SM): the same rule, its partial tiles through the workspace or a cluster
static int wgmma_splits(const ConfigInfo& c, int M, int N, int K_dim, int sm_count) {
    const long long tiles = (long long)ceil_div(ceil_div(N, UNIT_ROWS), c.mt * c.warps_n) * ceil_div(M, c.tile_m());
    const int k_steps = ceil_div(K_dim, UNIT_K);
    const long long slots = (long long)c.ctas_per_sm() * (sm_count > 0 ? sm_count : 1);
    const auto fits = [&](int s) { return workspace_bytes_for(c, M, N, s) <= MAX_WORKSPACE_BYTES + COUNTER_REGION_BYTES; };
    return wave_splits(tiles, k_steps, slots, MIN_STEPS_PER_WARP, fits, wave_cost(tiles, slots, k_steps, 1));
}
// the k splits of `config` for this problem: the one place every caller asks
static int plan_splits(int config, int M, int N, int K_dim, int sm_count) {
    if (is_ws(config)) return ws_splits(M, N, K_dim, sm_count, ws_tok(config));
    if (config == FIRST_WGMMA_CONFIG) return wgmma_splits(config_info(config), M, N, K_dim, sm_count);
    return choose_splits(config_info(config), M, N, K_dim, sm_count);
}
// counters and the partial tiles (k splits, or the halves of a split last wave); 0 when none is needed
static size_t ws_workspace_bytes(int M, int N, int K_dim, int k_splits, int sm_count, int tok) {
    const size_t partial = ws_partial_bytes(M, N, K_dim, k_splits, sm_count, tok);
    return partial == 0 ? 0 : COUNTER_REGION_BYTES + partial;
}
// Features of the problem under `config` (-1: the staged path), the cost model's inputs; returns how many it wrote.
constexpr int COST_FEATURES = 6;
static int cost_features(int config, int M, int N, int K_dim, int k_bits, int sm_count, float* out) {
    const double sms = sm_count > 0 ? sm_count : 1;
    if (config < 0) { // staged: dequantize the weight, one cuBLAS product
        out[0] = 1.f;
        out[1] = (float)((double)N * K_dim / 1e6);
        out[2] = (float)((double)M * N * K_dim / 1e9);
        out[3] = (float)((double)ceil_div(M, 128) * ceil_div(N, 128) / sms);
        out[4] = out[5] = 0.f;
        return COST_FEATURES;
    }
    const ConfigInfo c = config_info(config);
    const int splits = plan_splits(config, M, N, K_dim, sm_count);
    const long long k_steps = ceil_div(K_dim, UNIT_K);
    const long long m_tiles = ceil_div(M, c.tile_m());
    const long long ctas = (long long)ceil_div(N, c.tile_n()) * m_tiles * splits;
    const long long per_sm = (ctas + (long long)sms - 1) / (long long)sms;
    const long long slots = (long long)c.ctas_per_sm() * (long long)sms;
    const long long warp_steps = ceil_div(ceil_div(k_steps, splits), c.warps_k);
    out[0] = 1.f;
    // the busiest SM's warp k-steps per CTA slot, in token-tile units
    out[1] = (float)((double)per_sm * warp_steps * c.warps_n * c.warps_k / c.ctas_per_sm() * c.mb);
    out[2] = (float)((double)N * K_dim * (4 * k_bits + 1) / 32 / 1e6);                       // weight MB
    out[3] = splits > 1 ? (float)((double)ctas * c.tile_m() * c.tile_n() * 4 / 1e6) : 0.f;  // split-K partial MB
    out[4] = (float)((ctas + slots - 1) / slots);                                             // CTA waves
    out[5] = (float)((double)m_tiles * c.tile_m() * N * K_dim / 1e9);                         // padded MMA work
    return COST_FEATURES;
}

#include "kbit_dispatch_coef.inc" // COST_COEF[NUM_CONFIGS][4][COST_FEATURES], STAGED_COEF[4][COST_FEATURES]

static bool cost_calibrated(const float (&coef)[COST_FEATURES]) {
    for (float v : coef)
        if (v != 0.f) return true;
    return false;
}
// predicted microseconds of `config` (-1: staged); infinity where the model has no coefficients or is not trusted:
// above the largest M the calibration measured the path at, unless that was the sweep's largest M
static float predicted_us(int config, int M, int N, int K_dim, int k_bits, int sm_count) {
    const float(&coef)[COST_FEATURES] = config < 0 ? STAGED_COEF[k_bits - 2] : COST_COEF[config][k_bits - 2];
    if (!cost_calibrated(coef)) return INFINITY;
    const int max_m = config < 0 ? STAGED_MAX_M : COST_MAX_M[config];
    if (max_m < COST_ANY_M && M > max_m) return INFINITY;
    float f[COST_FEATURES];
    cost_features(config, M, N, K_dim, k_bits, sm_count, f);
    float t = 0.f;
    for (int i = 0; i < COST_FEATURES; i++) t += coef[i] * f[i];
    return t;
}

static Dispatch select_config(int M, int N, int K_dim, int k_bits, int sm_count) {
    int best = -1;
    float best_us = INFINITY;
    for (int c = 0; c < NUM_CONFIGS; c++) {
        if (!config_available(c)) continue;
        const float t = predicted_us(c, M, N, K_dim, k_bits, sm_count);
        if (t < best_us) best_us = t, best = c;
    }
    if (best < 0) best = FIRST_SHARED_A_CONFIG + 1; // no calibrated config runs here (M > SPLIT_K_MAX_M without sm_90a)
    return Dispatch{best, plan_splits(best, M, N, K_dim, sm_count)};
}

// The staged path where its predicted time is below every fused config's
static bool staged_preferred(int M, int N, int K_dim, int k_bits, int sm_count) {
    const float staged = predicted_us(-1, M, N, K_dim, k_bits, sm_count);
    if (!(staged < INFINITY)) return false;
    const Dispatch d = select_config(M, N, K_dim, k_bits, sm_count);
    return staged < predicted_us(d.config, M, N, K_dim, k_bits, sm_count);
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

// Programmatic dependent launch (PDL, sm_90): every fused kernel (the wgmma configs 6, 7, 14 too) is launched
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
// a clustered launch's config (attr[0]: its cluster dimension) with programmatic stream serialization in attr[1]
static void add_pdl_attribute(cudaLaunchConfig_t& cfg, cudaLaunchAttribute (&attr)[2]) {
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_enabled() ? 2 : 1;
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
        add_pdl_attribute(cfg, attr);
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
        cudaLaunchAttribute attr[2];
        cudaLaunchConfig_t cfg = split_cluster_launch(grid, k_splits, Cfg::THREADS, Cfg::SMEM_BYTES, stream, attr[0]);
        add_pdl_attribute(cfg, attr);
        cudaLaunchKernelEx(&cfg, kbit_gemm_wgmma_kernel<Cfg, T>, p);
    } else {
        launch_dependent(kbit_gemm_wgmma_kernel<Cfg, T>, grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream, p);
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
    const size_t need = ws_workspace_bytes(p.M, p.N, p.K_dim, k_splits, sm_count, Cfg::TOK);
    if (need > 0 && (workspace == nullptr || workspace_bytes < need)) {
        set_error("ckbit_gemm", "configs 7 and 14 need a workspace of ckbit_gemm_workspace_bytes");
        return;
    }
    p.counters = reinterpret_cast<int*>(workspace);
    p.partials = need > 0 ? reinterpret_cast<float*>(reinterpret_cast<char*>(workspace) + COUNTER_REGION_BYTES) : nullptr;
    const int n_tiles = ceil_div(p.n16_tiles, Cfg::CONSUMER_WARPS), tiles = n_tiles * ceil_div(p.M, Cfg::TOK);
    const int tail = k_splits > 1 ? 0 : ws_tail_tiles(tiles, p.k_steps, sm_count);
    p.ws_tail_from = tiles - tail;
    p.ws_multicast = tail % 2 == 0 && n_tiles % 2 == 0 && // with k splits too: a cluster's CTAs share the split
                     ws_multicast_fits(kbit_gemm_wgmma_ws_kernel<Cfg, T>, Cfg::WS_THREADS, Cfg::SMEM_BYTES);
    CUtensorMap map;
    if (!make_token_map(&map, p.A, p.M, p.K_dim, p.lda, p.ws_multicast ? Cfg::TOK / 2 : Cfg::TOK)) {
        set_error("ckbit_gemm", "cuTensorMapEncodeTiled failed for the tokens");
        return;
    }
    const dim3 grid(tiles + tail, k_splits);
    if (p.ws_multicast) {
        cudaLaunchAttribute attr[2];
        cudaLaunchConfig_t cfg = split_cluster_launch(grid, 1, Cfg::WS_THREADS, Cfg::SMEM_BYTES, stream, attr[0]);
        attr[0].val.clusterDim.x = 2, attr[0].val.clusterDim.y = 1;
        add_pdl_attribute(cfg, attr);
        cudaLaunchKernelEx(&cfg, kbit_gemm_wgmma_ws_kernel<Cfg, T>, p, map);
    } else {
        launch_dependent(kbit_gemm_wgmma_ws_kernel<Cfg, T>, grid, Cfg::WS_THREADS, Cfg::SMEM_BYTES, stream, p, map);
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
        if (!config_available(config_override)) {
            set_error("ckbit_gemm", "config_override names a config this device or build does not run "
                                    "(see ckbit_gemm_config_available)");
            return;
        }
        d.config = config_override;
        d.k_splits = plan_splits(d.config, M, N, K_dim, sm_count);
    }
    if (is_ws(d.config)) { // fewer splits, finally none, then config 6 when the caller's workspace is smaller
        const int tok = ws_tok(d.config);
        while (d.k_splits > 1 && ws_workspace_bytes(M, N, K_dim, d.k_splits, sm_count, tok) > workspace_bytes)
            d.k_splits--;
        const size_t need = ws_workspace_bytes(M, N, K_dim, 1, sm_count, tok);
        const bool a_tma_ok = (reinterpret_cast<uintptr_t>(A) % 16 == 0) && (lda % 8 == 0);
        // no room for a split last wave (a workspace grown before, under capture), or an A the tensor map cannot read
        // (the op copies such views to contiguous first): config 6
        const bool no_room = need > 0 && (workspace == nullptr || workspace_bytes < need);
        if (no_room || !a_tma_ok) {
            d.config = FIRST_WGMMA_CONFIG;
            d.k_splits = plan_splits(d.config, M, N, K_dim, sm_count);
        }
    }
    if (d.config == FIRST_WGMMA_CONFIG && ((long long)M + 64) * lda * 2 >= (1ll << 32)) { // 32-bit token offsets (after
        // configs 7 / 14's fallback to config 6 above)
        d.config = FIRST_SHARED_A_CONFIG + 2; // 256 x 32 tiles, 64-bit offsets
        d.k_splits = plan_splits(d.config, M, N, K_dim, sm_count);
    }
    const ConfigInfo ci = config_info(d.config);
    // fall back to fewer splits (finally none) when the caller's workspace is too small
    while (!is_ws(d.config) && d.k_splits > 1 && workspace_bytes_for(ci, M, N, d.k_splits) > workspace_bytes)
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
        launch_wgmma_ws<KbitWsConfig<K_BITS, ABS_U8, 256>, T>(p, d.k_splits, workspace, workspace_bytes, sm_count, stream);
        return;
    }
    if (d.config == WS_CONFIG_128) {
        launch_wgmma_ws<KbitWsConfig<K_BITS, ABS_U8, 128>, T>(p, d.k_splits, workspace, workspace_bytes, sm_count, stream);
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
        if (is_ws(c)) continue; // below
        const size_t b = workspace_bytes_for(config_info(c), M, N, plan_splits(c, M, N, K_dim, sm_count));
        if (b > worst) worst = b;
    }
    // configs 7 and 14's partial tiles (the same for every k: a cached workspace then never grows between calls of
    // different k, and a CUDA graph captured with it keeps its address)
    if (wgmma_available()) {
        for (int tok : {256, 128}) {
            const size_t ws = ws_workspace_bytes(M, N, K_dim, ws_splits(M, N, K_dim, sm_count, tok), sm_count, tok);
            if (ws > worst) worst = ws;
        }
    }
    (void)k_bits;
    return worst;
}

} // namespace kbit

// =============================================================================================
// C ABI: repack, GEMM and the dispatcher's queries. k, the activation dtype and the absmax storage are runtime
// arguments with the codes and the error convention of ops.cuh (0 = success, 1 = failure, message in
// ckbit_last_error); the launchers above keep their message in g_last_error, which the entries hand over.
// =============================================================================================
namespace kbit {

// The test hook's overrides for the calling thread (ckbit_gemm_set_test_override; -1: none).
static thread_local int t_config_override = -1;
static thread_local int t_sm_count_override = -1;

// sm_count > 0 as given; else the test override, else the current device's multiprocessor count
static int effective_sm_count(int sm_count) {
    if (sm_count > 0) return sm_count;
    if (t_sm_count_override > 0) return t_sm_count_override;
    return cached_device_attribute<cudaDevAttrMultiProcessorCount>();
}

// units (16 rows x 128 k) of the tiled layout of W[N, K_dim]
static size_t tiled_units(int N, int K_dim) {
    return (size_t)((N + UNIT_ROWS - 1) / UNIT_ROWS) * ((K_dim + UNIT_K - 1) / UNIT_K);
}

// 0, or 1 with the launchers' message moved to the ABI's error slot
static int handed_over() { return g_last_error[0] != 0 ? report_error(nullptr, "%s", g_last_error) : 0; }

} // namespace kbit

extern "C" {

// The tiled layout (kbit_gemm.cuh, TiledFormat) of a flat k-bit weight W[N, K_dim]; absmax E4M4 or fp16.
int ckbit_repack(int k, int absmax_format, const int* packed_flat, const void* absmax_flat, int* B_packed,
                 void* B_absmax, int N, int K_dim, cudaStream_t stream) {
    kbit::clear_error();
    kbit::g_last_error[0] = 0;
    if (absmax_format != KBIT_ABSMAX_E4M4 && absmax_format != KBIT_ABSMAX_FP16)
        return kbit::report_error("ckbit_repack", "absmax_format=%d, expected 0 (E4M4 uint8) or 1 (fp16)",
                                  absmax_format);
    return kbit::with_k("ckbit_repack", k, [&](auto kb) {
        constexpr int K_BITS = decltype(kb)::value;
        if (absmax_format == KBIT_ABSMAX_E4M4)
            kbit::repack<K_BITS, uint8_t>(packed_flat, absmax_flat, B_packed, B_absmax, N, K_dim, stream);
        else
            kbit::repack<K_BITS, uint16_t>(packed_flat, absmax_flat, B_packed, B_absmax, N, K_dim, stream);
        return kbit::handed_over();
    });
}

// C[M, N] = A[M, K_dim] (row stride lda) @ W^T (+ bias[N]) for a repacked weight W; dtype fp16 or bf16 (A, bias and
// C), absmax E4M4 or fp16. workspace: zero-initialised, of ckbit_gemm_workspace_bytes (fewer bytes, or none, give
// fewer k splits); the kernels leave it zeroed. Plans for the current device (ckbit_gemm_set_test_override aside).
int ckbit_gemm(int k, int dtype, int absmax_format, const void* A, const int* B_packed, const void* B_absmax,
               const float* codebook, int codebook_len, const void* bias, void* C, int M, int N, int K_dim, int lda,
               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    constexpr const char* op = "ckbit_gemm";
    kbit::clear_error();
    kbit::g_last_error[0] = 0;
    if (dtype != KBIT_DTYPE_FP16 && dtype != KBIT_DTYPE_BF16)
        return kbit::report_error(op, "dtype=%d, expected 0 (fp16) or 1 (bf16)", dtype);
    if (absmax_format != KBIT_ABSMAX_E4M4 && absmax_format != KBIT_ABSMAX_FP16)
        return kbit::report_error(op, "absmax_format=%d, expected 0 (E4M4 uint8) or 1 (fp16)", absmax_format);
    const int sm_count = kbit::effective_sm_count(0);
    return kbit::with_k(op, k, [&](auto kb) {
        constexpr int K_BITS = decltype(kb)::value;
        if (codebook_len < 1 || codebook_len > (1 << K_BITS))
            return kbit::report_error(op, "codebook_len=%d, expected 1..%d (2^k for k=%d)", codebook_len, 1 << K_BITS,
                                      K_BITS);
        const bool fp16 = dtype == KBIT_DTYPE_FP16, abs_u8 = absmax_format == KBIT_ABSMAX_E4M4;
        auto run = [&](auto gemm_fn) {
            gemm_fn(A, B_packed, B_absmax, codebook, codebook_len, bias, C, M, N, K_dim, lda, workspace,
                    workspace_bytes, sm_count, kbit::t_config_override, stream);
            return kbit::handed_over();
        };
        if (fp16) return abs_u8 ? run(kbit::gemm<K_BITS, __half, true>) : run(kbit::gemm<K_BITS, __half, false>);
        return abs_u8 ? run(kbit::gemm<K_BITS, __nv_bfloat16, true>) : run(kbit::gemm<K_BITS, __nv_bfloat16, false>);
    });
}

// The one test hook: for the calling thread's later ckbit_gemm calls, force kernel config `config` (the dispatcher
// still picks its k splits) and/or plan for `sm_count` SMs instead of the device's (the queries below take it too
// when their sm_count is <= 0); -1 (any negative) clears either. Lets tests reach every config and split on any GPU.
void ckbit_gemm_set_test_override(int config, int sm_count) {
    kbit::t_config_override = config < 0 ? -1 : config;
    kbit::t_sm_count_override = sm_count <= 0 ? -1 : sm_count;
}

// The queries take sm_count <= 0 as the current device's count (or the test override's).

// Bytes of split-K workspace ckbit_gemm may use for this problem (the same for every k)
size_t ckbit_gemm_workspace_bytes(int M, int N, int K_dim, int k, int sm_count) {
    return kbit::workspace_bytes(M, N, K_dim, k, kbit::effective_sm_count(sm_count));
}

int ckbit_gemm_num_configs(void) { return kbit::NUM_CONFIGS; }

// the dispatcher's plan for this call on the current device: config + 256 * k splits (benchmarks and tests print it)
int ckbit_gemm_plan(int M, int N, int K_dim, int k, int sm_count) {
    const kbit::Dispatch d = kbit::select_config(M, N, K_dim, k, kbit::effective_sm_count(sm_count));
    return d.config + 256 * d.k_splits;
}

// 1 when the dispatcher wants the staged path (dequantize + cuBLAS) for this call on the current device
int ckbit_gemm_staged_preferred(int M, int N, int K_dim, int k, int sm_count) {
    return kbit::staged_preferred(M, N, K_dim, k, kbit::effective_sm_count(sm_count)) ? 1 : 0;
}

// the cost model's features of this problem under `config` (-1: the staged path) into out[]; returns their count
// (the calibration script fits the coefficients to them; no device is touched when sm_count > 0)
int ckbit_gemm_cost_features(int config, int M, int N, int K_dim, int k, int sm_count, float* out) {
    if (config >= kbit::NUM_CONFIGS || k < 2 || k > 5) return 0;
    return kbit::cost_features(config, M, N, K_dim, k, kbit::effective_sm_count(sm_count), out);
}

int ckbit_gemm_config_available(int config) { return kbit::config_available(config) ? 1 : 0; }

// int32 words and absmax entries of the tiled layout of W[N, K_dim]
size_t ckbit_tiled_words(int k, int N, int K_dim) {
    return kbit::tiled_units(N, K_dim) * 64 * (size_t)k;
}

size_t ckbit_tiled_absmax(int N, int K_dim) { return kbit::tiled_units(N, K_dim) * kbit::UNIT_ABSMAX; }

} // extern "C"
