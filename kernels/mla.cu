// Absorbed MLA decode over the paged latent cache (k3-architecture.md §2.2):
//   mla_append_rows_f32   new rows [RMSNorm(c_kv) ; k_r] into their pages
//   mla_absorb_q_f32      q~_h = [W_UK,h^T q_nope,h ; q_r,h]  (row = kv_lora + rope, 576 in K3)
//   mla_attend_f32        MQA over rows 0..len-1 with online softmax, split over positions
//   mla_combine_f32       merge the splits (log-sum-exp), o_h = W_UV,h o~_h
// Queries are independent items with their own page table and length, so a prefill chunk can
// run as T queries with causal lengths start+1 .. start+T (exact; the expanded form is faster).
//
// Page addressing: row j of query item n is at float offset page_start[pt_base[n] + j / page_tokens]
// + (j % page_tokens) * row, where page_start already includes the layer's offset in the page.
#include "common.cuh"

#define MLA_MAX_ROW 576
#define MLA_LANE_VALS (MLA_MAX_ROW / 32)  // 18 row values per lane
#define MLA_HPB 4                         // heads per block: one row load feeds 4 heads

__device__ __forceinline__ i64 mla_row_off(const i64* page_start, int base, int j, int page_tokens, int row) {
    return page_start[base + j / page_tokens] + (i64)(j % page_tokens) * row;
}

// One block per new token: dst[tok] = float offset of its row.
extern "C" __global__ void mla_append_rows_f32(const float* __restrict__ kv_a, const float* __restrict__ norm_w,
                                               float* __restrict__ arena, const i64* __restrict__ dst, int tokens,
                                               int kv_lora, int rope, float eps) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const int row = kv_lora + rope;
    const float* x = kv_a + (i64)t * row;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) ss += x[c] * x[c];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)kv_lora + eps);
    float* o = arena + dst[t];
    for (int c = threadIdx.x; c < row; c += blockDim.x) o[c] = c < kv_lora ? x[c] * inv * norm_w[c] : x[c];
}

// Grid (items, heads), blockDim 128. q [items, H*(nope+rope)], kv_b [H*(nope+v_dim), kv_lora].
// Output qt [items, H, row]. A GEMV per (item, head): fine for decode batches; prefill should
// use the expanded form instead.
extern "C" __global__ void mla_absorb_q_f32(const float* __restrict__ q, const float* __restrict__ kv_b,
                                            float* __restrict__ qt, int items, int heads, int nope, int rope,
                                            int v_dim, int kv_lora) {
    __shared__ float qn[256];
    const int n = blockIdx.x, h = blockIdx.y;
    if (n >= items || h >= heads || nope > 256) return;
    const int qk = nope + rope, row = kv_lora + rope;
    const float* qh = q + ((i64)n * heads + h) * qk;
    for (int p = threadIdx.x; p < nope; p += blockDim.x) qn[p] = qh[p];
    __syncthreads();
    const float* wuk = kv_b + (i64)h * (nope + v_dim) * kv_lora;
    float* out = qt + ((i64)n * heads + h) * row;
    for (int l = threadIdx.x; l < kv_lora; l += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < nope; ++p) acc += qn[p] * wuk[(i64)p * kv_lora + l];
        out[l] = acc;
    }
    for (int r = threadIdx.x; r < rope; r += blockDim.x) out[kv_lora + r] = qh[nope + r];
}

// Grid (items, ceil(H / MLA_HPB), splits), 128 threads (4 warps). Split s covers positions
// [s*chunk, min(len, (s+1)*chunk)); warp w of the block takes every 4th position of it. Each
// warp keeps, for MLA_HPB heads, a running max m, sum l and o~ (kv_lora values, 16 per lane);
// the 4 warps merge in shared memory and write the partial (m, l, o~) of the split.
// part: [items, H, splits, kv_lora + 2].
extern "C" __global__ void __launch_bounds__(128)
mla_attend_f32(const float* __restrict__ qt, const float* __restrict__ arena, const i64* __restrict__ page_start,
               const int* __restrict__ pt_base, const int* __restrict__ lens, float* __restrict__ part, int items,
               int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk, float scale) {
    __shared__ float red_o[4][MLA_HPB][512];
    __shared__ float red_ml[4][MLA_HPB][2];
    const int n = blockIdx.x, h0 = blockIdx.y * MLA_HPB, sp = blockIdx.z;
    const int row = kv_lora + rope;
    if (n >= items || row > MLA_MAX_ROW || kv_lora > 512) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int len = lens[n], base = pt_base[n];
    const int j0 = sp * chunk, j1 = min(len, j0 + chunk);
    float q[MLA_HPB][MLA_LANE_VALS];
#pragma unroll
    for (int hh = 0; hh < MLA_HPB; ++hh)
#pragma unroll
        for (int i = 0; i < MLA_LANE_VALS; ++i) {
            const int c = lane + 32 * i;
            q[hh][i] = (h0 + hh < heads && c < row) ? qt[((i64)n * heads + h0 + hh) * row + c] * scale : 0.0f;
        }
    float m[MLA_HPB], l[MLA_HPB], acc[MLA_HPB][16];
#pragma unroll
    for (int hh = 0; hh < MLA_HPB; ++hh) {
        m[hh] = K3_NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[hh][i] = 0.0f;
    }
    for (int j = j0 + warp; j < j1; j += 4) {
        const float* r = arena + mla_row_off(page_start, base, j, page_tokens, row);
        float x[MLA_LANE_VALS];
#pragma unroll
        for (int i = 0; i < MLA_LANE_VALS; ++i) {
            const int c = lane + 32 * i;
            x[i] = c < row ? r[c] : 0.0f;
        }
#pragma unroll
        for (int hh = 0; hh < MLA_HPB; ++hh) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < MLA_LANE_VALS; ++i) s += q[hh][i] * x[i];
            s = warp_sum(s);
            const float mn = fmaxf(m[hh], s);
            const float corr = expf(m[hh] - mn), p = expf(s - mn);
            l[hh] = l[hh] * corr + p;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int c = lane + 32 * i;
                acc[hh][i] = acc[hh][i] * corr + (c < kv_lora ? p * x[i] : 0.0f);
            }
            m[hh] = mn;
        }
    }
