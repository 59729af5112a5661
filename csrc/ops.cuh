// Host launchers of bitsandbytes-kbit. Each returns the CUDA error of its launch (cudaSuccess
// when nothing ran), so the C ABI can hand it to Python.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace kbit {

template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t quantize_kbit(
    const T* A, const float* codebook, int codebook_len, int32_t* packed, ABSMAX_T* absmax, long long n,
    cudaStream_t stream
);

// The error-minimizing block scale (the default "mse" rule): candidates `below` / `above` the rounded absmax (E4M4
// codes, or steps of 1/64 for fp16 / fp32 scales), then the least-squares refit.
template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t quantize_kbit_mse(
    const T* A, const float* codebook, int codebook_len, int32_t* packed, ABSMAX_T* absmax, long long n, int below,
    int above, cudaStream_t stream
);

template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t dequantize_kbit(
    const int32_t* packed, const ABSMAX_T* absmax, const float* codebook, int codebook_len, T* out, long long n,
    cudaStream_t stream
);

// The block W[n_begin:n_end, k_begin:k_end] of a tiled (repacked) weight W[N, K_dim] as T, row-major
// with row stride k_end - k_begin, into out; n_begin must be a multiple of 16 and k_begin of 128
// (whole units of the tiled layout).
template <int K_BITS, typename T, bool ABS_U8>
cudaError_t dequantize_tiled(
    const int32_t* B_packed, const void* B_absmax, const float* codebook, int codebook_len, T* out, int N, int K_dim,
    int n_begin, int n_end, int k_begin, int k_end, cudaStream_t stream
);

}  // namespace kbit
