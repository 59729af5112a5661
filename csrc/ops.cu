// Host launchers: the error slot of the C ABI, the runtime dispatch of (k, dtype, absmax format) onto the templates,
// launch geometry and the checks of what the kernels assume.
#include <cstdarg>
#include <cstdio>
#include <type_traits>

#include "kbit_tiled_unit.cuh"
#include "kernels.cuh"
#include "ops.cuh"

namespace kbit {

// --------------------------------------------------------------------------------------------------------------------
// Error slot
// --------------------------------------------------------------------------------------------------------------------
static thread_local char t_last_error[256] = "";

void clear_error() { t_last_error[0] = 0; }

int report_error(const char* op, const char* format, ...) {
    const int len = op != nullptr ? snprintf(t_last_error, sizeof(t_last_error), "%s: ", op) : 0;
    if (len >= 0 && static_cast<size_t>(len) < sizeof(t_last_error)) {
        va_list args;
        va_start(args, format);
        vsnprintf(t_last_error + len, sizeof(t_last_error) - len, format, args);
        va_end(args);
    }
    return 1;
}

const char* last_error() { return t_last_error; }

// 0, or 1 with the CUDA error of the launch just made (or an earlier asynchronous one) as the message
static int check_launch(const char* op) {
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? 0 : report_error(op, "%s", cudaGetErrorString(err));
}

// --------------------------------------------------------------------------------------------------------------------
// Runtime dispatch: each helper calls f with a tag of the template argument the code names, or reports the code.
// --------------------------------------------------------------------------------------------------------------------
template <typename T> struct Tag {
    using type = T;
};

template <typename F> static int with_dtype(const char* op, int dtype, F&& f) {
    switch (dtype) {
    case KBIT_DTYPE_FP16: return f(Tag<half>{});
    case KBIT_DTYPE_BF16: return f(Tag<__nv_bfloat16>{});
    case KBIT_DTYPE_FP32: return f(Tag<float>{});
    }
    return report_error(op, "dtype=%d, expected 0 (fp16), 1 (bf16) or 2 (fp32)", dtype);
}

template <typename F> static int with_absmax(const char* op, int absmax_format, F&& f) {
    switch (absmax_format) {
    case KBIT_ABSMAX_E4M4: return f(Tag<uint8_t>{});
    case KBIT_ABSMAX_FP16: return f(Tag<half>{});
    case KBIT_ABSMAX_FP32: return f(Tag<float>{});
    }
    return report_error(op, "absmax_format=%d, expected 0 (E4M4 uint8), 1 (fp16) or 2 (fp32)", absmax_format);
}

static bool codebook_fits(const char* op, int k, int codebook_len) {
    if (codebook_len >= 1 && codebook_len <= (1 << k))
        return true;
    report_error(op, "codebook_len=%d, expected 1..%d (2^k for k=%d)", codebook_len, 1 << k, k);
    return false;
}

// --------------------------------------------------------------------------------------------------------------------
// Flat quantize / dequantize
// --------------------------------------------------------------------------------------------------------------------
constexpr int kQuantizeThreads = 256;    // 8 warps = 8 quantization blocks per CTA pass
constexpr int kDequantizeThreads = 256;  // x kDequantizeElemsPerThread (8) = 64 blocks per CTA pass
constexpr long long kMaxGridX = 2147483647LL;
constexpr int kDequantizeCtasPerSm = 8;  // 8 x 256 threads = 2048, a full SM on sm_80 .. sm_90

// Multiprocessor count of the current device, queried once per device (the kernels stride, so
// this only sizes the grid; a failed query gives 1 SM's worth, still correct).
static int current_sm_count() {
    constexpr int kCachedDevices = 64;
    static int cached[kCachedDevices] = {0};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess)
        return 1;
    if (device < kCachedDevices && cached[device] > 0)
        return cached[device];
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1)
        sms = 1;
    if (device < kCachedDevices)
        cached[device] = sms;
    return sms;
}

// Both quantize kernels run one warp per 32-element block; the kernel strides if the grid is capped.
static unsigned quantize_grid(long long n) {
    const long long num_blocks = (n + kBlockElems - 1) / kBlockElems;
    const long long warps = kQuantizeThreads / 32;
    const long long grid = (num_blocks + warps - 1) / warps;
    return static_cast<unsigned>(grid < kMaxGridX ? grid : kMaxGridX);
}

// The flat formats' dispatch (quantize, quantize_mse, dequantize): f(k tag, T tag, ABSMAX_T tag) once k, dtype,
// absmax_format and codebook_len are valid.
template <typename F>
static int with_flat_format(const char* op, int k, int dtype, int absmax_format, int codebook_len, F&& f) {
    return with_k(op, k, [&](auto kb) {
        return with_dtype(op, dtype, [&](auto t) {
            return with_absmax(op, absmax_format, [&](auto a) {
                if (!codebook_fits(op, k, codebook_len))
                    return 1;
                return f(kb, t, a);
            });
        });
    });
}

int quantize(
    int k, int dtype, int absmax_format, const void* A, const float* codebook, int codebook_len, int32_t* packed,
    void* absmax, long long n, cudaStream_t stream
) {
    constexpr const char* op = "ckbit_quantize";
    return with_flat_format(op, k, dtype, absmax_format, codebook_len, [&](auto kb, auto t, auto a) {
        using T = typename decltype(t)::type;
        using ABSMAX_T = typename decltype(a)::type;
        if (n <= 0)
            return 0;
        launch_quantize_kbit<T, decltype(kb)::value, ABSMAX_T>(
            quantize_grid(n), kQuantizeThreads, stream, static_cast<const T*>(A), codebook, codebook_len,
            packed, static_cast<ABSMAX_T*>(absmax), n
        );
        return check_launch(op);
    });
}

