// LatentMoE router (docs/k3-model.md §6, router; docs/model-format.md): s = sigmoid(logits) (f32),
// select the top-k of s + bias (ties to the lower expert index, in descending order),
// weights = s[idx] / (sum + 1e-20) * scaling when renormalising, else s[idx] * scaling.
#include "common.cuh"

#define ROUTER_MAX_EXPERTS 1024
// Tokens per 128-thread block: one warp per token (geometry.rs router).
#define ROUTER_WARPS 4

// One warp per token, sorting all its experts at once: a bitonic sort in shared memory of
// (s + bias, expert) pairs, padded to a power of two, larger value first and ties to the lower
// expert (argmax_better), then the first k. Its 28 compare-exchange stages at 128 experts have no
// data-dependent chain, where k arg-max rounds (warp reduction, then a rescan by the winner's
// lane) took ~9 us at K3's top-16 under ncu. A NaN sorts as -inf, so the order stays total and
// every slot gets a distinct expert.
extern "C" __global__ void __launch_bounds__(32 * ROUTER_WARPS)
    router_topk_f32(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ idx_out,
                    float* __restrict__ w_out, int tokens, int experts, int k, int renormalize, float scaling) {
    __shared__ float key[ROUTER_WARPS][ROUTER_MAX_EXPERTS];
    __shared__ unsigned short id[ROUTER_WARPS][ROUTER_MAX_EXPERTS];
    __shared__ float picked_w[ROUTER_WARPS][64];
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    // Warp-uniform: a warp past the last token, or limits geometry.rs refuses, does nothing.
    if (warp >= ROUTER_WARPS || t >= tokens || experts > ROUTER_MAX_EXPERTS || k > 64 || k > experts) return;
    float* kv = key[warp];
    unsigned short* ki = id[warp];
    const float* lg = logits + (i64)t * experts;
    int n = 1;
    while (n < experts) n <<= 1;
    for (int e = lane; e < n; e += K3_WARP) {
        float v = K3_NEG_INF;  // padding: -inf, after every real expert by its index
        if (e < experts) {
            v = 1.0f / (1.0f + expf(-lg[e])) + bias[e];
            if (v != v) v = K3_NEG_INF;
        }
        kv[e] = v;
        ki[e] = (unsigned short)e;
    }
    __syncwarp();
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = lane; i < (n >> 1); i += K3_WARP) {
                const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const float a = kv[lo], b = kv[hi];
                const int ia = ki[lo], ib = ki[hi];
                // Runs with bit `size` clear end best-first, the others best-last; the last
                // merge (size == n) leaves the whole array best-first.
                const bool want_lo_first = (lo & size) == 0;
                if (argmax_better(b, ib, a, ia) == want_lo_first) {
                    kv[lo] = b;
                    kv[hi] = a;
                    ki[lo] = (unsigned short)ib;
                    ki[hi] = (unsigned short)ia;
                }
            }
            __syncwarp();
        }
    }
    for (int j = lane; j < k; j += K3_WARP) {
        const int e = ki[j];
        idx_out[(i64)t * k + j] = e;
        picked_w[warp][j] = 1.0f / (1.0f + expf(-lg[e]));
    }
    __syncwarp();
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += picked_w[warp][j];
        const float f = renormalize ? scaling / (sum + 1e-20f) : scaling;
        for (int j = 0; j < k; ++j) w_out[(i64)t * k + j] = picked_w[warp][j] * f;
    }
}
