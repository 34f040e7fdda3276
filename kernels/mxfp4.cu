// Routed experts in MXFP4 (docs/model-format.md) for decode steps: weight-only W4A32 on CUDA cores.
//   moe_sort_assignments   group the T*k (token, slot) assignments by expert (counting sort)
//   mxfp4_up_gemv_f32      act[a] = SiTU-GLU(W1_e z_t, W3_e z_t) for each assignment a of e
//   mxfp4_down_gemv_f32    y[a] = W2_e act[a]
//   moe_combine_f32        out[t] = sum_j w[t,j] y[t*k + j]   (fixed slot order: deterministic)
// Experts of a layer are stored back to back: packed [E, rows, cols/2], scales [E, rows, cols/32].
// Large steps expand the experts to bf16 for tensor-core GEMMs instead (moe_gemm.cu); the gemv pair
// here takes 1-token steps (H200, K3 sizes, top-16: 183 us vs 213 for the tensor-core pair in
// mxfp4_tc.cu, which takes 2 tokens and more: ops.rs mx_experts_choice).
#include "common.cuh"


// Single block (1024 threads). idx [n_assign] expert ids; offsets [E+1] (out), sorted [n_assign]
// (out) = assignment ids grouped by expert. Order inside an expert is arbitrary: each
// assignment's output has its own row, so results do not depend on it.
extern "C" __global__ void moe_sort_assignments(const int* __restrict__ idx, int n_assign, int experts,
                                                int* __restrict__ offsets, int* __restrict__ sorted) {
    __shared__ int count[1025];
    __shared__ int cursor[1025];
    if (experts > 1024) return;
    for (int e = threadIdx.x; e <= experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const int e = idx[a];
        if (e >= 0 && e < experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < experts; ++e) {
            offsets[e] = run;
            cursor[e] = run;
            run += count[e];
        }
        offsets[experts] = run;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const int e = idx[a];
        if (e >= 0 && e < experts) sorted[atomicAdd(&cursor[e], 1)] = a;
    }
}

// mx_active_expert (common.cuh) maps block x of the expert kernels to the x-th busy expert.

// ---------------------------------------------------------------------------------------------
// Decode-step expert kernels (few tokens per expert). At T = 1
// the step is one pass over 16 experts' weights (281 MB at K3 sizes), so what counts is shared /
// L1 wavefronts and instructions per weight byte. Two lanes share a row (lane 2r + h takes the
// 16-byte MX blocks h, h + 2, ...: each lane pair reads whole 32-byte sectors) and sum the halves
// with one shuffle at the end: no block reduction. The step's tokens for expert e are staged in
// shared memory (up to `stage` per pass), so all 16 rows of a warp read the same activations
// (broadcast) and each weight byte is loaded once per pass and applied to every staged token.
// A nibble decodes through a 16-entry shared table (index = code * 4 built with one AND per 4
// codes, one byte extract, one LDS): 16 distinct words in 16 banks, so never a conflict, and the
// values are exact (no subnormal tricks that -ftz could flush). The block's scale is applied once
// per 32-value dot. Extra tokens beyond `stage` take further passes (weights re-read).
#define MXG_ROWS 64 // rows per 128-thread block: 16 per warp, two lanes per row
#define MXG_T 4     // accumulators per lane and matrix: the most tokens one pass applies

__shared__ float mxg_tab[16];  // E2M1 code -> value
// Staged activations, [stage][cols / 4] float4; float4 g of a row sits at g ^ ((g >> 1) & 4): the
// odd 32-value chunks (the h = 1 lanes') have their halves swapped, so a warp's two distinct
// addresses per load land in different banks.
extern __shared__ float4 mxg_xs[];

__device__ __forceinline__ void mxg_stage(const float* __restrict__ src, int cols4, float4* dst) {
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (int g = threadIdx.x; g < cols4; g += blockDim.x) dst[g ^ ((g >> 1) & 4)] = s4[g];
}

