// Dense matmuls with bf16 weights (a bf16 checkpoint keeps half the bytes on the device): the f32
// activation rows are split into bf16 hi and lo rows (common.cuh split_bf16), one tensor-core
// GEMM (cuBLAS, f32 accumulate) computes both against the weights, and the halves are summed.
//   bf16_split_rows_f32   x [M, K] f32 -> xs [2M, K] bf16 bits: rows 0..M hi, M..2M lo
//   sum_row_halves_f32    c [2M, N] f32 -> y [M, N] = c[0..M] + c[M..2M]
//   bf16_to_f32           widen (f32 copies for ops without a bf16 kernel)
//   gemv_bf16_f32         y = x w^T for a few rows of x (decode), f32 math, no split
#include "common.cuh"

extern "C" __global__ void bf16_split_rows_f32(const float* __restrict__ x, u16* __restrict__ xs, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        u16 hi, lo;
        split_bf16(x[i], hi, lo);
        xs[i] = hi;
        xs[n + i] = lo;
    }
}

extern "C" __global__ void sum_row_halves_f32(const float* __restrict__ c, float* __restrict__ y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = c[i] + c[n + i];
}

// bf16 bits -> f32 (the f32 copy of a bf16 weight for ops with only an f32 kernel).
extern "C" __global__ void bf16_to_f32(const u16* __restrict__ b, float* __restrict__ out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = bf16_bits_to_f32(b[i]);
}

// Decode-sized products with bf16 weights: y [M, N] = x [M, K] . w [N, K]^T for M <= GEMV_MAX_M,
// reading each weight row once (the step is bound by weight bytes) with f32 products and sums,
// so the result tracks an f32 matmul of the same values to ~1e-6. One warp per output column;
// lane l takes the 8-value words l + 32 i. Grid ceil(N / 8), 256 threads; K % 8 == 0.
#define GEMV_MAX_M 8
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32(const float* __restrict__ x, const u16* __restrict__ w,
                                                               float* __restrict__ y, int M, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (n >= N || M > GEMV_MAX_M) return;
    const uint4* row = reinterpret_cast<const uint4*>(w + (i64)n * K);
    const int words = K / 8;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; ++m) acc[m] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < words; i += 32) {
        const uint4 q = row[i];
        const float wv[8] = {__uint_as_float(q.x << 16), __uint_as_float(q.x & 0xffff0000u),
                             __uint_as_float(q.y << 16), __uint_as_float(q.y & 0xffff0000u),
                             __uint_as_float(q.z << 16), __uint_as_float(q.z & 0xffff0000u),
                             __uint_as_float(q.w << 16), __uint_as_float(q.w & 0xffff0000u)};
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; ++m) {
            if (m < M) {
                const float4* xr = reinterpret_cast<const float4*>(x + (i64)m * K + (i64)i * 8);
                const float4 a = xr[0], b = xr[1];
                acc[m] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y +
                          wv[6] * b.z + wv[7] * b.w;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; ++m) {
        const float v = warp_sum(acc[m]);
        if (lane == 0 && m < M) y[(i64)m * N + n] = v;
    }
}
