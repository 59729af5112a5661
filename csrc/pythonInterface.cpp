// The C ABI of the k-bit quantize / dequantize ops: extern "C" wrappers over ops.cu's runtime dispatch. k, the
// element type (KbitDtype) and the absmax storage (KbitAbsmaxFormat) are arguments; ops.cuh documents the codes and
// the error convention (0 = success, 1 = failure with the message in ckbit_last_error). The repack and GEMM entries
// are at the end of kbit_gemm.cu. The ctypes signatures live in one table in bitsandbytes_kbit/backends/cuda/ops.py.
#include <cstdint>
#include <cuda_runtime.h>

#include "ops.cuh"

extern "C" {

int ckbit_quantize(
    int k, int dtype, int absmax_format, const void* A, const float* codebook, int codebook_len, int32_t* packed,
    void* absmax, long long n, cudaStream_t stream
) {
    kbit::clear_error();
    return kbit::quantize(k, dtype, absmax_format, A, codebook, codebook_len, packed, absmax, n, stream);
}

int ckbit_quantize_mse(
    int k, int dtype, int absmax_format, const void* A, const float* codebook, int codebook_len, int32_t* packed,
    void* absmax, long long n, int below, int above, cudaStream_t stream
) {
    kbit::clear_error();
    return kbit::quantize_mse(
        k, dtype, absmax_format, A, codebook, codebook_len, packed, absmax, n, below, above, stream
    );
}

int ckbit_dequantize(
    int k, int dtype, int absmax_format, const int32_t* packed, const void* absmax, const float* codebook,
    int codebook_len, void* out, long long n, cudaStream_t stream
) {
    kbit::clear_error();
    return kbit::dequantize(k, dtype, absmax_format, packed, absmax, codebook, codebook_len, out, n, stream);
}

int ckbit_dequantize_tiled(
    int k, int dtype, int absmax_format, const int32_t* B_packed, const void* B_absmax, const float* codebook,
    int codebook_len, void* out, int N, int K_dim, int n_begin, int n_end, int k_begin, int k_end, cudaStream_t stream
) {
    kbit::clear_error();
    return kbit::dequantize_tiled(
        k, dtype, absmax_format, B_packed, B_absmax, codebook, codebook_len, out, N, K_dim, n_begin, n_end, k_begin,
        k_end, stream
    );
}

// The message of the calling thread's last failed entry ("" when its last call succeeded).
const char* ckbit_last_error(void) { return kbit::last_error(); }

}  // extern "C"
