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

template <typename T, int K_BITS, typename ABSMAX_T>
cudaError_t dequantize_kbit(
    const int32_t* packed, const ABSMAX_T* absmax, const float* codebook, int codebook_len, T* out, long long n,
    cudaStream_t stream
);

}  // namespace kbit