// One packed word (elements 8 wi .. 8 wi + 7: byte k = element 2k low nibble, 2k + 1 high).
__device__ __forceinline__ void mxg_decode_word(u32 w, float* v) {
    const u32 lo = (w << 2) & 0x3c3c3c3cu, hi = (w >> 2) & 0x3c3c3c3cu;  // code * 4 in each byte
    const char* t = reinterpret_cast<const char*>(mxg_tab);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = *reinterpret_cast<const float*>(t + __byte_perm(lo, 0, 0x4440 + k));
        v[2 * k + 1] = *reinterpret_cast<const float*>(t + __byte_perm(hi, 0, 0x4440 + k));
    }
}

// acc[m][i] = this lane's half of row m (NM matrices) . staged token i, for i < nt. U chunk steps
// of loads are issued before any is decoded (bytes in flight); DC independent FMA chains per dot.
template <int NM, int U>
__device__ __forceinline__ void mxg_rows(const u8* const (&pk)[NM], const u8* const (&ps)[NM], int nchunks, int h,
                                         int nt, int cols4, float (&acc)[NM][MXG_T]) {
    constexpr int DC = NM == 1 ? 2 : 1;
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int i = 0; i < MXG_T; ++i) acc[m][i] = 0.0f;
    for (int j0 = 0; j0 < nchunks; j0 += 2 * U) {
        uint4 raw[NM][U];
        u32 sb[NM][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = min(j0 + 2 * u + h, nchunks - 1);  // past the end: loaded, not used
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                raw[m][u] = __ldg(reinterpret_cast<const uint4*>(pk[m] + c * 16));
                sb[m][u] = ps[m][c];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = j0 + 2 * u + h;
            if (c < nchunks) {
                const float4* xlo = mxg_xs + c * 8 + 4 * h;  // logical float4s 0..3 of chunk c
                const float4* xhi = mxg_xs + c * 8 - 4 * h;  // 4..7
                float d[NM][MXG_T][DC];
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int i = 0; i < MXG_T; ++i)
#pragma unroll
                        for (int q = 0; q < DC; ++q) d[m][i][q] = 0.0f;
#pragma unroll
                for (int wi = 0; wi < 4; ++wi) {
                    float v[NM][8];
#pragma unroll
                    for (int m = 0; m < NM; ++m) {
                        const uint4 r4 = raw[m][u];
                        mxg_decode_word(wi == 0 ? r4.x : wi == 1 ? r4.y : wi == 2 ? r4.z : r4.w, v[m]);
                    }
                    const float4* xp = wi < 2 ? xlo : xhi;
#pragma unroll
                    for (int i = 0; i < MXG_T; ++i) {
                        if (i < nt) {
                            const float4 a = xp[i * cols4 + 2 * wi], b = xp[i * cols4 + 2 * wi + 1];
#pragma unroll
                            for (int m = 0; m < NM; ++m) {
                                float s = d[m][i][wi % DC];
                                s = fmaf(v[m][0], a.x, s);
                                s = fmaf(v[m][1], a.y, s);
                                s = fmaf(v[m][2], a.z, s);
                                s = fmaf(v[m][3], a.w, s);
                                s = fmaf(v[m][4], b.x, s);
                                s = fmaf(v[m][5], b.y, s);
                                s = fmaf(v[m][6], b.z, s);
                                s = fmaf(v[m][7], b.w, s);
                                d[m][i][wi % DC] = s;
                            }
                        }
                    }
                }
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    const float sc = e8m0_to_f32((u8)sb[m][u]);
#pragma unroll
                    for (int i = 0; i < MXG_T; ++i) {
                        float s = d[m][i][0];
#pragma unroll
                        for (int q = 1; q < DC; ++q) s += d[m][i][q];
                        acc[m][i] = fmaf(s, sc, acc[m][i]);
                    }
                }
            }
        }
    }
}

