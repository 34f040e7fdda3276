// Sampling helpers on the GPU: greedy arg-max and temperature softmax over vocab rows, so that
// only ids (or one probability row) cross PCIe instead of whole logit rows.
#include "common.cuh"

// ids[r] = argmax_c logits[r, c] (ties to the lower index; NaN never wins). One block per row.
extern "C" __global__ void argmax_rows_f32(const float* __restrict__ logits, int* __restrict__ ids, int rows,
                                           int vocab) {
    __shared__ float bv_s[32];
    __shared__ int bi_s[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (i64)r * vocab;
    float bv = K3_NEG_INF;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float v = x[c];
        if (argmax_better(v, c, bv, bi)) {
            bv = v;
            bi = c;
        }
    }
    warp_argmax(bv, bi);
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    if (lane == 0) {
        bv_s[warp] = bv;
        bi_s[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int q = 1; q < (int)(blockDim.x / K3_WARP); ++q)
            if (argmax_better(bv_s[q], bi_s[q], bv_s[0], bi_s[0])) {
                bv_s[0] = bv_s[q];
                bi_s[0] = bi_s[q];
            }
        ids[r] = bi_s[0] == 0x7fffffff ? 0 : bi_s[0];  // an all-NaN / all -inf row picks 0
    }
}

// probs[r, :] = softmax(logits[r, :] / temperature), temperature > 0. One block per row.
extern "C" __global__ void softmax_temperature_f32(const float* __restrict__ logits, float* __restrict__ probs,
                                                   int rows, int vocab, float temperature) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float inv_t = 1.0f / temperature;
    const float* x = logits + (i64)r * vocab;
    float* p = probs + (i64)r * vocab;
    float m = K3_NEG_INF;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, x[c] * inv_t);
    m = block_max(m, scratch);
    float z = 0.0f;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float e = expf(x[c] * inv_t - m);
        p[c] = e;
        z += e;
    }
    z = block_sum(z, scratch);
    const float inv_z = 1.0f / z;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) p[c] *= inv_z;
}
