// Host launchers: launch geometry and the checks of what the kernels assume.
#include "kbit_tiled_unit.cuh"
#include "kernels.cuh"
#include "ops.cuh"

namespace kbit {

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

template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t quantize_kbit(
    const T* A, const float* codebook, int codebook_len, int32_t* packed, ABSMAX_T* absmax, long long n,
    cudaStream_t stream
) {
    if (n <= 0)
        return cudaSuccess;
    if (codebook_len < 1 || codebook_len > (1 << K_BITS))
        return cudaErrorInvalidValue;
    const long long num_blocks = (n + kBlockElems - 1) / kBlockElems;
    const long long warps = kQuantizeThreads / 32;
    const long long grid = (num_blocks + warps - 1) / warps;  // the kernel strides if this is capped
    launch_quantize_kbit<T, K_BITS, ABSMAX_T>(
        static_cast<unsigned>(grid < kMaxGridX ? grid : kMaxGridX), kQuantizeThreads, stream, A, codebook,
        codebook_len, packed, absmax, n
    );
    return cudaGetLastError();
}

template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t quantize_kbit_mse(
    const T* A, const float* codebook, int codebook_len, int32_t* packed, ABSMAX_T* absmax, long long n, int below,
    int above, cudaStream_t stream
) {
    if (n <= 0)
        return cudaSuccess;
    if (codebook_len < 1 || codebook_len > (1 << K_BITS) || below < 0 || above < 0)
        return cudaErrorInvalidValue;
    const long long num_blocks = (n + kBlockElems - 1) / kBlockElems;
    const long long warps = kQuantizeThreads / 32;
    const long long grid = (num_blocks + warps - 1) / warps;  // the kernel strides if this is capped
    launch_quantize_kbit_mse<T, K_BITS, ABSMAX_T>(
        static_cast<unsigned>(grid < kMaxGridX ? grid : kMaxGridX), kQuantizeThreads, stream, A, codebook,
        codebook_len, packed, absmax, n, below, above
    );
    return cudaGetLastError();
}

template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t dequantize_kbit(
    const int32_t* packed, const ABSMAX_T* absmax, const float* codebook, int codebook_len, T* out, long long n,
    cudaStream_t stream
) {
    if (n <= 0)
        return cudaSuccess;
    if (codebook_len < 1 || codebook_len > (1 << K_BITS))
        return cudaErrorInvalidValue;
    const long long groups = (n + kDequantizeElemsPerThread - 1) / kDequantizeElemsPerThread;  // the kernel strides
    const long long needed = (groups + kDequantizeThreads - 1) / kDequantizeThreads;
    const long long persistent = static_cast<long long>(current_sm_count()) * kDequantizeCtasPerSm;
    const long long grid = needed < persistent ? needed : persistent;
    // 16-byte stores need a 16-byte aligned output (a user's out= may be an offset view).
    const bool vector_store = reinterpret_cast<uintptr_t>(out) % 16 == 0;
    launch_dequantize_kbit<T, K_BITS, ABSMAX_T>(
        static_cast<unsigned>(grid), kDequantizeThreads, stream, packed, absmax, codebook, codebook_len, out, n,
        vector_store
    );
    return cudaGetLastError();
}

template <int K_BITS, typename T, bool ABS_U8>
cudaError_t dequantize_tiled(
    const int32_t* B_packed, const void* B_absmax, const float* codebook, int codebook_len, T* out, int N, int K_dim,
    int n_begin, int n_end, int k_begin, int k_end, cudaStream_t stream
) {
    if (n_begin % UNIT_ROWS != 0 || n_begin < 0 || n_end > N || K_dim % BLOCK_ELEMS != 0 || k_begin % UNIT_K != 0 ||
        k_begin < 0 || k_end > K_dim)
        return cudaErrorInvalidValue;
    if (n_end <= n_begin || k_end <= k_begin)
        return cudaSuccess;
    TiledWeight w;
    set_tiled_weight(w, B_packed, B_absmax, codebook, codebook_len, N, K_dim);
    // persistent: the pair table is built once per CTA (8 CTAs of 256 threads fill an SM)
    TiledRegion region;
    region.n16_begin = n_begin / UNIT_ROWS;
    region.n16_end = (n_end + UNIT_ROWS - 1) / UNIT_ROWS;
    region.ks_begin = k_begin / UNIT_K;
    region.ks_end = (k_end + UNIT_K - 1) / UNIT_K;
    region.n_end = n_end;
    region.k_end = k_end;
    launch_dequantize_tiled<K_BITS, T, ABS_U8>(
        static_cast<unsigned>(current_sm_count()) * DEQ_TILED_CTAS_PER_SM, DEQ_TILED_THREADS, stream, w, region, out
    );
    return cudaGetLastError();
}

#define KBIT_TILED_LAUNCHERS(K_BITS)                                                                                   \
    template cudaError_t dequantize_tiled<K_BITS, half, true>(                                                         \
        const int32_t*, const void*, const float*, int, half*, int, int, int, int, int, int, cudaStream_t              \
    );                                                                                                                 \
    template cudaError_t dequantize_tiled<K_BITS, half, false>(                                                        \
        const int32_t*, const void*, const float*, int, half*, int, int, int, int, int, int, cudaStream_t              \
    );                                                                                                                 \
    template cudaError_t dequantize_tiled<K_BITS, __nv_bfloat16, true>(                                                \
        const int32_t*, const void*, const float*, int, __nv_bfloat16*, int, int, int, int, int, int, cudaStream_t     \
    );                                                                                                                 \
    template cudaError_t dequantize_tiled<K_BITS, __nv_bfloat16, false>(                                               \
        const int32_t*, const void*, const float*, int, __nv_bfloat16*, int, int, int, int, int, int, cudaStream_t     \
    );
KBIT_TILED_LAUNCHERS(2)
KBIT_TILED_LAUNCHERS(3)
KBIT_TILED_LAUNCHERS(4)
KBIT_TILED_LAUNCHERS(5)

#define KBIT_LAUNCHERS(T, ABSMAX_T, K_BITS)                                                                            \
    template cudaError_t quantize_kbit<T, K_BITS, ABSMAX_T>(                                                           \
        const T*, const float*, int, int32_t*, ABSMAX_T*, long long, cudaStream_t                                      \
    );                                                                                                                 \
    template cudaError_t quantize_kbit_mse<T, K_BITS, ABSMAX_T>(                                                       \
        const T*, const float*, int, int32_t*, ABSMAX_T*, long long, int, int, cudaStream_t                            \
    );                                                                                                                 \
    template cudaError_t dequantize_kbit<T, K_BITS, ABSMAX_T>(                                                         \
        const int32_t*, const ABSMAX_T*, const float*, int, T*, long long, cudaStream_t                                \
    );
#define KBIT_LAUNCHERS_K(T, ABSMAX_T)                                                                                  \
    KBIT_LAUNCHERS(T, ABSMAX_T, 2) KBIT_LAUNCHERS(T, ABSMAX_T, 3) KBIT_LAUNCHERS(T, ABSMAX_T, 4)                       \
        KBIT_LAUNCHERS(T, ABSMAX_T, 5)
#define KBIT_LAUNCHERS_ABSMAX(T)                                                                                       \
    KBIT_LAUNCHERS_K(T, uint8_t) KBIT_LAUNCHERS_K(T, half) KBIT_LAUNCHERS_K(T, float)

KBIT_LAUNCHERS_ABSMAX(half)
KBIT_LAUNCHERS_ABSMAX(__nv_bfloat16)
KBIT_LAUNCHERS_ABSMAX(float)

}  // namespace kbit