// Grid (min(E, assignments), ceil(inter / 64)), 128 threads, dynamic shared memory stage * latent
// * 4 bytes: block x takes the x-th busy expert e (mx_active_expert), lane pair r of the block
// computes row blockIdx.y*64 + r of W1 and W3 for every assignment of e, `stage` (1..4) tokens
// per pass. `experts` = E; `stage` as ops.rs mx_gemv_stage.
extern "C" __global__ void __launch_bounds__(128)
mxfp4_up_gemv_f32(const float* __restrict__ z, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                  const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                  const int* __restrict__ sorted, float* __restrict__ act, int top_k, int latent, int inter,
                  float beta, float beta_lin, int has_lin, int experts, int stage) {
    const int e = mx_active_expert(offsets, experts, blockIdx.x);
    if (threadIdx.x < 16) mxg_tab[threadIdx.x] = fp4_e2m1_to_f32(threadIdx.x);
    if (e < 0) return;  // block-uniform
    const int h = threadIdx.x & 1, r = blockIdx.y * MXG_ROWS + (threadIdx.x >> 1);
    const int nb = latent / 32, cols4 = latent / 4;
    const i64 mrow = (i64)e * inter + min(r, inter - 1);  // tail lanes load a valid row, store nothing
    const u8* pk[2] = {w1p + mrow * (latent / 2), w3p + mrow * (latent / 2)};
    const u8* ps[2] = {w1s + mrow * nb, w3s + mrow * nb};
    const int a0 = offsets[e], a1 = offsets[e + 1], per = max(1, min(stage, MXG_T));
    for (int t0 = a0; t0 < a1; t0 += per) {
        const int nt = min(per, a1 - t0);
        __syncthreads();  // the previous pass is done with the stage (first pass: mxg_tab written)
        for (int i = 0; i < nt; ++i)
            mxg_stage(z + (i64)(sorted[t0 + i] / top_k) * latent, cols4, mxg_xs + i * cols4);
        __syncthreads();
        float acc[2][MXG_T];
        mxg_rows<2, 2>(pk, ps, nb, h, nt, cols4, acc);
#pragma unroll
        for (int i = 0; i < MXG_T; ++i) {
            const float g = acc[0][i] + __shfl_xor_sync(K3_FULL_MASK, acc[0][i], 1);
            const float u = acc[1][i] + __shfl_xor_sync(K3_FULL_MASK, acc[1][i], 1);
            if (h == 0 && i < nt && r < inter)
                act[(i64)sorted[t0 + i] * inter + r] = situ_glu_one(g, u, beta, beta_lin, has_lin);
        }
    }
}

// Grid (min(E, assignments), ceil(latent / 64)), 128 threads, dynamic shared memory stage * inter
// * 4 bytes: y[a, r] = W2_e[r, :] . act[a, :], experts, rows and passes as above.
extern "C" __global__ void __launch_bounds__(128)
mxfp4_down_gemv_f32(const float* __restrict__ act, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                    const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y,
                    int latent, int inter, int experts, int stage) {
    const int e = mx_active_expert(offsets, experts, blockIdx.x);
    if (threadIdx.x < 16) mxg_tab[threadIdx.x] = fp4_e2m1_to_f32(threadIdx.x);
    if (e < 0) return;
    const int h = threadIdx.x & 1, r = blockIdx.y * MXG_ROWS + (threadIdx.x >> 1);
    const int nb = inter / 32, cols4 = inter / 4;
    const i64 mrow = (i64)e * latent + min(r, latent - 1);
    const u8* pk[1] = {w2p + mrow * (inter / 2)};
    const u8* ps[1] = {w2s + mrow * nb};
    const int a0 = offsets[e], a1 = offsets[e + 1], per = max(1, min(stage, MXG_T));
    for (int t0 = a0; t0 < a1; t0 += per) {
        const int nt = min(per, a1 - t0);
        __syncthreads();
        for (int i = 0; i < nt; ++i) mxg_stage(act + (i64)sorted[t0 + i] * inter, cols4, mxg_xs + i * cols4);
        __syncthreads();
        float acc[1][MXG_T];
        mxg_rows<1, 4>(pk, ps, nb, h, nt, cols4, acc);
#pragma unroll
        for (int i = 0; i < MXG_T; ++i) {
            const float v = acc[0][i] + __shfl_xor_sync(K3_FULL_MASK, acc[0][i], 1);
            if (h == 0 && i < nt && r < latent) y[(i64)sorted[t0 + i] * latent + r] = v;
        }
    }
}

// out [T, latent] = sum over slots j (in order) of w[t*k+j] * y[t*k+j, :].
extern "C" __global__ void moe_combine_f32(const float* __restrict__ y, const float* __restrict__ w,
                                           float* __restrict__ out, int tokens, int top_k, int latent) {
    const i64 n = (i64)tokens * latent;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / latent, c = i % latent;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) acc += w[t * top_k + j] * y[(t * top_k + j) * latent + c];
        out[i] = acc;
    }
}
