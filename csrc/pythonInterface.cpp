// The C ABI of libbitsandbytes_kbit_cuda: extern "C" wrappers only, named c<op>_<dtype>...
// as upstream does. Each returns a cudaError_t value (0 = success); ckbit_error_string turns
// it into text. The ctypes signatures live in one table in bitsandbytes_kbit/backends/cuda/ops.py.
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops.cuh"

#define KBIT_QUANT_ENTRIES(tname, T, aname, ABSMAX_T, K_BITS)                                                          \
    int cquantize_kbit_##tname##_##aname##_k##K_BITS(                                                                  \
        const void* A, const float* codebook, int codebook_len, int32_t* packed, void* absmax, long long n,            \
        cudaStream_t stream                                                                                            \
    ) {                                                                                                                \
        return static_cast<int>(kbit::quantize_kbit<T, K_BITS, ABSMAX_T>(                                              \
            static_cast<const T*>(A), codebook, codebook_len, packed, static_cast<ABSMAX_T*>(absmax), n, stream        \
        ));                                                                                                            \
    }                                                                                                                  \
    int cquantize_kbit_mse_##tname##_##aname##_k##K_BITS(                                                              \
        const void* A, const float* codebook, int codebook_len, int32_t* packed, void* absmax, long long n, int below,  \
        int above, cudaStream_t stream                                                                                 \
    ) {                                                                                                                \
        return static_cast<int>(kbit::quantize_kbit_mse<T, K_BITS, ABSMAX_T>(                                          \
            static_cast<const T*>(A), codebook, codebook_len, packed, static_cast<ABSMAX_T*>(absmax), n, below, above, \
            stream                                                                                                     \
        ));                                                                                                            \
    }                                                                                                                  \
    int cdequantize_kbit_##tname##_##aname##_k##K_BITS(                                                                \
        const int32_t* packed, const void* absmax, const float* codebook, int codebook_len, void* out, long long n,    \
        cudaStream_t stream                                                                                            \
    ) {                                                                                                                \
        return static_cast<int>(kbit::dequantize_kbit<T, K_BITS, ABSMAX_T>(                                            \
            packed, static_cast<const ABSMAX_T*>(absmax), codebook, codebook_len, static_cast<T*>(out), n, stream      \
        ));                                                                                                            \
    }
#define KBIT_QUANT_ENTRIES_K(tname, T, aname, ABSMAX_T)                                                                \
    KBIT_QUANT_ENTRIES(tname, T, aname, ABSMAX_T, 2)                                                                   \
    KBIT_QUANT_ENTRIES(tname, T, aname, ABSMAX_T, 3)                                                                   \
    KBIT_QUANT_ENTRIES(tname, T, aname, ABSMAX_T, 4)                                                                   \
    KBIT_QUANT_ENTRIES(tname, T, aname, ABSMAX_T, 5)
#define KBIT_QUANT_ENTRIES_ABSMAX(tname, T)                                                                            \
    KBIT_QUANT_ENTRIES_K(tname, T, u8abs, uint8_t)                                                                     \
    KBIT_QUANT_ENTRIES_K(tname, T, fp16abs, half)                                                                      \
    KBIT_QUANT_ENTRIES_K(tname, T, fp32abs, float)

#define KBIT_TILED_ENTRY(tname, T, aname, ABS_U8, K_BITS)                                                              \
    int cdequantize_tiled_##tname##_##aname##_k##K_BITS(                                                               \
        const int32_t* B_packed, const void* B_absmax, const float* codebook, int codebook_len, void* out, int N,      \
        int K_dim, int n_begin, int n_end, int k_begin, int k_end, cudaStream_t stream                                 \
    ) {                                                                                                                \
        return static_cast<int>(kbit::dequantize_tiled<K_BITS, T, ABS_U8>(                                             \
            B_packed, B_absmax, codebook, codebook_len, static_cast<T*>(out), N, K_dim, n_begin, n_end, k_begin, k_end, \
            stream                                                                                                     \
        ));                                                                                                            \
    }
#define KBIT_TILED_ENTRIES(K_BITS)                                                                                     \
    KBIT_TILED_ENTRY(fp16, half, u8abs, true, K_BITS)                                                                  \
    KBIT_TILED_ENTRY(fp16, half, fp16abs, false, K_BITS)                                                               \
    KBIT_TILED_ENTRY(bf16, __nv_bfloat16, u8abs, true, K_BITS)                                                         \
    KBIT_TILED_ENTRY(bf16, __nv_bfloat16, fp16abs, false, K_BITS)

extern "C" {

KBIT_TILED_ENTRIES(2)
KBIT_TILED_ENTRIES(3)
KBIT_TILED_ENTRIES(4)
KBIT_TILED_ENTRIES(5)


KBIT_QUANT_ENTRIES_ABSMAX(fp16, half)
KBIT_QUANT_ENTRIES_ABSMAX(bf16, __nv_bfloat16)
KBIT_QUANT_ENTRIES_ABSMAX(fp32, float)

const char* ckbit_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
