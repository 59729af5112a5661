// Host side of bitsandbytes-kbit: the codes of the C ABI, its error slot and the runtime-dispatched launchers.
//
// The C ABI (pythonInterface.cpp and the extern "C" block of kbit_gemm.cu) takes k (2..5), the element type and the
// absmax storage as runtime ints with these codes (mirrored in bitsandbytes_kbit/backends/cuda/ops.py):
//   dtype:          KBIT_DTYPE_FP16 = 0, KBIT_DTYPE_BF16 = 1, KBIT_DTYPE_FP32 = 2
//   absmax format:  KBIT_ABSMAX_E4M4 = 0 (uint8), KBIT_ABSMAX_FP16 = 1, KBIT_ABSMAX_FP32 = 2
// Every entry that does work returns 0 on success and 1 on failure; ckbit_last_error() then gives the message (bad
// arguments, a launch error) of the calling thread's last failed call.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_runtime.h>

enum KbitDtype { KBIT_DTYPE_FP16 = 0, KBIT_DTYPE_BF16 = 1, KBIT_DTYPE_FP32 = 2 };
enum KbitAbsmaxFormat { KBIT_ABSMAX_E4M4 = 0, KBIT_ABSMAX_FP16 = 1, KBIT_ABSMAX_FP32 = 2 };

namespace kbit {

// The error slot of the C ABI (thread-local): entries clear it on entry and return report_error(...)'s 1 on failure.
void clear_error();
int report_error(const char* op, const char* format, ...);  // "op: <printf of format>" (op nullptr: no prefix); 1
const char* last_error();

// Calls f with std::integral_constant<int, k> for k = 2..5 (the template argument of the kernels), else reports k.
template <typename F> int with_k(const char* op, int k, F&& f) {
    switch (k) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    }
    return report_error(op, "k=%d, expected 2, 3, 4 or 5", k);
}

// Each returns 0 on success, 1 with the message in last_error(). n <= 0 (an empty region) launches nothing.
int quantize(
    int k, int dtype, int absmax_format, const void* A, const float* codebook, int codebook_len, int32_t* packed,
    void* absmax, long long n, cudaStream_t stream
);

// The error-minimizing block scale (the default "mse" rule): candidates `below` / `above` the rounded absmax (E4M4
// codes, or steps of 1/64 for fp16 / fp32 scales), then the least-squares refit.
int quantize_mse(
    int k, int dtype, int absmax_format, const void* A, const float* codebook, int codebook_len, int32_t* packed,
    void* absmax, long long n, int below, int above, cudaStream_t stream
);

int dequantize(
    int k, int dtype, int absmax_format, const int32_t* packed, const void* absmax, const float* codebook,
    int codebook_len, void* out, long long n, cudaStream_t stream
);

// The block W[n_begin:n_end, k_begin:k_end] of a tiled (repacked) weight W[N, K_dim] as fp16 / bf16, row-major
// with row stride k_end - k_begin, into out; n_begin must be a multiple of 16 and k_begin of 128 (whole units of the
// tiled layout); absmax E4M4 or fp16.
int dequantize_tiled(
    int k, int dtype, int absmax_format, const int32_t* B_packed, const void* B_absmax, const float* codebook,
    int codebook_len, void* out, int N, int K_dim, int n_begin, int n_end, int k_begin, int k_end, cudaStream_t stream
);

}  // namespace kbit
