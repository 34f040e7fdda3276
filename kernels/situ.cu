// SiTU-GLU (docs/k3-model.md §6, SiTU-GLU): beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin), f32.
#include "common.cuh"  // situ_glu_one

// out = SiTU-GLU(gate, up), n elements; has_lin = 0 skips the soft cap on `up`. has_bf16: out
// rounded to bf16 into out_bf16 too (f32_to_bf16_bits, as bf16_split_rows_f32 rounds it), the
// input of the down-projection's cuBLAS product in bfloat16 mode (DeviceMat::bf16).
extern "C" __global__ void situ_glu_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, i64 n, float beta, float beta_lin, int has_lin,
                                        u16* __restrict__ out_bf16, int has_bf16) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = situ_glu_one(gate[i], up[i], beta, beta_lin, has_lin);
        out[i] = v;
        if (has_bf16) out_bf16[i] = f32_to_bf16_bits(v);
    }
}

// Fused variant for a `[rows, 2*inter]` gate|up matrix (one GEMM produced both halves).
extern "C" __global__ void situ_glu_packed_f32(const float* __restrict__ gu, float* __restrict__ out, int rows,
                                               int inter, float beta, float beta_lin, int has_lin) {
    const i64 n = (i64)rows * inter;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / inter, c = i % inter;
        out[i] = situ_glu_one(gu[r * 2 * inter + c], gu[r * 2 * inter + inter + c], beta, beta_lin, has_lin);
    }
}
