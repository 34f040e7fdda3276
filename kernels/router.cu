// LatentMoE router (docs/k3-model.md §6, router; docs/model-format.md): s = sigmoid(logits) (f32),
// select the top-k of s + bias (ties to the lower expert index, in descending order),
// weights = s[idx] / (sum + 1e-20) * scaling when renormalising, else s[idx] * scaling.
#include "common.cuh"

#define ROUTER_MAX_EXPERTS 1024
// Tokens per 128-thread block: one warp per token (geometry.rs router).
#define ROUTER_WARPS 4

// One warp per token, k <= 64 arg-max rounds with no block barrier: lane l owns experts l + 32 j
// (j < 32) and keeps the best of its untaken ones, so a round is one warp arg-max and a rescan by
// the winner's lane. The k dependent rounds set the time: at K3's 128 experts and top-16 a call
// takes ~9 us under ncu, as the block-per-token form with two block barriers per round did.
extern "C" __global__ void __launch_bounds__(32 * ROUTER_WARPS)
    router_topk_f32(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ idx_out,
                    float* __restrict__ w_out, int tokens, int experts, int k, int renormalize, float scaling) {
    __shared__ float sel[ROUTER_WARPS][ROUTER_MAX_EXPERTS];
    __shared__ float score[ROUTER_WARPS][ROUTER_MAX_EXPERTS];
    __shared__ float picked_w[ROUTER_WARPS][64];
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    // Warp-uniform: a warp past the last token, or limits geometry.rs refuses, does nothing.
    if (warp >= ROUTER_WARPS || t >= tokens || experts > ROUTER_MAX_EXPERTS || k > 64 || k > experts) return;
    float* sl = sel[warp];
    float* sc = score[warp];
    for (int e = lane; e < experts; e += K3_WARP) {
        const float s = 1.0f / (1.0f + expf(-logits[(i64)t * experts + e]));
        sc[e] = s;
        sl[e] = s + bias[e];
    }
    __syncwarp();
    u32 taken = 0;  // bit j: expert lane + 32 j is picked
    float lv;
    int li;
    auto own_best = [&]() {
        lv = K3_NEG_INF;
        li = 0x7fffffff;
        for (int e = lane, j = 0; e < experts; e += K3_WARP, ++j)
            if (((taken >> j) & 1u) == 0 && argmax_better(sl[e], e, lv, li)) {
                lv = sl[e];
                li = e;
            }
    };
    own_best();
    for (int j = 0; j < k; ++j) {
        float bv = lv;
        int bi = li;
        warp_argmax(bv, bi);  // k <= experts: an untaken expert always remains
        if ((bi & (K3_WARP - 1)) == lane) {
            taken |= 1u << (bi / K3_WARP);
            own_best();
        }
        if (lane == 0) {
            idx_out[(i64)t * k + j] = bi;
            picked_w[warp][j] = sc[bi];
        }
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += picked_w[warp][j];
        const float f = renormalize ? scaling / (sum + 1e-20f) : scaling;
        for (int j = 0; j < k; ++j) w_out[(i64)t * k + j] = picked_w[warp][j] * f;
    }
}
