// KDA decode: one new token for each of N sequences, everything fused in one launch
// (k3-architecture.md §1.2–1.4): short conv + SiLU (and the window update), L2 norms, safe gate,
// beta, the delta-rule step on the f32 state, o = S^T q. Sequences are addressed by state-slot
// offsets into the arena, so the engine batches any set of slots without copies.
//
// Grid (H, N), 512 threads. The state tile of one (sequence, head) is 128x128 f32 = 64 KiB,
// 32 values per thread as 8 float4 (16-byte loads): lane l holds columns warp*8 + (l&1)*4 .. +3
// of rows k = i*16 + (l>>1), i < 8, so a warp instruction moves 16 rows x 32 B (whole sectors) and
// K-reductions stay inside the warp (xor 2..16). The state loads are issued before the conv/gate
// phase so their latency overlaps it (the state does not depend on phase 1; alpha is applied
// after). One block per head rather than one per 32-column slice (fla's tiling) so the conv
// window of q and k is read and rewritten by exactly one block: no cross-block race on the window.
#include "kda.cuh"

#define KDA_DECODE_THREADS 512
#define KDA_DEC_ROWS 8  // float4 rows per thread

// Sum over the 16 row groups of a warp (lanes with the same l & 1).
__device__ __forceinline__ float kda_reduce_rows16(float v) {
#pragma unroll
    for (int o = 2; o < 32; o <<= 1) v += __shfl_xor_sync(K3_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float4 kda_ld4(const float* p, bool aligned) {
    return aligned ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
}
__device__ __forceinline__ void kda_st4(float* p, float4 v, bool aligned) {
    if (aligned) {
        *reinterpret_cast<float4*>(p) = v;
    } else {
        p[0] = v.x; p[1] = v.y; p[2] = v.z; p[3] = v.w;
    }
}

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
    const int v0 = warp * 8 + (lane & 1) * 4, kr = lane >> 1;
    float* S = region + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    // Slots are 4-byte aligned at the API: take the 16-byte path when the offset allows (block-uniform).
    const bool s_al = (state_off[n] & 3) == 0, c_al = (ckpt_off[n] & 3) == 0;
    float4 s[KDA_DEC_ROWS];
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) s[i] = kda_ld4(S + (i * 16 + kr) * KDA_V + v0, s_al);

    // Phase 1: threads 0-383 own one channel of q, k or v (conv + window update); 384-511 the gate.
    const int role = tid >> 7, c = tid & 127, ch = h * KDA_K + c;
    if (role < 3) {
        const float* in = role == 0 ? q_in : role == 1 ? k_in : v_in;
        const float* wconv = (role == 0 ? conv_q : role == 1 ? conv_k : conv_v) + (i64)ch * conv;
        float* win = region + role * wf + (i64)ch * (conv - 1);
        const float x = in[(i64)n * hk + ch];
        float y = wconv[conv - 1] * x;
        // Unrolled to the constant bound so hist stays in registers (no local-memory stack).
        float hist[KDA_MAX_CONV];
#pragma unroll
        for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
            hist[j] = j < conv - 1 ? win[j] : 0.0f;
            if (j < conv - 1) y += wconv[j] * hist[j];
        }
        // New window: drop the oldest, append x (also into the checkpoint slot).
#pragma unroll
        for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
            if (j < conv - 1) {
                const float nv = j + 1 < conv - 1 ? hist[j + 1] : x;
                win[j] = nv;
                if (ckpt) ckpt[role * wf + (i64)ch * (conv - 1) + j] = nv;
            }
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

    // Phase 2: the delta rule on this thread's 32 state values (columns v0..v0+3, rows i*16 + kr).
    float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) {
        const int k = i * 16 + kr;
        const float a = alpha[k], kk = ks[k];
        s[i].x *= a; s[i].y *= a; s[i].z *= a; s[i].w *= a;
        kv[0] += s[i].x * kk; kv[1] += s[i].y * kk; kv[2] += s[i].z * kk; kv[3] += s[i].w * kk;
    }
    float u[4], o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j) u[j] = beta_s * (vs[v0 + j] - kda_reduce_rows16(kv[j]));
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) {
        const int k = i * 16 + kr;
        const float kk = ks[k], qq = qs[k];
        s[i].x += kk * u[0]; s[i].y += kk * u[1]; s[i].z += kk * u[2]; s[i].w += kk * u[3];
        o[0] += s[i].x * qq; o[1] += s[i].y * qq; o[2] += s[i].z * qq; o[3] += s[i].w * qq;
        kda_st4(S + k * KDA_V + v0, s[i], s_al);
    }
    if (ckpt) {
        float* Sc = ckpt + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
#pragma unroll
        for (int i = 0; i < KDA_DEC_ROWS; ++i) kda_st4(Sc + (i * 16 + kr) * KDA_V + v0, s[i], c_al);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = kda_reduce_rows16(o[j]);
    if (lane < 2)
        *reinterpret_cast<float4*>(o_out + (i64)n * hk + h * KDA_V + v0) = make_float4(o[0], o[1], o[2], o[3]);
}
