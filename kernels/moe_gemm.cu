// Routed experts through tensor-core GEMMs (cuBLAS, bf16 in, f32 accumulate and out) for steps
// with many assignments (prefill, large decode batches). The MXFP4 weights of the touched experts
// are expanded to bf16 (exact: an E2M1 value times a power of two fits bf16), and every f32
// activation x is fed as two bf16 rows, hi = bf16(x) and lo = bf16(x - hi), whose products are
// summed in f32: the result keeps ~16 mantissa bits of x, so it tracks the f32 CPU backend to
// ~1e-5 instead of bf16's ~4e-3.
//
// Rows of the stacked matrices: the assignments sorted by expert (moe_sort_assignments), and for
// expert e with sorted positions [off, off + cnt) the hi rows at [2 off, 2 off + cnt) and the lo
// rows right after, so each expert is one GEMM over 2 cnt contiguous rows. Position p of e has its
// hi row at off + p and its lo row at off + p + cnt.
//   moe_gather_split_bf16   z rows -> stacked hi/lo bf16 rows (+ inverse of the sort)
//   mxfp4_to_bf16_experts   listed experts' MXFP4 matrices -> bf16 scratch
//   moe_glu_split_bf16      (hi + lo) of the up GEMM -> SiTU-GLU -> stacked hi/lo bf16 rows
//   moe_combine_split_f32   out[t] = sum_j w[t,j] (hi + lo rows of assignment (t, j))
#include "common.cuh"

// The expert whose sorted range holds position p: the largest e with offsets[e] <= p (empty
// experts share their offset with the next one, so the largest is the non-empty one).
__device__ __forceinline__ int expert_of(const int* __restrict__ offsets, int experts, int p) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Grid n_assign blocks (one per sorted position p), 256 threads. z [T, latent] f32;
// xs [2 n_assign, latent] bf16 bits; inv [n_assign]: inv[sorted[p]] = p.
extern "C" __global__ void moe_gather_split_bf16(const float* __restrict__ z, const int* __restrict__ sorted,
                                                 const int* __restrict__ offsets, int experts, int top_k,
                                                 int latent, u16* __restrict__ xs, int* __restrict__ inv) {
    const int p = blockIdx.x;
    const int a = sorted[p];
    const int e = expert_of(offsets, experts, p);
    const int cnt = offsets[e + 1] - offsets[e];
    const i64 hi_row = offsets[e] + p, lo_row = hi_row + cnt;
    const float* src = z + (i64)(a / top_k) * latent;
    for (int c = threadIdx.x; c < latent; c += blockDim.x) {
        u16 h, l;
        split_bf16(src[c], h, l);
        xs[hi_row * latent + c] = h;
        xs[lo_row * latent + c] = l;
    }
    if (threadIdx.x == 0) inv[a] = p;
}

// The `count` experts in list[] (indices into the layer's experts), each an MXFP4 matrix
// [rows, cols] (packed [E, rows, cols/2], scales [E, rows, cols/32]), expanded to bf16 bits at
// out + i * out_stride + (row0 + r) * cols. Grid (x, count): blockIdx.y is the listed expert, the
// x blocks stride over its rows * cols/32 MX blocks, one thread per MX block (16 bytes -> 64
// bytes). 32-bit index math: a 64-bit divide per block cost more than the memory traffic.
extern "C" __global__ void mxfp4_to_bf16_experts(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                                 const int* __restrict__ list, int count, int rows, int cols,
                                                 u16* __restrict__ out, i64 out_stride, int row0) {
    const int which = blockIdx.y;
    if (which >= count) return;
    const int bpr = cols / 32;
    const int per_expert = rows * bpr;
    const i64 e = list[which];
    const u8* pk = packed + e * rows * (i64)(cols / 2);
    const u8* sc_row = scales + e * rows * (i64)bpr;
    u16* dst_base = out + which * out_stride + (i64)row0 * cols;
    for (int rb = blockIdx.x * blockDim.x + threadIdx.x; rb < per_expert; rb += gridDim.x * blockDim.x) {
        const int r = rb / bpr, b = rb - r * bpr;
        const uint4 raw = *reinterpret_cast<const uint4*>(pk + (i64)r * (cols / 2) + b * 16);
        const float sc = e8m0_to_f32(sc_row[rb]);
        const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
        u32 packed_out[16];
#pragma unroll
        for (int wi = 0; wi < 4; ++wi)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 lo = f32_to_bf16_bits(fp4_e2m1_to_f32((words[wi] >> (8 * j)) & 0xFu) * sc);
                const u32 hi = f32_to_bf16_bits(fp4_e2m1_to_f32((words[wi] >> (8 * j + 4)) & 0xFu) * sc);
                packed_out[wi * 4 + j] = lo | (hi << 16);
            }
        uint4* dst = reinterpret_cast<uint4*>(dst_base + (i64)r * cols + b * 32);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            dst[q] = make_uint4(packed_out[4 * q], packed_out[4 * q + 1], packed_out[4 * q + 2], packed_out[4 * q + 3]);
    }
}

// Sorted positions [p0, p1) (grid (p1 - p0, ceil(inter / 256)), 256 threads): h [2 n_assign, 2 inter] f32 (gate | up, hi and lo rows) ->
// act [2 n_assign, inter] bf16 bits, hi/lo split of SiTU-GLU(gate, up).
extern "C" __global__ void moe_glu_split_bf16(const float* __restrict__ h, const int* __restrict__ offsets,
                                              int experts, int p0, int p1, int inter, float beta, float beta_lin,
                                              int has_lin, u16* __restrict__ act) {
    const int p = p0 + blockIdx.x;
    if (p >= p1) return;
    const int e = expert_of(offsets, experts, p);
    const int cnt = offsets[e + 1] - offsets[e];
    const i64 hr = offsets[e] + p, lr = hr + cnt;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < inter; c += gridDim.y * blockDim.x) {
        const float g = h[hr * 2 * inter + c] + h[lr * 2 * inter + c];
        const float u = h[hr * 2 * inter + inter + c] + h[lr * 2 * inter + inter + c];
        u16 hi, lo;
        split_bf16(situ_glu_one(g, u, beta, beta_lin, has_lin), hi, lo);
        act[hr * inter + c] = hi;
        act[lr * inter + c] = lo;
    }
}

#define MOE_MAX_TOP_K 64

// Grid T blocks, 256 threads. y [2 n_assign, latent] f32 (down GEMM, hi and lo rows); w [T, k];
// out [T, latent] = sum over slots j in order (deterministic) of w[t, j] (y_hi + y_lo).
extern "C" __global__ void moe_combine_split_f32(const float* __restrict__ y, const int* __restrict__ inv,
                                                 const int* __restrict__ offsets, int experts,
                                                 const float* __restrict__ w, float* __restrict__ out, int top_k,
                                                 int latent) {
    __shared__ i64 rows[2 * MOE_MAX_TOP_K];
    const int t = blockIdx.x;
    if (top_k > MOE_MAX_TOP_K) return;
    for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
        const int p = inv[t * top_k + j];
        const int e = expert_of(offsets, experts, p);
        rows[2 * j] = offsets[e] + p;
        rows[2 * j + 1] = offsets[e] + p + (offsets[e + 1] - offsets[e]);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < latent; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j)
            acc += w[t * top_k + j] * (y[rows[2 * j] * latent + c] + y[rows[2 * j + 1] * latent + c]);
        out[(i64)t * latent + c] = acc;
    }
}
