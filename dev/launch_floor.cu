// launch_floor.cu: the fixed part of a back-to-back call on this GPU, for a kernel shaped like the M = 16 configs
// (one 16-warp CTA per SM, 128 or 132 CTAs, launched from a CUDA graph), with nothing of the GEMM in it
// (docs/kernel.md, "Candidates for M = 16 at k = 2", the fixed part of a call).
//
// Each call: entry -> griddepcontrol.wait (PDL rows) -> each CTA reads its own first stage of weights (bytes per CTA
// below; a fresh 4 MB slot per call, rotating over 512 MB so DRAM serves them) and waits for it -> a spin of BODY us
// on %globaltimer (the k-loop's stand-in; PDL rows allow the dependents TRIGGER us before its end, as the
// register-weight loop does at its last k-step) -> one store per CTA. Per-call time minus BODY is what a call costs
// beyond its loop. %globaltimer marks per CTA split it into: the previous call's last exit -> this call's first
// release from the wait ("between calls"), and the release -> the first stage landed ("first load").
//
// Build and run (sm_90a; carry the binary to the GPU machine):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o .whl/micro/launch_floor dev/launch_floor.cu
//   .whl/micro/launch_floor
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); std::exit(1); } } while (0)

constexpr int THREADS = 512;
constexpr int CALLS = 64;                       // launches per graph
constexpr size_t SLOT_BYTES = 4u << 20;         // weights read by one call, at most
constexpr int SLOTS = 128;                      // 512 MB rotation

