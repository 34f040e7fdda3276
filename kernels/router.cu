// LatentMoE router (docs/k3-model.md §6, router; docs/model-format.md): s = sigmoid(logits) (f32),
// select the top-k of s + bias (ties to the lower expert index, in descending order),
// weights = s[idx] / (sum + 1e-20) * scaling when renormalising, else s[idx] * scaling.
#include "common.cuh"

#define ROUTER_MAX_EXPERTS 1024

// One block per token (blockDim a multiple of 32, <= 1024); k sequential block arg-max rounds.
// k is small (16 in K3) and E <= 1024, so this is a few microseconds and never the bottleneck.
extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, const float* __restrict__ bias,
                                           int* __restrict__ idx_out, float* __restrict__ w_out, int tokens,
                                           int experts, int k, int renormalize, float scaling) {
    __shared__ float sel[ROUTER_MAX_EXPERTS];
    __shared__ float score[ROUTER_MAX_EXPERTS];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ float picked_w[64];
    const int t = blockIdx.x;
    if (t >= tokens || experts > ROUTER_MAX_EXPERTS || k > 64 || k > experts) return;
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    const int nwarps = blockDim.x / K3_WARP;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float s = 1.0f / (1.0f + expf(-logits[(i64)t * experts + e]));
        score[e] = s;
        sel[e] = s + bias[e];
    }
    __syncthreads();
    for (int j = 0; j < k; ++j) {
        float bv = K3_NEG_INF;
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            const float v = sel[e];
            if (argmax_better(v, e, bv, bi)) {
                bv = v;
                bi = e;
            }
        }
        warp_argmax(bv, bi);
        if (lane == 0) {
            best_v[warp] = bv;
            best_i[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = best_v[0];
            int i = best_i[0];
            for (int q = 1; q < nwarps; ++q)
                if (argmax_better(best_v[q], best_i[q], v, i)) {
                    v = best_v[q];
                    i = best_i[q];
                }
            idx_out[(i64)t * k + j] = i;
            picked_w[j] = score[i];
            sel[i] = K3_NEG_INF;  // never picked twice; -inf scores (all masked) keep index order
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += picked_w[j];
        const float f = renormalize ? scaling / (sum + 1e-20f) : scaling;
        for (int j = 0; j < k; ++j) w_out[(i64)t * k + j] = picked_w[j] * f;
    }
}