#pragma unroll
    for (int hh = 0; hh < MLA_HPB; ++hh) {
#pragma unroll
        for (int i = 0; i < 16; ++i) red_o[warp][hh][lane + 32 * i] = acc[hh][i];
        if (lane == 0) {
            red_ml[warp][hh][0] = m[hh];
            red_ml[warp][hh][1] = l[hh];
        }
    }
    __syncthreads();
    // Warp hh merges head hh (MLA_HPB == 4 == warps).
    const int hh = warp, h = h0 + hh;
    if (h >= heads) return;
    float mm = K3_NEG_INF;
    for (int w = 0; w < 4; ++w) mm = fmaxf(mm, red_ml[w][hh][0]);
    float* out = part + (((i64)n * heads + h) * splits + sp) * (kv_lora + 2);
    float f[4], ll = 0.0f;
    for (int w = 0; w < 4; ++w) {
        f[w] = mm == K3_NEG_INF ? 0.0f : expf(red_ml[w][hh][0] - mm);
        ll += f[w] * red_ml[w][hh][1];
    }
    for (int c = lane; c < kv_lora; c += 32)
        out[c] = f[0] * red_o[0][hh][c] + f[1] * red_o[1][hh][c] + f[2] * red_o[2][hh][c] + f[3] * red_o[3][hh][c];
    if (lane == 0) {
        out[kv_lora] = mm;
        out[kv_lora + 1] = ll;
    }
}

// Grid (items, heads), 128 threads: merge the splits into o~ (shared), then o = W_UV,h o~.
// o [items, H*v_dim].
extern "C" __global__ void mla_combine_f32(const float* __restrict__ part, const float* __restrict__ kv_b,
                                           float* __restrict__ o, int items, int heads, int nope, int v_dim,
                                           int kv_lora, int splits) {
    __shared__ float lat[512];
    __shared__ float wsplit[256];
    __shared__ float inv_l;
    const int n = blockIdx.x, h = blockIdx.y;
    if (n >= items || h >= heads || kv_lora > 512 || splits > 256) return;
    const float* p = part + ((i64)n * heads + h) * splits * (kv_lora + 2);
    if (threadIdx.x == 0) {
        float mm = K3_NEG_INF;
        for (int s = 0; s < splits; ++s) mm = fmaxf(mm, p[s * (kv_lora + 2) + kv_lora]);
        float ll = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ms = p[s * (kv_lora + 2) + kv_lora];
            wsplit[s] = ms == K3_NEG_INF ? 0.0f : expf(ms - mm);
            ll += wsplit[s] * p[s * (kv_lora + 2) + kv_lora + 1];
        }
        inv_l = ll > 0.0f ? 1.0f / ll : 0.0f;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < splits; ++s) a += wsplit[s] * p[s * (kv_lora + 2) + c];
        lat[c] = a * inv_l;
    }
    __syncthreads();
    // One warp per output channel: coalesced reads of the W_UV row.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* wuv = kv_b + ((i64)h * (nope + v_dim) + nope) * kv_lora;
    for (int vd = warp; vd < v_dim; vd += nw) {
        float a = 0.0f;
        for (int c = lane; c < kv_lora; c += 32) a += wuv[(i64)vd * kv_lora + c] * lat[c];
        a = warp_sum(a);
        if (lane == 0) o[(i64)n * heads * v_dim + h * v_dim + vd] = a;
    }
}
