// Dense matmuls with bf16 weights (a bf16 checkpoint keeps half the bytes on the device): the f32
// activation rows are split into bf16 hi and lo rows (common.cuh split_bf16), one tensor-core
// GEMM (cuBLAS, f32 accumulate) computes both against the weights, and the halves are summed.
//   bf16_split_rows_f32   x [M, K] f32 -> xs [2M, K] bf16 bits: rows 0..M hi, M..2M lo
//   sum_row_halves_f32    c [2M, N] f32 -> y [M, N] = c[0..M] + c[M..2M]
//   bf16_to_f32           widen (f32 copies for ops without a bf16 kernel)
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
