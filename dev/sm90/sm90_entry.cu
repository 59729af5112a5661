// Development entry for the sm_90a large-M kernel (not shipped): C ABI over kbit_gemm_sm90_kernel.
#include "kbit_gemm_sm90.cuh"
using namespace kbit;
using namespace kbit::sm90;

template <int K_BITS, typename T, bool ABS_U8, class Cfg>
static int launch(const void* A, const int* B, const void* B_absmax, const float* cb, int cb_len, const void* bias, void* C,
                  int M, int N, int K_dim, int lda, int grid_override, cudaStream_t stream) {
    Sm90Params p;
    p.dev_mode = grid_override < 0 ? -grid_override : 0;
    if (grid_override < 0) grid_override = 0;
    p.A = A; p.B = reinterpret_cast<const uint32_t*>(B); p.B_absmax = B_absmax; p.codebook = cb; p.codebook_len = cb_len;
    p.bias = bias; p.C = C; p.M = M; p.N = N; p.K_dim = K_dim; p.lda = lda;
    p.k_steps = (K_dim + UNIT_K - 1) / UNIT_K;
    p.n16_tiles = (N + UNIT_ROWS - 1) / UNIT_ROWS;
    p.m_tiles = (M + Cfg::BM - 1) / Cfg::BM;
    p.n_tiles = (N + Cfg::BN - 1) / Cfg::BN;
    int dev, sms;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int tiles = p.m_tiles * p.n_tiles;
    int grid = grid_override > 0 ? grid_override : (tiles < sms ? tiles : sms);
    auto kern = kbit_gemm_sm90_kernel<K_BITS, T, ABS_U8, Cfg>;
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES);
    kern<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(p);
    return (int)cudaGetLastError();
}

#define E(K, DT, T, AB, U8)                                                                                            \
    extern "C" int sm90_gemm_##DT##_##AB##_k##K(int bn, const void* A, const int* B, const void* Ba, const float* cb, int cbl, \
                                                const void* bias, void* C, int M, int N, int K_dim, int lda, int grid, \
                                                cudaStream_t s) {                                                      \
        return bn == 256 ? launch<K, T, U8, Sm90Config<256>>(A, B, Ba, cb, cbl, bias, C, M, N, K_dim, lda, grid, s)   \
                         : launch<K, T, U8, Sm90Config<128>>(A, B, Ba, cb, cbl, bias, C, M, N, K_dim, lda, grid, s);                              \
    }
#define EK(K) E(K, fp16, __half, u8abs, true) E(K, bf16, __nv_bfloat16, u8abs, true) E(K, fp16, __half, fp16abs, false)
EK(2) EK(3) EK(4) EK(5)

template <int K_BITS, typename T, bool ABS_U8>
static int deq(const int* B, const void* Ba, const float* cb, int cbl, void* out, int N, int K_dim, int n_begin, int n_end, cudaStream_t s) {
    Sm90Params p{};
    p.B = reinterpret_cast<const uint32_t*>(B); p.B_absmax = Ba; p.codebook = cb; p.codebook_len = cbl; p.N = N; p.K_dim = K_dim;
    p.k_steps = (K_dim + UNIT_K - 1) / UNIT_K;
    p.n16_tiles = (N + UNIT_ROWS - 1) / UNIT_ROWS;
    int dev, sms;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    kbit_dequant_tiled_kernel<K_BITS, T, ABS_U8><<<sms * 8, DEQ_TILED_THREADS, 0, s>>>(p, n_begin / 16, (n_end + 15) / 16, static_cast<T*>(out));
    return (int)cudaGetLastError();
}
#define D(K, DT, T, AB, U8)                                                                                            \
    extern "C" int deq_tiled_##DT##_##AB##_k##K(const int* B, const void* Ba, const float* cb, int cbl, void* out,    \
                                                int N, int K_dim, int n_begin, int n_end, cudaStream_t s) {            \
        return deq<K, T, U8>(B, Ba, cb, cbl, out, N, K_dim, n_begin, n_end, s);                                       \
    }
#define DK(K) D(K, fp16, __half, u8abs, true) D(K, bf16, __nv_bfloat16, u8abs, true) D(K, fp16, __half, fp16abs, false)
DK(2) DK(3) DK(4) DK(5)
