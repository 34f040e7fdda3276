// KDA prefill for one sequence's T new tokens (docs/k3-model.md), three launches:
//   kda_conv_silu_f32   causal conv + SiLU over T tokens per channel, window update (+ checkpoints)
//   kda_prep_f32        per (token, head): L2 norms (q scaled by K^-1/2), safe gate g, beta
//   kda_chunk_fwd_f32   WY/UT chunked delta rule from the stored state, in-pass state checkpoints
// A straightforward correct version: f32 CUDA cores, chunk 16, no tensor cores yet.
//
// Checkpoints: ckpt_n[j] (1..T, ascending) and ckpt_off[j] (float offset of the checkpoint's
// layer region): after the first ckpt_n[j] tokens the window (conv kernel) and S (chunk kernel)
// are also written there.
#include "kda.cuh"

#define KDA_CHUNK 16
// Shared-memory row stride: 129 so rows i and j of a [C][K] array start in different banks.
#define KDA_KP (KDA_K + 1)

// Grid-stride over the 3*H*K channels of q, k, v; each thread walks its channel over T tokens
// (coalesced across threads for each token).
extern "C" __global__ void kda_conv_silu_f32(const float* __restrict__ q_in, const float* __restrict__ k_in,
                                             const float* __restrict__ v_in, const float* __restrict__ conv_q,
                                             const float* __restrict__ conv_k, const float* __restrict__ conv_v,
                                             float* __restrict__ q_out, float* __restrict__ k_out,
                                             float* __restrict__ v_out, float* __restrict__ arena, i64 state_off,
                                             const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off,
                                             int n_ckpt, int tokens, int hk, int conv) {
    if (conv < 1 || conv > KDA_MAX_CONV) return;
    const i64 wf = kda_window_floats(hk, conv);
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < 3 * hk; idx += gridDim.x * blockDim.x) {
        const int role = idx / hk, ch = idx % hk;
        const float* in = role == 0 ? q_in : role == 1 ? k_in : v_in;
        float* out = role == 0 ? q_out : role == 1 ? k_out : v_out;
        const float* wconv = (role == 0 ? conv_q : role == 1 ? conv_k : conv_v) + (i64)ch * conv;
        float* win = arena + state_off + role * wf + (i64)ch * (conv - 1);
        float w[KDA_MAX_CONV], hist[KDA_MAX_CONV];
#pragma unroll
        for (int j = 0; j < KDA_MAX_CONV; ++j) {
            w[j] = j < conv ? wconv[j] : 0.0f;
            hist[j] = j < conv - 1 ? win[j] : 0.0f;
        }
        int next_ck = 0;
        for (int t = 0; t < tokens; ++t) {
            const float x = in[(i64)t * hk + ch];
            float y = w[conv - 1] * x;
#pragma unroll
            for (int j = 0; j < KDA_MAX_CONV - 1; ++j)
                if (j < conv - 1) y += w[j] * hist[j];
#pragma unroll
            for (int j = 0; j < KDA_MAX_CONV - 1; ++j)
                if (j < conv - 1) hist[j] = j + 1 < conv - 1 ? hist[j + 1] : x;
            out[(i64)t * hk + ch] = k3_silu(y);
            while (next_ck < n_ckpt && ckpt_n[next_ck] == t + 1) {
                float* cw = arena + ckpt_off[next_ck] + role * wf + (i64)ch * (conv - 1);
#pragma unroll
                for (int j = 0; j < KDA_MAX_CONV - 1; ++j)
                    if (j < conv - 1) cw[j] = hist[j];
                ++next_ck;
            }
        }
#pragma unroll
        for (int j = 0; j < KDA_MAX_CONV - 1; ++j)
            if (j < conv - 1) win[j] = hist[j];
    }
}

