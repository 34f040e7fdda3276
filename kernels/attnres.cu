// Block Attention Residuals (docs/k3-model.md §5), fused: per token, for each of n <= 9
// sources V_i, s_i = (V_i . w) * rsqrt(mean(V_i^2) + eps); alpha = softmax(s); out = sum alpha_i V_i.
// w is the product of the op's norm and proj weights. Sources are passed as 9 pointer
// parameters (unused ones null) so no pointer table has to be uploaded per call.
#include "common.cuh"

#define ATTNRES_MAX_SOURCES 9

// One block per token (any blockDim multiple of 32; the backend uses 512). Pass 1 reduces 2n values
// (dot with w, sum of squares) in one block reduction; pass 2 re-reads the sources (n*d*4 bytes,
// L2-resident at d = 7168) for the sum. Rows of 16-byte-aligned float4s are read as float4: at
// decode sizes one block streams a token's n sources alone, so the bytes in flight per round trip
// set its time.
extern "C" __global__ void attn_res_f32(const float* s0, const float* s1, const float* s2, const float* s3,
                                        const float* s4, const float* s5, const float* s6, const float* s7,
                                        const float* s8, int n, const float* __restrict__ w,
                                        float* __restrict__ out, int rows, int d, float eps) {
    __shared__ float part[ATTNRES_MAX_SOURCES * 2][32];
    __shared__ float alpha[ATTNRES_MAX_SOURCES];
    const int r = blockIdx.x;
    if (r >= rows || n < 1 || n > ATTNRES_MAX_SOURCES) return;
    const float* src[ATTNRES_MAX_SOURCES] = {s0, s1, s2, s3, s4, s5, s6, s7, s8};
    const i64 base = (i64)r * d;
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    const int nwarps = blockDim.x / K3_WARP;
    float dotw[ATTNRES_MAX_SOURCES], ss[ATTNRES_MAX_SOURCES];
#pragma unroll
    for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i) {
        dotw[i] = 0.0f;
        ss[i] = 0.0f;
    }
    bool vec = (d & 3) == 0 && ((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(out + base)) & 15) == 0;
#pragma unroll
    for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i)
        if (i < n) vec = vec && (reinterpret_cast<size_t>(src[i] + base) & 15) == 0;
    if (vec) {
        for (int c = threadIdx.x; c < d / 4; c += blockDim.x) {
            const float4 wc = reinterpret_cast<const float4*>(w)[c];
#pragma unroll
            for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i) {
                if (i < n) {
                    const float4 v = reinterpret_cast<const float4*>(src[i] + base)[c];
                    dotw[i] += v.x * wc.x + v.y * wc.y + v.z * wc.z + v.w * wc.w;
                    ss[i] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
            }
        }
    } else {
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            const float wc = w[c];
#pragma unroll
            for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i) {
                if (i < n) {
                    const float v = src[i][base + c];
                    dotw[i] += v * wc;
                    ss[i] += v * v;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i) {
        if (i < n) {
            const float a = warp_sum(dotw[i]), b = warp_sum(ss[i]);
            if (lane == 0) {
                part[2 * i][warp] = a;
                part[2 * i + 1][warp] = b;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float s[ATTNRES_MAX_SOURCES];
        float m = K3_NEG_INF;
        for (int i = 0; i < n; ++i) {
            float a = 0.0f, b = 0.0f;
            for (int k = 0; k < nwarps; ++k) {
                a += part[2 * i][k];
                b += part[2 * i + 1][k];
            }
            s[i] = a * rsqrtf(b / (float)d + eps);
            m = fmaxf(m, s[i]);
        }
        float z = 0.0f;
        for (int i = 0; i < n; ++i) {
            s[i] = expf(s[i] - m);
            z += s[i];
        }
        for (int i = 0; i < n; ++i) alpha[i] = s[i] / z;
    }
    __syncthreads();
    if (vec) {
        for (int c = threadIdx.x; c < d / 4; c += blockDim.x) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i)
                if (i < n) {
                    const float4 v = reinterpret_cast<const float4*>(src[i] + base)[c];
                    const float a = alpha[i];
                    acc.x += a * v.x, acc.y += a * v.y, acc.z += a * v.z, acc.w += a * v.w;
                }
            reinterpret_cast<float4*>(out + base)[c] = acc;
        }
    } else {
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i)
                if (i < n) acc += alpha[i] * src[i][base + c];
            out[base + c] = acc;
        }
    }
}