struct Params {
    const uint4* weights;
    float* out;
    unsigned long long* marks;  // [CALLS][grid][4]: entry, released, loaded, exit
    int call;
    int stage_u4;               // uint4 per CTA in its first stage
    long long body_ns;
    long long trigger_before_ns;
    int store_u4;               // uint4 stored per CTA at the end (a C tile's stand-in)
    bool even_stores_only;      // only the even CTA of each pair stores (the 2-split push: split 0 stores C)
};

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <bool PDL>
__global__ void __launch_bounds__(THREADS, 1) call_kernel(Params p) {
    extern __shared__ uint32_t smem[];
    const unsigned long long t_entry = now();
    if (PDL) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    const unsigned long long t_released = now();
    const uint4* src = p.weights + (size_t)(p.call % SLOTS) * (SLOT_BYTES / 16) + (size_t)blockIdx.x * p.stage_u4;
    uint32_t acc = 0;
    for (int i = threadIdx.x; i < p.stage_u4; i += THREADS) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    smem[threadIdx.x] = acc;  // the CTA waits for its stage here
    __syncthreads();
    const unsigned long long t_loaded = now();
    const unsigned long long t_end = t_loaded + p.body_ns;
    if (PDL) {
        while (now() < t_end - p.trigger_before_ns) {}
        asm volatile("griddepcontrol.launch_dependents;\n" ::);
    }
    while (now() < t_end) {}
    if (threadIdx.x == 0) p.out[blockIdx.x] = (float)(smem[0] ^ smem[THREADS - 1]);
    if (!p.even_stores_only || blockIdx.x % 2 == 0) {
        uint4* dst = reinterpret_cast<uint4*>(p.out + 1024) + (size_t)blockIdx.x * p.store_u4;
        for (int i = threadIdx.x; i < p.store_u4; i += THREADS) dst[i] = make_uint4(acc, i, 0, 0);
    }
    const unsigned long long t_exit = now();
    if (threadIdx.x == 0) {
        unsigned long long* m = p.marks + ((size_t)p.call * gridDim.x + blockIdx.x) * 4;
        m[0] = t_entry; m[1] = t_released; m[2] = t_loaded; m[3] = t_exit;
    }
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct Row {
    const char* name;
    bool pdl;
    int grid;
    int stage_bytes;
    double trigger_us;
    int cluster = 1;      // CTAs per cluster
    int store_bytes = 0;  // stored per CTA at the end
    bool even_stores_only = false;
};

int main() {
    const double body_us = 8.0;
    const size_t smem_bytes = 200 * 1024;  // one CTA per SM, as the 123-register 16-warp configs
    CK(cudaFuncSetAttribute(call_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
    CK(cudaFuncSetAttribute(call_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
    uint4* weights; float* out; unsigned long long* marks;
    CK(cudaMalloc(&weights, SLOT_BYTES * (SLOTS + 1)));  // 132 CTAs read past a slot
    CK(cudaMemset(weights, 1, SLOT_BYTES * (SLOTS + 1)));
    CK(cudaMalloc(&out, 1024 * sizeof(float) + 1024 * 16384));
    CK(cudaMalloc(&marks, (size_t)CALLS * 1024 * 4 * sizeof(unsigned long long)));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs; %d calls per graph, body %.1f us, medians of 30 replays\n", prop.name,
                prop.multiProcessorCount, CALLS, body_us);
    const Row rows[] = {
        {"plain, no loads", false, 128, 0, 0},
        {"PDL, no loads, trigger 1.5 us before end", true, 128, 0, 1.5},
        {"plain, 32 KB first stage per CTA", false, 128, 32768, 0},
        {"PDL, 32 KB first stage, trigger 1.5 us before end", true, 128, 32768, 1.5},
        {"PDL, 32 KB first stage, trigger 3 us before end", true, 128, 32768, 3.0},
        {"PDL, 8 KB first stage, trigger 1.5 us before end", true, 128, 8192, 1.5},
        {"PDL, 32 KB first stage, trigger 1.5 us, 132 CTAs", true, 132, 32768, 1.5},
        {"PDL, 32 KB, 2-CTA clusters", true, 128, 32768, 1.5, 2},
        {"PDL, 32 KB, 3.5 KB stored per CTA", true, 128, 32768, 1.5, 1, 3584},
        {"PDL, 32 KB, 2-CTA clusters, 7 KB stored per even CTA", true, 128, 32768, 1.5, 2, 7168, true},
    };
    std::printf("| row | per call - body, us | per call - span (first release -> last exit) | between calls (last exit -> first release) | release -> stage landed (median CTA) | entry -> release (median CTA) |\n|---|---|---|---|---|---|\n");
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (const Row& r : rows) {
        cudaGraph_t graph;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        for (int c = 0; c < CALLS; ++c) {
            Params p{weights, out, marks, c, r.stage_bytes / 16, (long long)(body_us * 1000),
                     (long long)(r.trigger_us * 1000), r.store_bytes / 16, r.even_stores_only};
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(r.grid);
            cfg.blockDim = dim3(THREADS);
            cfg.dynamicSmemBytes = smem_bytes;
            cfg.stream = stream;
            cudaLaunchAttribute attr[2];
            attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr[0].val.programmaticStreamSerializationAllowed = r.pdl ? 1 : 0;
            attr[1].id = cudaLaunchAttributeClusterDimension;
            attr[1].val.clusterDim.x = r.cluster;
            attr[1].val.clusterDim.y = 1;
            attr[1].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = r.cluster > 1 ? 2 : 1;
            if (r.pdl) CK(cudaLaunchKernelEx(&cfg, call_kernel<true>, p));
            else CK(cudaLaunchKernelEx(&cfg, call_kernel<false>, p));
        }
        CK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(exec, stream));
        std::vector<double> per_call;
        for (int rep = 0; rep < 30; ++rep) {
            CK(cudaEventRecord(e0, stream));
            CK(cudaGraphLaunch(exec, stream));
            CK(cudaEventRecord(e1, stream));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            per_call.push_back(ms * 1000.0 / CALLS);
        }
        std::vector<unsigned long long> m((size_t)CALLS * r.grid * 4);
        CK(cudaMemcpy(m.data(), marks, m.size() * sizeof(m[0]), cudaMemcpyDeviceToHost));
        std::vector<double> between, landed, entry_wait, span;
        for (int c = 1; c < CALLS; ++c) {
            unsigned long long last_exit = 0, first_release = ~0ull;
            for (int b = 0; b < r.grid; ++b) {
                const unsigned long long* prev = &m[((size_t)(c - 1) * r.grid + b) * 4];
                const unsigned long long* cur = &m[((size_t)c * r.grid + b) * 4];
                last_exit = std::max(last_exit, prev[3]);
                first_release = std::min(first_release, cur[1]);
                landed.push_back((cur[2] - cur[1]) / 1000.0);
                entry_wait.push_back(((double)cur[1] - (double)cur[0]) / 1000.0);
            }
            between.push_back(((double)first_release - (double)last_exit) / 1000.0);
            unsigned long long call_release = ~0ull, call_exit = 0;
            for (int b = 0; b < r.grid; ++b) {
                call_release = std::min(call_release, m[((size_t)c * r.grid + b) * 4 + 1]);
                call_exit = std::max(call_exit, m[((size_t)c * r.grid + b) * 4 + 3]);
            }
            span.push_back((call_exit - call_release) / 1000.0);
        }
        std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", r.name, median(per_call) - body_us,
                    median(per_call) - median(span), median(between),
                    median(landed), median(entry_wait));
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    }
    return 0;
}
