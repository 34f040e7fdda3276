// Expanded ("compute-friendly") MLA prefill, docs/k3-model.md §4 (prefill) (host side: mla_prefill.rs).
// For one sequence with T new tokens at start_pos (keys 0..len, len = start_pos + T), after the new
// rows were appended to the pages by mla_append_rows_f32:
//   mla_prefill_gather_f32   cached rows 0..len out of the pages: c -> lat [len, kv_lora], k_r ->
//                            the rope columns of K [heads, len, qk] (shared by all heads, NoPE: unrotated)
//   (cuBLAS)                 K_nope,h = lat W_UK,h^T into K's first nope columns, V_h = lat W_UV,h^T,
//                            S_h = Q_h K_h^T * scale for a chunk of queries
//   mla_prefill_softmax_f32  causal row softmax of S in place (masked keys become exact zeros)
//   (cuBLAS)                 O_h = P_h V_h, written straight into o [T, H * v_dim]
// Every key is expanded once per call (heads * (nope + v_dim) values per key), so the long
// qk-576 / v-512 dot products of the absorbed form become qk-192 / v-128 GEMMs.
#include "common.cuh"

// One block per key row j (any block size). page_start[p] = float offset of this layer's first row
// in page p; k's head stride is len * qk (the rope part sits at columns nope .. qk of each row).
extern "C" __global__ void mla_prefill_gather_f32(const float* __restrict__ arena, const i64* __restrict__ page_start,
                                                  float* __restrict__ lat, float* __restrict__ k, int len, int heads,
                                                  int kv_lora, int rope, int qk, int page_tokens) {
    const int j = blockIdx.x;
    if (j >= len) return;
    const int row = kv_lora + rope, nope = qk - rope;
    const float* src = arena + page_start[j / page_tokens] + (i64)(j % page_tokens) * row;
    float* dst = lat + (i64)j * kv_lora;
    for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) dst[c] = src[c];
    for (int e = threadIdx.x; e < heads * rope; e += blockDim.x) {
        const int h = e / rope, r = e - h * rope;
        k[((i64)h * len + j) * qk + nope + r] = src[kv_lora + r];
    }
}

#define MLA_SM_THREADS 256
#define MLA_SM_CACHE 32  // values per thread kept in registers: rows of up to 8192 keys are read once

// One block of MLA_SM_THREADS per score row; rows = heads_in_group * tq, row r is query r % tq of
// the chunk (S_h is [tq, lk] row-major, head after head), at position q0 + r % tq, so it sees keys
// 0 .. q0 + r % tq. The scale is already in S (the GEMM's alpha). Softmax over the visible keys,
// zeros after them (the P V GEMM runs over all lk keys).
extern "C" __global__ void __launch_bounds__(MLA_SM_THREADS)
mla_prefill_softmax_f32(float* __restrict__ s, int rows, int tq, int lk, int q0) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int lim = min(lk, q0 + r % tq + 1);
    float* x = s + (i64)r * lk;
    if (lim <= MLA_SM_THREADS * MLA_SM_CACHE) {
        float v[MLA_SM_CACHE];
        float m = K3_NEG_INF;
#pragma unroll
        for (int i = 0; i < MLA_SM_CACHE; ++i) {
            const int j = threadIdx.x + i * MLA_SM_THREADS;
            v[i] = j < lim ? x[j] : K3_NEG_INF;
            m = fmaxf(m, v[i]);
        }
        m = block_max(m, scratch);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_SM_CACHE; ++i) {
            const int j = threadIdx.x + i * MLA_SM_THREADS;
            v[i] = j < lim ? expf(v[i] - m) : 0.0f;
            sum += v[i];
        }
        const float inv = 1.0f / block_sum(sum, scratch);
#pragma unroll
        for (int i = 0; i < MLA_SM_CACHE; ++i) {
            const int j = threadIdx.x + i * MLA_SM_THREADS;
            if (j < lim) x[j] = v[i] * inv;
        }
    } else {
        // Long rows: running (max, sum) per thread in one read, then one read + write.
        float m = K3_NEG_INF, sum = 0.0f;
        for (int j = threadIdx.x; j < lim; j += MLA_SM_THREADS) {
            const float xv = x[j];
            if (xv > m) {
                sum = sum * expf(m - xv) + 1.0f;
                m = xv;
            } else {
                sum += expf(xv - m);
            }
        }
        const float mb = block_max(m, scratch);
        sum = m == K3_NEG_INF ? 0.0f : sum * expf(m - mb);
        const float inv = 1.0f / block_sum(sum, scratch);
        for (int j = threadIdx.x; j < lim; j += MLA_SM_THREADS) x[j] = expf(x[j] - mb) * inv;
    }
    for (int j = lim + threadIdx.x; j < lk; j += MLA_SM_THREADS) x[j] = 0.0f;
}
