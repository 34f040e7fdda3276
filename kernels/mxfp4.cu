// Routed-expert bookkeeping shared by the expert paths (the weights are MXFP4, docs/model-format.md).
//   moe_sort_assignments   group the T*k (token, slot) assignments by expert (counting sort; the
//                          few-token, wgmma and cuBLAS expert paths use it)
//   moe_combine_f32        out[t] = sum_j w[t,j] y[t*k + j]   (fixed slot order: deterministic)
//   moe_combine_ids_f32    the same, skipping slots whose expert id is out of range
// Experts of a layer are stored back to back: packed [E, rows, cols/2], scales [E, rows, cols/32].
#include "mxfp4_mma.cuh"


// Single block (1024 threads). idx [n_assign] expert ids; offsets [E+1] (out), sorted [n_assign]
// (out) = assignment ids grouped by expert. Order inside an expert is arbitrary: each
// assignment's output has its own row, so results do not depend on it.
extern "C" __global__ void moe_sort_assignments(const int* __restrict__ idx, int n_assign, int experts,
                                                int* __restrict__ offsets, int* __restrict__ sorted) {
    __shared__ int count[1025];
    __shared__ int cursor[1025];
    if (experts > 1024) return;
    for (int e = threadIdx.x; e <= experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const int e = idx[a];
        if (e >= 0 && e < experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < experts; ++e) {
            offsets[e] = run;
            cursor[e] = run;
            run += count[e];
        }
        offsets[experts] = run;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const int e = idx[a];
        if (e >= 0 && e < experts) sorted[atomicAdd(&cursor[e], 1)] = a;
    }
}

// out [T, latent] = sum over slots j (in order) of w[t*k+j] * y[t*k+j, :].
extern "C" __global__ void moe_combine_f32(const float* __restrict__ y, const float* __restrict__ w,
                                           float* __restrict__ out, int tokens, int top_k, int latent) {
    const i64 n = (i64)tokens * latent;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / latent, c = i % latent;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) acc += w[t * top_k + j] * y[(t * top_k + j) * latent + c];
        out[i] = acc;
    }
}

// Grid-stride over T * latent (256-thread blocks): out[t, c] = sum over slots j in order of
// w[t, j] y[t * top_k + j, c], skipping slots whose expert id is out of range (the sort drops
// them, so their y rows are never written: y needs no zeroing). the order of moe_combine_f32.
extern "C" __global__ void moe_combine_ids_f32(const float* __restrict__ y, const int* __restrict__ idx,
                                               const float* __restrict__ w, float* __restrict__ out, int tokens,
                                               int top_k, int latent, int experts) {
    const i64 n = (i64)tokens * latent;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / latent, c = i % latent;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const int e = idx[t * top_k + j];
            if (e >= 0 && e < experts) acc += w[t * top_k + j] * y[(t * top_k + j) * latent + c];
        }
        out[i] = acc;
    }
}