// One warp per (token, head): q <- q / sqrt(sum q^2 + 1e-6) * K^-1/2, k likewise (no scale),
// g (in place over f) = safe gate, beta[t, h] = sigmoid(b).
extern "C" __global__ void kda_prep_f32(float* __restrict__ q, float* __restrict__ k, float* __restrict__ f,
                                        const float* __restrict__ b, float* __restrict__ beta,
                                        const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                        int tokens, int heads, float lower_bound) {
    const int item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (item >= tokens * heads) return;
    const int t = item / heads, h = item % heads;
    const i64 base = (i64)t * heads * KDA_K + h * KDA_K;
    float qv[4], kv[4], sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        qv[i] = q[base + lane + 32 * i];
        kv[i] = k[base + lane + 32 * i];
        sq += qv[i] * qv[i];
        sk += kv[i] * kv[i];
    }
    const float iq = rsqrtf((float)KDA_K) / sqrtf(warp_sum(sq) + 1e-6f);
    const float ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
    const float a = expf(a_log[h]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = lane + 32 * i;
        q[base + c] = qv[i] * iq;
        k[base + c] = kv[i] * ik;
        f[base + c] = kda_gate(f[base + c], dt_bias[h * KDA_K + c], a, lower_bound);
    }
    if (lane == 0) beta[(i64)t * heads + h] = k3_sigmoid(b[(i64)t * heads + h]);
}

