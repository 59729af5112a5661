// tensor_pipe_rate.cu: how fast the H100 tensor pipe runs the MMA shapes a 16-token tile can use, and how much
// integer / fp16 work hides under it (docs/kernel.md, "The tensor pipe at M = 16").
//
// One CTA of 16 warps per SM (4 per scheduler, as configs 11 and 13). Every variant does the same tensor work per SM
// and iteration, 128 m16n8k16-equivalents (2048 FMA each): 8 mma.sync m16n8k16 per warp (4 A fragments x 2 token
// tiles, as the two-token-tile loop), or wgmma.mma_async m64nNk16 with the A operand in registers (N = 16, 32, 64),
// fence + commit per iteration and one group left in flight (wait_group 1), the fragments double-buffered. The
// LOP3s (or HMUL2s) per warp and iteration rewrite the A fragments that are multiplied next, as the dequant does
// (only those: ptxas drops operations on registers nothing reads; check the loop's SASS when changing this).
// Prints cycles (clock64, the slowest CTA) per iteration and per scheduler, and per m16n8k16-equivalent.
//
// Build and run (sm_90a; carry the binary to the GPU machine):
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o .whl/micro/tensor_pipe_rate dev/tensor_pipe_rate.cu
//   .whl/micro/tensor_pipe_rate
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// the same shape with fp16 accumulators (2 registers of half2 instead of 4 floats)
__device__ __forceinline__ void mma16816_f16acc(uint32_t* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
                 : "+r"(d[0]), "+r"(d[1]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
#define A4 "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
#define F(i) "+f"(d[i])
template <int N> __device__ __forceinline__ void wgmma(float* d, const uint32_t* a, uint64_t desc);
template <> __device__ __forceinline__ void wgmma<16>(float* d, const uint32_t* a, uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
                 : F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7) : A4);
}
template <> __device__ __forceinline__ void wgmma<32>(float* d, const uint32_t* a, uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
                 : F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), F(10), F(11), F(12), F(13), F(14), F(15) : A4);
}
template <> __device__ __forceinline__ void wgmma<64>(float* d, const uint32_t* a, uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
                 "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), F(10), F(11), F(12), F(13), F(14), F(15),
                   F(16), F(17), F(18), F(19), F(20), F(21), F(22), F(23), F(24), F(25), F(26), F(27), F(28), F(29), F(30), F(31)
                 : A4);
}
__device__ __forceinline__ uint64_t desc_sw128(uint32_t s) {
    return (uint64_t)((s & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
template <bool HALF> __device__ __forceinline__ void alu(uint32_t& r, uint32_t x) {
    if (HALF) asm volatile("mul.rn.f16x2 %0, %0, %1;" : "+r"(r) : "r"(x | 0x3c003c00u));
    else asm volatile("lop3.b32 %0, %0, %1, 0x0f0f0f0f, 0x6a;" : "+r"(r) : "r"(x));
}

// N == 0: mma.sync, 8 per warp and iteration, ALU / 8 operations before each one (on the next fragment);
// N == -1: the same with fp16 accumulators
// N > 0: wgmma m64nNk16, 32 m16n8k16-equivalents per warpgroup and iteration, the ALU operations before the fence
template <int N, int ALU, bool HALF = false>
__global__ void __launch_bounds__(512, 1) bench(int iters, float* out, long long* cycles) {
    __shared__ __align__(1024) uint8_t tok[16384];
    for (int i = threadIdx.x; i < 4096; i += blockDim.x) ((uint32_t*)tok)[i] = 0x3c003c00u * ((i & 7) == 0);
    __syncthreads();
    constexpr bool F16ACC = N < 0;
    constexpr int NW = N <= 0 ? 0 : 32 * 2048 / (64 * N * 16); // wgmmas per warpgroup per iteration: 32 m16n8k16-eq
    constexpr int NACC = N <= 0 ? 32 : (N / 2 * (NW < 4 ? NW : 4));  // floats of accumulators per thread
    constexpr int NF = N <= 0 ? 4 : (NW < 4 ? NW : 4); // A fragments multiplied per iteration
    uint32_t ab[2][4][4];
    for (int h = 0; h < 2; ++h) for (int u = 0; u < 4; ++u) for (int j = 0; j < 4; ++j) ab[h][u][j] = 0x3c003c00u ^ (threadIdx.x * 7 + u * 3 + j + h);
    const uint32_t b0 = 0x3c003c00u, b1 = 0x3c003c00u ^ threadIdx.x;
    float acc[NACC];
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
    uint32_t x = threadIdx.x;
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(tok);
    long long t0 = clock64();
    for (int it = 0; it < iters; it += 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint32_t (&a)[4][4] = ab[h];
            if constexpr (N <= 0) {
#pragma unroll
                for (int m = 0; m < 8; ++m) {
#pragma unroll
                    for (int q = 0; q < ALU / 8; ++q) alu<HALF>(a[(m / 2 + 1) % 4][q % 4], x);
                    if constexpr (F16ACC) mma16816_f16acc(reinterpret_cast<uint32_t*>(&acc[4 * m]), a[m / 2], m & 1 ? b1 : b0, m & 1 ? b0 : b1);
                    else mma16816(&acc[4 * m], a[m / 2], m & 1 ? b1 : b0, m & 1 ? b0 : b1);
                }
            } else {
#pragma unroll
                for (int q = 0; q < ALU; ++q) alu<HALF>(a[q % NF][(q / NF) % 4], x); // only fragments multiplied
                wg_fence();
                const uint64_t desc = desc_sw128(s + ((it & 3) << 5));
#pragma unroll
                for (int w = 0; w < NW; ++w) wgmma<N>(&acc[(N / 2) * (w % (NACC / (N / 2)))], a[w % 4], desc);
                wg_commit();
                wg_wait1();
            }
            x = x * 1664525u + 1013904223u;
        }
    }
    if constexpr (N > 0) wg_wait0();
    long long t1 = clock64();
    float sum = 0;
    for (int i = 0; i < NACC; ++i) sum += acc[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int N, int ALU, bool HALF = false> void run(int sms, float* out, long long* cyc) {
    const int iters = 4000;
    bench<N, ALU, HALF><<<sms, 512>>>(iters, out, cyc);
    bench<N, ALU, HALF><<<sms, 512>>>(iters, out, cyc);
    cudaDeviceSynchronize();
    long long c[1024];
    cudaMemcpy(c, cyc, sizeof(long long) * sms, cudaMemcpyDeviceToHost);
    long long mx = 0;
    for (int i = 0; i < sms; ++i) mx = c[i] > mx ? c[i] : mx;
    const double per_iter_smsp = (double)mx / iters; // 32 m16n8k16-eq and 4 x ALU operations per scheduler
    printf("%-15s %s per warp and iteration %3d: %7.1f cycles per iteration and scheduler, %5.2f per m16n8k16-eq%s\n",
           N == 0 ? "mma.sync" : N < 0 ? "mma.sync f16acc" : (N == 16 ? "wgmma m64n16" : N == 32 ? "wgmma m64n32" : "wgmma m64n64"),
           HALF ? "HMUL2" : "LOP3 ", ALU, per_iter_smsp, per_iter_smsp / 32,
           cudaGetLastError() == cudaSuccess ? "" : "  (launch error)");
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    if (sms <= 0 || sms > 1024) return 1;
    float* out;
    long long* cyc;
    cudaMalloc(&out, sms * 512 * 4);
    cudaMalloc(&cyc, sms * 8);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("%s, %d SMs; the same tensor work in every row (32 m16n8k16-eq per scheduler and iteration)\n", prop.name, sms);
    run<0, 0>(sms, out, cyc);  run<0, 16>(sms, out, cyc);  run<0, 32>(sms, out, cyc);  run<0, 64>(sms, out, cyc);
    run<-1, 0>(sms, out, cyc); run<-1, 16>(sms, out, cyc); run<-1, 32>(sms, out, cyc); run<-1, 32, true>(sms, out, cyc);
    run<0, 16, true>(sms, out, cyc); run<0, 32, true>(sms, out, cyc); run<0, 64, true>(sms, out, cyc);
    run<16, 0>(sms, out, cyc); run<16, 16>(sms, out, cyc); run<16, 32>(sms, out, cyc); run<16, 64>(sms, out, cyc);
    run<16, 32, true>(sms, out, cyc);
    run<32, 0>(sms, out, cyc); run<32, 16>(sms, out, cyc); run<32, 32>(sms, out, cyc); run<32, 64>(sms, out, cyc);
    run<64, 0>(sms, out, cyc); run<64, 16>(sms, out, cyc); run<64, 32>(sms, out, cyc); run<64, 64>(sms, out, cyc);
    run<64, 32, true>(sms, out, cyc);
    return 0;
}
