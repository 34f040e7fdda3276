// Small elementwise ops of the layer graph: residual add, sigmoid gate, embedding gather.
#include "common.cuh"

// p += a, n elements (grid-stride).
extern "C" __global__ void add_assign_f32(float* __restrict__ p, const float* __restrict__ a, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) p[i] += a[i];
}

// o *= sigmoid(gate), n elements.
extern "C" __global__ void sigmoid_mul_f32(float* __restrict__ o, const float* __restrict__ gate, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        o[i] *= k3_sigmoid(gate[i]);
}

// out[t, :] = table[ids[t], :] for an f32 table [vocab, d]. One block per token; ids out of
// range write zeros (the host validates ids; this only keeps a bad id from reading wild memory).
extern "C" __global__ void embed_rows_f32(const float* __restrict__ table, const u32* __restrict__ ids,
                                          float* __restrict__ out, int tokens, int d, u32 vocab) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const u32 id = ids[t];
    float* o = out + (i64)t * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = id < vocab ? table[(i64)id * d + c] : 0.0f;
}

// Same from a bf16 table stored as raw 16-bit words (weights stay bf16 on the GPU; halves memory).
extern "C" __global__ void embed_rows_bf16(const unsigned short* __restrict__ table, const u32* __restrict__ ids,
                                           float* __restrict__ out, int tokens, int d, u32 vocab) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const u32 id = ids[t];
    float* o = out + (i64)t * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        o[c] = id < vocab ? bf16_bits_to_f32(table[(i64)id * d + c]) : 0.0f;
}