// Grid (H, V/32), 128 threads: each block owns a 128 x 32 slice of one head's state (4 warps x
// 8 columns, kda.cuh layout) and walks the chunks in order. The K-side chunk algebra (L, A, W)
// is recomputed by the 4 slices of a head; it is cheap next to the state traffic.
// Needs |lower_bound| * KDA_CHUNK < 88 so exp(-Gamma) stays finite in f32 (K3: 5 * 16 = 80).
extern "C" __global__ void __launch_bounds__(128)
kda_chunk_fwd_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ arena,
                  i64 state_off, const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                  float* __restrict__ o_out, int tokens, int heads, int conv) {
    __shared__ float kdec[KDA_CHUNK][KDA_KP];  // k * exp(Gamma), then overwritten by W
    __shared__ float kinv[KDA_CHUNK][KDA_KP];  // k * exp(-Gamma)
    __shared__ float qdec[KDA_CHUNK][KDA_KP];  // q * exp(Gamma)
    __shared__ float eg[KDA_CHUNK][KDA_KP];    // exp(Gamma)
    __shared__ float vv[KDA_CHUNK][32];        // v slice, then U, then V~ = U - W S
    __shared__ float Lm[KDA_CHUNK][KDA_CHUNK + 1], Am[KDA_CHUNK][KDA_CHUNK + 1];
    __shared__ float bs[KDA_CHUNK];
    const int h = blockIdx.x, slice = blockIdx.y;
    if (h >= heads || slice * 32 >= KDA_V) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hk = heads * KDA_K;
    const int vloc = warp * 8 + (lane & 7);  // column inside the 32-wide slice
    const int vcol = slice * 32 + vloc;
    const i64 s_base = kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    float* S = arena + state_off + s_base;
    float s[KDA_ROWS];
#pragma unroll
    for (int i = 0; i < KDA_ROWS; ++i) s[i] = S[kda_row(i, lane) * KDA_V + vcol];
    int next_ck = 0;

    for (int c0 = 0; c0 < tokens; c0 += KDA_CHUNK) {
        const int cl = min(KDA_CHUNK, tokens - c0);
        // 1. Decayed keys/queries; rows past the end are zero (beta 0) so they change nothing.
        {
            const int kk = tid;  // 128 threads = 128 key channels
            float gam = 0.0f;
            for (int i = 0; i < KDA_CHUNK; ++i) {
                if (i < cl) {
                    const i64 off = (i64)(c0 + i) * hk + h * KDA_K + kk;
                    gam += g[off];
                    const float e = expf(gam), ki = k[off];
                    eg[i][kk] = e;
                    kdec[i][kk] = ki * e;
                    kinv[i][kk] = ki * expf(-gam);
                    qdec[i][kk] = q[off] * e;
                } else {
                    eg[i][kk] = 1.0f;
                    kdec[i][kk] = kinv[i][kk] = qdec[i][kk] = 0.0f;
                }
            }
            for (int e = tid; e < KDA_CHUNK * 32; e += 128) {
                const int i = e / 32, c = e % 32;
                vv[i][c] = i < cl ? v[(i64)(c0 + i) * hk + h * KDA_V + slice * 32 + c] : 0.0f;
            }
            if (tid < KDA_CHUNK) bs[tid] = tid < cl ? beta[(i64)(c0 + tid) * heads + h] : 0.0f;
        }
        __syncthreads();
        // 2. L[i][j] = beta_i <kdec_i, kinv_j> (j < i), A[i][j] = <qdec_i, kinv_j> (j <= i).
        for (int e = tid; e < 2 * KDA_CHUNK * KDA_CHUNK; e += 128) {
            const int which = e / (KDA_CHUNK * KDA_CHUNK), ij = e % (KDA_CHUNK * KDA_CHUNK);
            const int i = ij / KDA_CHUNK, j = ij % KDA_CHUNK;
            const float* a = which == 0 ? kdec[i] : qdec[i];
            float acc = 0.0f;
            if (which == 0 ? j < i : j <= i)
                for (int d = 0; d < KDA_K; ++d) acc += a[d] * kinv[j][d];
            if (which == 0) Lm[i][j] = bs[i] * acc; else Am[i][j] = acc;
        }
        __syncthreads();
        // 3. Forward substitution (I + L)[W | U] = diag(beta)[kdec | v], column by column, so a
        //    thread only reads rows of its own column written earlier: no barrier inside.
        {
            const int kk = tid;
            for (int i = 0; i < KDA_CHUNK; ++i) {
                float w = bs[i] * kdec[i][kk];
                for (int j = 0; j < i; ++j) w -= Lm[i][j] * kdec[j][kk];
                kdec[i][kk] = w;
            }
            if (tid < 32) {
                for (int i = 0; i < KDA_CHUNK; ++i) {
                    float u = bs[i] * vv[i][tid];
                    for (int j = 0; j < i; ++j) u -= Lm[i][j] * vv[j][tid];
                    vv[i][tid] = u;
                }
            }
        }
        __syncthreads();
        // 4. V~ = U - W S and the inter-chunk part of O, (q * exp(Gamma)) S.
        float o_inter[KDA_CHUNK];
        float vt[KDA_CHUNK];
#pragma unroll
        for (int i = 0; i < KDA_CHUNK; ++i) {
            float ws = 0.0f, qs = 0.0f;
#pragma unroll
            for (int r = 0; r < KDA_ROWS; ++r) {
                const int kk = kda_row(r, lane);
                ws += kdec[i][kk] * s[r];
                qs += qdec[i][kk] * s[r];
            }
            vt[i] = vv[i][vloc] - kda_reduce_k(ws);
            o_inter[i] = kda_reduce_k(qs);
        }
        __syncthreads();  // everyone has read U before it is overwritten by V~
        if (lane < 8)
#pragma unroll
            for (int i = 0; i < KDA_CHUNK; ++i) vv[i][vloc] = vt[i];
        __syncthreads();
        // 5. O = inter + A V~ (intra-chunk), written by the first key-quarter of each column.
        if (lane < 8) {
            for (int i = 0; i < cl; ++i) {
                float acc = o_inter[i];
                for (int j = 0; j <= i; ++j) acc += Am[i][j] * vv[j][vloc];
                o_out[(i64)(c0 + i) * hk + h * KDA_V + vcol] = acc;
            }
        }
        // 6. Checkpoints inside this chunk, then the chunk-end state:
        //    S_m = exp(Gamma_{m-1}) * S + sum_{j<m} (k_j exp(Gamma_{m-1} - Gamma_j)) V~_j^T.
        while (next_ck < n_ckpt && ckpt_n[next_ck] <= c0 + cl) {
            const int m = ckpt_n[next_ck] - c0;
            if (m >= 1) {
                float* Sc = arena + ckpt_off[next_ck] + s_base;
#pragma unroll
                for (int r = 0; r < KDA_ROWS; ++r) {
                    const int kk = kda_row(r, lane);
                    const float em = eg[m - 1][kk];
                    float acc = em * s[r];
                    for (int j = 0; j < m; ++j) acc += kinv[j][kk] * em * vv[j][vloc];
                    Sc[kk * KDA_V + vcol] = acc;
                }
            }
            ++next_ck;
        }
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int kk = kda_row(r, lane);
            const float em = eg[cl - 1][kk];
            float acc = em * s[r];
            for (int j = 0; j < cl; ++j) acc += kinv[j][kk] * em * vv[j][vloc];
            s[r] = acc;
        }
        __syncthreads();  // shared arrays are rewritten by the next chunk
    }
#pragma unroll
    for (int i = 0; i < KDA_ROWS; ++i) S[kda_row(i, lane) * KDA_V + vcol] = s[i];
}
