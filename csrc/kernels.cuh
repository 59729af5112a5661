// Device code of bitsandbytes-kbit: k-bit blockwise quantize / dequantize.
//
// The flat format in one picture:
//
//   A (any shape, n elements, flattened)   block i = elements [32 i, 32 i + 32)
//   packed[i * K_BITS + b]  (uint32 stored as int32) = bit b of the 32 indices of block i,
//                           element j of the block in bit j (tail elements past n: bit 0)
//   absmax[i]               = the block's scale: E4M4 byte, fp16 or fp32
//   value(j)                = codebook[index(j)] * scale(i)
//
// Both kernels are checked bit for bit against the pure-PyTorch backend
// (bitsandbytes_kbit/backends/default/ops.py), which owns the format.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kbit {

constexpr int kBlockElems = 32;    // elements of one quantization block (= one warp in the quantize kernel)
constexpr int kMaxCodebook = 32;   // 2^5 entries for K_BITS = 5
constexpr int kE4M4Bias = 11;      // E4M4: value = 2^(e - 11) * (1 + m / 16); e == 0: m * 2^-14
constexpr int kDequantizeElemsPerThread = 8;  // see launch_dequantize_kbit

// Exact E4M4 decode: builds the IEEE-754 float from the code's fields, no rounding anywhere.
__host__ __device__ __forceinline__ float decode_e4m4(uint8_t code) {
    const int e = code >> 4;
    const int m = code & 0xF;
    if (e == 0)
        return static_cast<float>(m) * (1.0f / 16384.0f);  // subnormal: m * 2^-14 (m = 0 gives 0)
    const uint32_t bits = static_cast<uint32_t>(e - kE4M4Bias + 127) << 23 | static_cast<uint32_t>(m) << 19;
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    return f;
#endif
}

// Nearest E4M4 code to a >= 0 (ties to the lower code); a nonzero value never encodes to 0,
// values past the largest code (31.0) saturate to 0xFF. Mirrors encode_absmax_e4m4 in
// backends/default/ops.py operation for operation, so both produce the same byte.
__host__ __device__ __forceinline__ uint8_t encode_e4m4(float a) {
    int c = 0;  // largest code with decode(c) <= a; decode is increasing in the code
#pragma unroll
    for (int step = 128; step > 0; step >>= 1)
        if (decode_e4m4(static_cast<uint8_t>(c + step)) <= a)
            c += step;
    if (c < 255) {
        const float lo = decode_e4m4(static_cast<uint8_t>(c));
        const float hi = decode_e4m4(static_cast<uint8_t>(c + 1));
        if (a - lo > hi - a)
            c += 1;
    }
    if (c == 0 && a > 0.0f)
        c = 1;
    return static_cast<uint8_t>(c);
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<half>(half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Scale storage: the quantize kernel stores absmax in ABSMAX_T and normalizes by the value it
// stored, so what dequantize multiplies by is exactly what quantize divided by.
template <typename ABSMAX_T> struct AbsmaxCodec;
template <> struct AbsmaxCodec<uint8_t> {  // E4M4
    __device__ static uint8_t encode(float a) { return encode_e4m4(a); }
    __device__ static float decode(uint8_t s) { return decode_e4m4(s); }
};
template <> struct AbsmaxCodec<half> {
    __device__ static half encode(float a) { return __float2half_rn(a); }
    __device__ static float decode(half s) { return __half2float(s); }
};
template <> struct AbsmaxCodec<float> {
    __device__ static float encode(float a) { return a; }
    __device__ static float decode(float s) { return s; }
};

// The kernels themselves are internal to kernels.cu: nvcc (CUDA >= 12.8 whole-program mode)
// gives __global__ template stubs internal linkage, so each kernel is launched from its own
// translation unit through these shims. ops.cu chooses the geometry and calls them.
//
// quantize: one warp per 32-element block; lane j owns element j, ballots build the planes.
template <typename T, int K_BITS, typename ABSMAX_T>
void launch_quantize_kbit(
    unsigned grid, unsigned threads, cudaStream_t stream, const T* A, const float* codebook, int codebook_len,
    int32_t* packed, ABSMAX_T* absmax, long long n
);

// quantize with the error-minimizing block scale ("mse"): one warp per block, as above; below / above: the
// candidate scales tried around the rounded absmax (E4M4 codes, or steps of 1/64 for fp16 / fp32 scales).
template <typename T, int K_BITS, typename ABSMAX_T>
void launch_quantize_kbit_mse(
    unsigned grid, unsigned threads, cudaStream_t stream, const T* A, const float* codebook, int codebook_len,
    int32_t* packed, ABSMAX_T* absmax, long long n, int below, int above
);
// dequantize: one thread per 8 consecutive elements (a quarter block: byte q of every plane word), one 16-byte store
// (fp16/bf16) or two (fp32) when vector_store allows, so a warp's store covers 512 contiguous bytes, with the
// evict-first hint. Persistent grid, software pipelined: a thread loads its next group's words (one vector load for k
// = 2, 4) before converting the current one, with an L2 256-byte fetch hint.
template <typename T, int K_BITS, typename ABSMAX_T>
void launch_dequantize_kbit(
    unsigned grid, unsigned threads, cudaStream_t stream, const int32_t* packed, const ABSMAX_T* absmax,
    const float* codebook, int codebook_len, T* out, long long n, bool vector_store
);

// tiled weight (repack_kbit's layout) -> a row-major fp16/bf16 block of W (TiledRegion); for the
// large-M path. TiledWeight, TiledRegion and the kernel live in kbit_tiled_unit.cuh.
struct TiledWeight;
struct TiledRegion;
template <int K_BITS, typename T, bool ABS_U8>
void launch_dequantize_tiled(
    unsigned grid, unsigned threads, cudaStream_t stream, const TiledWeight& w, const TiledRegion& region, T* out
);

}  // namespace kbit