int quantize_mse(
    int k, int dtype, int absmax_format, const void* A, const float* codebook, int codebook_len, int32_t* packed,
    void* absmax, long long n, int below, int above, cudaStream_t stream
) {
    constexpr const char* op = "ckbit_quantize_mse";
    return with_flat_format(op, k, dtype, absmax_format, codebook_len, [&](auto kb, auto t, auto a) {
        using T = typename decltype(t)::type;
        using ABSMAX_T = typename decltype(a)::type;
        if (below < 0 || above < 0)
            return report_error(op, "below=%d, above=%d, expected both >= 0", below, above);
        if (n <= 0)
            return 0;
        launch_quantize_kbit_mse<T, decltype(kb)::value, ABSMAX_T>(
            quantize_grid(n), kQuantizeThreads, stream, static_cast<const T*>(A), codebook, codebook_len,
            packed, static_cast<ABSMAX_T*>(absmax), n, below, above
        );
        return check_launch(op);
    });
}

int dequantize(
    int k, int dtype, int absmax_format, const int32_t* packed, const void* absmax, const float* codebook,
    int codebook_len, void* out, long long n, cudaStream_t stream
) {
    constexpr const char* op = "ckbit_dequantize";
    return with_flat_format(op, k, dtype, absmax_format, codebook_len, [&](auto kb, auto t, auto a) {
        using T = typename decltype(t)::type;
        using ABSMAX_T = typename decltype(a)::type;
        if (n <= 0)
            return 0;
        // the kernel strides over groups of kDequantizeElemsPerThread elements
        const long long groups = (n + kDequantizeElemsPerThread - 1) / kDequantizeElemsPerThread;
        const long long needed = (groups + kDequantizeThreads - 1) / kDequantizeThreads;
        const long long persistent = static_cast<long long>(current_sm_count()) * kDequantizeCtasPerSm;
        const long long grid = needed < persistent ? needed : persistent;
        // 16-byte stores need a 16-byte aligned output (a user's out= may be an offset view).
        const bool vector_store = reinterpret_cast<uintptr_t>(out) % 16 == 0;
        launch_dequantize_kbit<T, decltype(kb)::value, ABSMAX_T>(
            static_cast<unsigned>(grid), kDequantizeThreads, stream, packed,
            static_cast<const ABSMAX_T*>(absmax), codebook, codebook_len, static_cast<T*>(out), n,
            vector_store
        );
        return check_launch(op);
    });
}

// --------------------------------------------------------------------------------------------------------------------
// Tiled dequantize (the GEMM's layout; the staged large-M path)
// --------------------------------------------------------------------------------------------------------------------
int dequantize_tiled(
    int k, int dtype, int absmax_format, const int32_t* B_packed, const void* B_absmax, const float* codebook,
    int codebook_len, void* out, int N, int K_dim, int n_begin, int n_end, int k_begin, int k_end, cudaStream_t stream
) {
    constexpr const char* op = "ckbit_dequantize_tiled";
    if (dtype != KBIT_DTYPE_FP16 && dtype != KBIT_DTYPE_BF16)
        return report_error(op, "dtype=%d, expected 0 (fp16) or 1 (bf16)", dtype);
    if (absmax_format != KBIT_ABSMAX_E4M4 && absmax_format != KBIT_ABSMAX_FP16)
        return report_error(op, "absmax_format=%d, expected 0 (E4M4 uint8) or 1 (fp16)", absmax_format);
    return with_k(op, k, [&](auto kb) {
        return with_dtype(op, dtype, [&](auto t) -> int {
            using T = typename decltype(t)::type;
            if constexpr (std::is_same<T, float>::value) {
                return 1;  // excluded above
            } else {
                if (!codebook_fits(op, k, codebook_len))
                    return 1;
                if (K_dim % BLOCK_ELEMS != 0)
                    return report_error(op, "K_dim=%d, expected a multiple of %d", K_dim, BLOCK_ELEMS);
                if (n_begin < 0 || n_begin % UNIT_ROWS != 0 || n_end > N || k_begin < 0 || k_begin % UNIT_K != 0 ||
                    k_end > K_dim)
                    return report_error(
                        op,
                        "region [%d:%d, %d:%d] of a %d x %d weight, expected n_begin a multiple of %d, k_begin of %d, "
                        "both inside the weight",
                        n_begin, n_end, k_begin, k_end, N, K_dim, UNIT_ROWS, UNIT_K
                    );
                if (n_end <= n_begin || k_end <= k_begin)
                    return 0;
                TiledWeight w;
                set_tiled_weight(w, B_packed, B_absmax, codebook, codebook_len, N, K_dim);
                TiledRegion region;
                region.n16_begin = n_begin / UNIT_ROWS;
                region.n16_end = (n_end + UNIT_ROWS - 1) / UNIT_ROWS;
                region.ks_begin = k_begin / UNIT_K;
                region.ks_end = (k_end + UNIT_K - 1) / UNIT_K;
                region.n_end = n_end;
                region.k_end = k_end;
                // persistent: the pair table is built once per CTA (8 CTAs of 256 threads fill an SM)
                const unsigned grid = static_cast<unsigned>(current_sm_count()) * DEQ_TILED_CTAS_PER_SM;
                if (absmax_format == KBIT_ABSMAX_E4M4)
                    launch_dequantize_tiled<decltype(kb)::value, T, true>(
                        grid, DEQ_TILED_THREADS, stream, w, region, static_cast<T*>(out)
                    );
                else
                    launch_dequantize_tiled<decltype(kb)::value, T, false>(
                        grid, DEQ_TILED_THREADS, stream, w, region, static_cast<T*>(out)
                    );
                return check_launch(op);
            }
        });
    });
}

}  // namespace kbit
