// Routed experts in MXFP4 (docs/model-format.md): weight-only W4A32 on CUDA cores, decoding
// each 32-element block (16 packed bytes + one E8M0 scale) once per tile of up to 8 tokens.
//   moe_sort_assignments   group the T*k (token, slot) assignments by expert (counting sort)
//   mxfp4_expert_up_f32    act[a] = SiTU-GLU(W1_e z_t, W3_e z_t) for each assignment a of e
//   mxfp4_expert_down_f32  y[a] = W2_e act[a]
//   moe_combine_f32        out[t] = sum_j w[t,j] y[t*k + j]   (fixed slot order: deterministic)
//   mxfp4_dequant_f32      a whole matrix to f32 (tests; prefill GEMMs through cuBLAS)
// Experts of a layer are stored back to back: packed [E, rows, cols/2], scales [E, rows, cols/32].
// A Hopper-fast version would expand to bf16 in registers and use wgmma (k3-architecture.md §5.4).
#include "common.cuh"

#define MX_TOKENS 8  // assignments per pass: weights decoded once, reused 8 times
#define MX_ROWS_PER_BLOCK 8

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

// Decode one MX block: 16 bytes -> 32 values (element 2j low nibble, 2j+1 high nibble) times scale.
__device__ __forceinline__ void mx_decode_block(const u8* __restrict__ packed, u8 scale_byte, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(packed);
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    const float sc = e8m0_to_f32(scale_byte);
#pragma unroll
    for (int wi = 0; wi < 4; ++wi)
#pragma unroll
        for (int b = 0; b < 8; ++b) out[wi * 8 + b] = fp4_e2m1_to_f32((words[wi] >> (4 * b)) & 0xFu) * sc;
}

// Dot of 32 decoded weights with x[0..32) (16-byte aligned).
__device__ __forceinline__ float mx_dot32(const float* w, const float* __restrict__ x) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 v = x4[i];
        acc += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
    }
    return acc;
}

// Grid (E, ceil(inter / 8)), 256 threads: warp w computes row r = blockIdx.y*8 + w of W1 and W3
// for every assignment of expert e. z [T, latent]; act [n_assign, inter].
extern "C" __global__ void __launch_bounds__(256)
mxfp4_expert_up_f32(const float* __restrict__ z, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                    const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                    const int* __restrict__ sorted, float* __restrict__ act, int top_k, int latent, int inter,
                    float beta, float beta_lin, int has_lin) {
    const int e = blockIdx.x, lane = threadIdx.x & 31;
    const int r = blockIdx.y * MX_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int a0 = offsets[e], a1 = offsets[e + 1];
    if (a0 == a1 || r >= inter) return;
    const int nb = latent / 32;
    const i64 mrow = (i64)e * inter + r;
    const u8* p1 = w1p + mrow * (latent / 2);
    const u8* p3 = w3p + mrow * (latent / 2);
    const u8* s1 = w1s + mrow * nb;
    const u8* s3 = w3s + mrow * nb;
    for (int t0 = a0; t0 < a1; t0 += MX_TOKENS) {
        const int nt = min(MX_TOKENS, a1 - t0);
        float acc1[MX_TOKENS], acc3[MX_TOKENS];
#pragma unroll
        for (int i = 0; i < MX_TOKENS; ++i) acc1[i] = acc3[i] = 0.0f;
        for (int b = lane; b < nb; b += 32) {
            float wa[32], wb[32];
            mx_decode_block(p1 + b * 16, s1[b], wa);
            mx_decode_block(p3 + b * 16, s3[b], wb);
#pragma unroll
            for (int i = 0; i < MX_TOKENS; ++i) {
                if (i < nt) {
                    const float* x = z + (i64)(sorted[t0 + i] / top_k) * latent + b * 32;
                    acc1[i] += mx_dot32(wa, x);
                    acc3[i] += mx_dot32(wb, x);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < MX_TOKENS; ++i) {
            const float g = warp_sum(acc1[i]), u = warp_sum(acc3[i]);
            if (lane == 0 && i < nt) {
                const float sa = beta * tanhf(g / beta) * k3_sigmoid(g);
                const float ub = has_lin ? beta_lin * tanhf(u / beta_lin) : u;
                act[(i64)sorted[t0 + i] * inter + r] = sa * ub;
            }
        }
    }
}

// Grid (E, ceil(latent / 8)), 256 threads: y[a, r] = W2_e[r, :] . act[a, :].
extern "C" __global__ void __launch_bounds__(256)
mxfp4_expert_down_f32(const float* __restrict__ act, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                      const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y,
                      int latent, int inter) {
    const int e = blockIdx.x, lane = threadIdx.x & 31;
    const int r = blockIdx.y * MX_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int a0 = offsets[e], a1 = offsets[e + 1];
    if (a0 == a1 || r >= latent) return;
    const int nb = inter / 32;
    const i64 mrow = (i64)e * latent + r;
    const u8* p = w2p + mrow * (inter / 2);
    const u8* s = w2s + mrow * nb;
    for (int t0 = a0; t0 < a1; t0 += MX_TOKENS) {
        const int nt = min(MX_TOKENS, a1 - t0);
        float acc[MX_TOKENS];
#pragma unroll
        for (int i = 0; i < MX_TOKENS; ++i) acc[i] = 0.0f;
        for (int b = lane; b < nb; b += 32) {
            float w[32];
            mx_decode_block(p + b * 16, s[b], w);
#pragma unroll
            for (int i = 0; i < MX_TOKENS; ++i)
                if (i < nt) acc[i] += mx_dot32(w, act + (i64)sorted[t0 + i] * inter + b * 32);
        }
#pragma unroll
        for (int i = 0; i < MX_TOKENS; ++i) {
            const float v = warp_sum(acc[i]);
            if (lane == 0 && i < nt) y[(i64)sorted[t0 + i] * latent + r] = v;
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

// out [rows, cols] f32 from packed [rows, cols/2] + scales [rows, cols/32]; one thread per byte.
extern "C" __global__ void mxfp4_dequant_f32(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                             float* __restrict__ out, int rows, int cols) {
    const i64 n = (i64)rows * (cols / 2);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / (cols / 2), j = i % (cols / 2);
        const float sc = e8m0_to_f32(scales[r * (cols / 32) + (2 * j) / 32]);
        const u8 b = packed[i];
        out[r * cols + 2 * j] = fp4_e2m1_to_f32(b & 0xFu) * sc;
        out[r * cols + 2 * j + 1] = fp4_e2m1_to_f32((u32)b >> 4) * sc;
    }
}
