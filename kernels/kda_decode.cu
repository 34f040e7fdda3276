// KDA decode: one new token for each of N sequences, everything fused in one launch
// (k3-architecture.md §1.2–1.4): short conv + SiLU (and the window update), L2 norms, safe gate,
// beta, the delta-rule step on the f32 state, o = S^T q. Sequences are addressed by state-slot
// offsets into the arena, so the engine batches any set of slots without copies.
//
// Grid (H, N), 512 threads. The state tile of one (sequence, head) is 128x128 f32 = 64 KiB,
// 32 values per thread (see kda.cuh for the lane layout). One block per head rather than one per
// 32-column slice (fla's tiling) so the conv window of q and k is read and rewritten by exactly
// one block: no cross-block race on the window.
#include "kda.cuh"

#define KDA_DECODE_THREADS 512

extern "C" __global__ void __launch_bounds__(KDA_DECODE_THREADS)
kda_decode_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
               const float* __restrict__ f_in, const float* __restrict__ b_in,
               const float* __restrict__ conv_q, const float* __restrict__ conv_k, const float* __restrict__ conv_v,
               const float* __restrict__ a_log, const float* __restrict__ dt_bias,
               float* __restrict__ arena, const i64* __restrict__ state_off, const i64* __restrict__ ckpt_off,
               float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    __shared__ float qs[KDA_K], ks[KDA_K], vs[KDA_V], alpha[KDA_K];
    __shared__ float red[8];
    __shared__ float beta_s;
    const int h = blockIdx.x, n = blockIdx.y;
    if (h >= heads || n >= n_seqs || conv < 1 || conv > KDA_MAX_CONV) return;
    const int hk = heads * KDA_K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* region = arena + state_off[n];
    float* ckpt = ckpt_off[n] >= 0 ? arena + ckpt_off[n] : nullptr;
    const i64 wf = kda_window_floats(hk, conv);

    // Phase 1: threads 0-383 own one channel of q, k or v (conv + window update); 384-511 the gate.
    const int role = tid >> 7, c = tid & 127, ch = h * KDA_K + c;
    if (role < 3) {
        const float* in = role == 0 ? q_in : role == 1 ? k_in : v_in;
        const float* wconv = (role == 0 ? conv_q : role == 1 ? conv_k : conv_v) + (i64)ch * conv;
        float* win = region + role * wf + (i64)ch * (conv - 1);
        const float x = in[(i64)n * hk + ch];
        float y = wconv[conv - 1] * x;
        float hist[KDA_MAX_CONV];
        for (int j = 0; j < conv - 1; ++j) {
            hist[j] = win[j];
            y += wconv[j] * hist[j];
        }
        // New window: drop the oldest, append x (also into the checkpoint slot).
        for (int j = 0; j < conv - 1; ++j) {
            const float nv = j + 1 < conv - 1 ? hist[j + 1] : x;
            win[j] = nv;
            if (ckpt) ckpt[role * wf + (i64)ch * (conv - 1) + j] = nv;
        }
        y = k3_silu(y);
        (role == 0 ? qs : role == 1 ? ks : vs)[c] = y;
        if (role < 2) {  // L2 norm partial sums of q (warps 0-3) and k (warps 4-7)
            const float ss = warp_sum(y * y);
            if (lane == 0) red[warp] = ss;
        }
    } else {
        alpha[c] = expf(kda_gate(f_in[(i64)n * hk + ch], dt_bias[ch], expf(a_log[h]), lower_bound));
        if (c == 0) beta_s = k3_sigmoid(b_in[(i64)n * heads + h]);
    }
    __syncthreads();
    if (tid < 2 * KDA_K) {
        const int base = tid < KDA_K ? 0 : 4;
        const float ss = red[base] + red[base + 1] + red[base + 2] + red[base + 3];
        // q also carries the K^-1/2 attention scale.
        const float inv = (tid < KDA_K ? rsqrtf((float)KDA_K) : 1.0f) / sqrtf(ss + 1e-6f);
        if (tid < KDA_K) qs[c] *= inv; else ks[c] *= inv;
    }
    __syncthreads();

    // Phase 2: the delta rule on this thread's 32 state values (column v, rows kda_row(i, lane)).
    const int v = warp * 8 + (lane & 7);
    float* S = region + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    float s[KDA_ROWS];
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_ROWS; ++i) {
        const int k = kda_row(i, lane);
        s[i] = S[k * KDA_V + v] * alpha[k];
        kv += s[i] * ks[k];
    }
    kv = kda_reduce_k(kv);
    const float u = beta_s * (vs[v] - kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_ROWS; ++i) {
        const int k = kda_row(i, lane);
        s[i] += ks[k] * u;
        o += s[i] * qs[k];
        S[k * KDA_V + v] = s[i];
    }
    if (ckpt) {
        float* Sc = ckpt + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
#pragma unroll
        for (int i = 0; i < KDA_ROWS; ++i) Sc[kda_row(i, lane) * KDA_V + v] = s[i];
    }
    o = kda_reduce_k(o);
    if (lane < 8) o_out[(i64)n * hk + h * KDA_V + v] = o;
}
