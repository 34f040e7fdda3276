// Row-wise RMSNorm and the per-head gated RMSNorm of the KDA output path.
// All f32 in and out (the Backend's activations are f32); norms computed in f32 like the CPU.
#include "common.cuh"

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w. One block per row (any blockDim multiple of 32; the
// backend uses 512). Rows of 16-byte-aligned float4s are read as float4: at decode sizes (one to a
// few rows of 7168) a block streams its row alone, and the wider loads put 4x the bytes in flight
// per round trip.
// has_bf16: y's values rounded to bf16 (f32_to_bf16_bits, as bf16_split_rows_f32 rounds them) into
// y_bf16 too, the input a cuBLAS product takes in bfloat16 mode (DeviceMat::bf16).
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int rows, int cols, float eps,
                                        u16* __restrict__ y_bf16, int has_bf16) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (i64)r * cols;
    float* yr = y + (i64)r * cols;
    const bool vec = (cols & 3) == 0 && ((reinterpret_cast<size_t>(xr) | reinterpret_cast<size_t>(yr) |
                                          reinterpret_cast<size_t>(w)) & 15) == 0;
    float ss = 0.0f;
    if (vec) {
        for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(xr)[c];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)cols + eps);
    u16* br = y_bf16 + (i64)r * cols;
    if (vec) {
        for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(xr)[c], g = reinterpret_cast<const float4*>(w)[c];
            const float4 o = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
            reinterpret_cast<float4*>(yr)[c] = o;
            if (has_bf16) {
                br[4 * c] = f32_to_bf16_bits(o.x);
                br[4 * c + 1] = f32_to_bf16_bits(o.y);
                br[4 * c + 2] = f32_to_bf16_bits(o.z);
                br[4 * c + 3] = f32_to_bf16_bits(o.w);
            }
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            yr[c] = xr[c] * inv * w[c];
            if (has_bf16) br[c] = f32_to_bf16_bits(yr[c]);
        }
    }
}

// Per head of width head_dim: y = RMSNorm(o_h) * w * sigmoid(gate_h); w is shared by all heads.
// One warp per (row, head): head_dim is 128 in K3, so a warp covers it with 4 values per lane.
// Grid: ceil(rows*heads / warps_per_block) blocks. has_bf16: y rounded to bf16 into y_bf16 too, as
// rms_norm_f32 does (the input of the output projection's cuBLAS product in bfloat16 mode).
extern "C" __global__ void gated_head_norm_f32(const float* __restrict__ o, const float* __restrict__ gate,
                                               const float* __restrict__ w, float* __restrict__ y, int rows,
                                               int heads, int head_dim, float eps, u16* __restrict__ y_bf16,
                                               int has_bf16) {
    const int warps = blockDim.x / K3_WARP;
    const int item = blockIdx.x * warps + threadIdx.x / K3_WARP;
    const int lane = threadIdx.x & (K3_WARP - 1);
    if (item >= rows * heads) return;
    const i64 base = (i64)item * head_dim;  // rows are [heads*head_dim], so (row, head) is contiguous
    float ss = 0.0f;
    for (int c = lane; c < head_dim; c += K3_WARP) ss += o[base + c] * o[base + c];
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)head_dim + eps);
    for (int c = lane; c < head_dim; c += K3_WARP) {
        const float v = o[base + c] * inv * w[c] * k3_sigmoid(gate[base + c]);
        y[base + c] = v;
        if (has_bf16) y_bf16[base + c] = f32_to_bf16_bits(v);
    }
}
