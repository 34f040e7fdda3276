// Block Attention Residuals (docs/k3-model.md §5), fused with what surrounds it in a layer: per
// token, last += add (has_add), then over the n = n_bank + 1 <= 9 sources V_i (the bank's s0.. and
// `last`) s_i = (V_i . w) * rsqrt(mean(V_i^2) + eps); alpha = softmax(s); h = sum alpha_i V_i; out =
// h, or RMSNorm(h) * norm (has_norm: what opens every sublayer, Backend::attn_res_norm). w is the
// product of the op's norm and proj weights. Bank sources are 8 pointer parameters (unused ones
// any valid pointer) so no pointer table has to be uploaded per call; `add` and `norm` are read
// only when their flag is set. has_bf16: the output's values rounded to bf16 (f32_to_bf16_bits, as
// bf16_split_rows_f32 rounds them) into out_bf16 too, the input a cuBLAS product takes in
// bfloat16 mode (DeviceMat::bf16).
#include "common.cuh"

#define ATTNRES_MAX_SOURCES 9
// Blocks per token (one thread-block cluster) and threads per block (geometry.rs attn_res).
#define ATTNRES_SPLIT 8
#define ATTNRES_THREADS 128

__device__ __forceinline__ u32 attnres_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Four values as bf16 bits at `dst` (8-byte aligned when the f32 row is 16-byte aligned).
__device__ __forceinline__ void attnres_store_bf16x4(u16* dst, float4 v) {
    const u32 lo = (u32)f32_to_bf16_bits(v.x) | ((u32)f32_to_bf16_bits(v.y) << 16);
    const u32 hi = (u32)f32_to_bf16_bits(v.z) | ((u32)f32_to_bf16_bits(v.w) << 16);
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

// float `p` (in this block's shared memory) of cluster block `rank`.
__device__ __forceinline__ float attnres_peer(const float* p, u32 rank) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    u32 ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
    return v;
}

// Grid rows x ATTNRES_SPLIT, ATTNRES_THREADS threads: a cluster of ATTNRES_SPLIT blocks per token,
// block q taking columns [q c, (q + 1) c) for c = d / ATTNRES_SPLIT rounded up to 4. Pass 1 adds
// `add` into the block's columns of `last`, and reduces its 2n partials (dot with w, sum of
// squares); the cluster barrier publishes them and every block adds all ATTNRES_SPLIT partials in
// rank order (the same alpha everywhere); pass 2 re-reads the block's columns (L1 / L2-resident)
// for the sum, writes h and, with has_norm, reduces its sum of squares, which a second barrier
// publishes; pass 3 scales the block's h in place. A thread reads back only the columns it wrote,
// so the passes need no barrier of their own. At decode sizes a token's n sources are streamed by
// 8 SMs instead of one, whose few bytes in flight per round trip set the time.
extern "C" __global__ void __cluster_dims__(ATTNRES_SPLIT, 1, 1) __launch_bounds__(ATTNRES_THREADS)
    attn_res_f32(const float* s0, const float* s1, const float* s2, const float* s3, const float* s4, const float* s5,
                 const float* s6, const float* s7, int n_bank, float* last, const float* add, int has_add,
                 const float* __restrict__ w, const float* norm, int has_norm, float* __restrict__ out, int rows,
                 int d, float eps, u16* __restrict__ out_bf16, int has_bf16) {
    __shared__ float part[ATTNRES_MAX_SOURCES * 2][ATTNRES_THREADS / 32];
    __shared__ float mine[ATTNRES_MAX_SOURCES * 2];
    __shared__ float total[ATTNRES_MAX_SOURCES * 2];
    __shared__ float alpha[ATTNRES_MAX_SOURCES];
    __shared__ float hss_part[ATTNRES_THREADS / 32];
    __shared__ float hss_mine, hss_total;
    const int r = blockIdx.x / ATTNRES_SPLIT;
    const int n = n_bank + 1;
    // Uniform over a cluster (the grid is rows x ATTNRES_SPLIT): no block leaves its peers waiting.
    if (r >= rows || n_bank < 0 || n > ATTNRES_MAX_SOURCES) return;
    const u32 rank = attnres_cluster_rank();
    const int span = ((d + 4 * ATTNRES_SPLIT - 1) / (4 * ATTNRES_SPLIT)) * 4;
    const int c0 = min(d, (int)rank * span), c1 = min(d, c0 + span);
    const i64 base = (i64)r * d;
    // Source i: bank source i below n_bank, then `last` (constant indices once unrolled).
    const float* bank[ATTNRES_MAX_SOURCES - 1] = {s0, s1, s2, s3, s4, s5, s6, s7};
    const float* src[ATTNRES_MAX_SOURCES];
#pragma unroll
    for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i) src[i] = i < ATTNRES_MAX_SOURCES - 1 && i < n_bank ? bank[i] : last;
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    float dotw[ATTNRES_MAX_SOURCES], ss[ATTNRES_MAX_SOURCES];
#pragma unroll
    for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i) {
        dotw[i] = 0.0f;
        ss[i] = 0.0f;
    }
    // Rows of 16-byte-aligned float4s are read as float4 (c0 is a multiple of 4).
    bool vec = (d & 3) == 0 && ((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(out + base) |
                                 reinterpret_cast<size_t>(last + base)) & 15) == 0;
    if (has_add) vec = vec && (reinterpret_cast<size_t>(add + base) & 15) == 0;
    if (has_norm) vec = vec && (reinterpret_cast<size_t>(norm) & 15) == 0;
#pragma unroll
    for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i)
        if (i < n_bank) vec = vec && (reinterpret_cast<size_t>(src[i] + base) & 15) == 0;
    if (vec) {
        for (int c = c0 / 4 + threadIdx.x; c < c1 / 4; c += blockDim.x) {
            const float4 wc = reinterpret_cast<const float4*>(w)[c];
            float4* lp = reinterpret_cast<float4*>(last + base) + c;
            if (has_add) {
                const float4 a = reinterpret_cast<const float4*>(add + base)[c];
                float4 v = *lp;
                v.x += a.x, v.y += a.y, v.z += a.z, v.w += a.w;
                *lp = v;
            }
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
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            const float wc = w[c];
            if (has_add) last[base + c] += add[base + c];
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
    if (threadIdx.x < 2 * n) {
        float a = 0.0f;
#pragma unroll
        for (int k = 0; k < ATTNRES_THREADS / 32; ++k) a += part[threadIdx.x][k];
        mine[threadIdx.x] = a;
    }
    // Publish `mine` to the cluster (release / acquire), then read every block's.
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (threadIdx.x < 2 * n) {
        float a = 0.0f;
        for (u32 q = 0; q < ATTNRES_SPLIT; ++q) a += attnres_peer(&mine[threadIdx.x], q);
        total[threadIdx.x] = a;
    }
    // Without the norm this block is done reading its peers; it waits for theirs before it exits
    // (below). With it, the second barrier (after pass 2) says the same.
    if (!has_norm) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        float s[ATTNRES_MAX_SOURCES];
        float m = K3_NEG_INF;
        for (int i = 0; i < n; ++i) {
            s[i] = total[2 * i] * rsqrtf(total[2 * i + 1] / (float)d + eps);
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
    float hss = 0.0f;
    if (vec) {
        for (int c = c0 / 4 + threadIdx.x; c < c1 / 4; c += blockDim.x) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i)
                if (i < n) {
                    const float4 v = reinterpret_cast<const float4*>(src[i] + base)[c];
                    const float a = alpha[i];
                    acc.x += a * v.x, acc.y += a * v.y, acc.z += a * v.z, acc.w += a * v.w;
                }
            hss += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
            reinterpret_cast<float4*>(out + base)[c] = acc;
            if (has_bf16 && !has_norm) attnres_store_bf16x4(out_bf16 + base + 4 * c, acc);
        }
    } else {
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < ATTNRES_MAX_SOURCES; ++i)
                if (i < n) acc += alpha[i] * src[i][base + c];
            hss += acc * acc;
            out[base + c] = acc;
            if (has_bf16 && !has_norm) out_bf16[base + c] = f32_to_bf16_bits(acc);
        }
    }
    if (has_norm) {
        hss = warp_sum(hss);
        if (lane == 0) hss_part[warp] = hss;
        __syncthreads();
        if (threadIdx.x == 0) {
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < ATTNRES_THREADS / 32; ++k) a += hss_part[k];
            hss_mine = a;
        }
        // Peers are done reading `mine` and see this block's `hss_mine` after this barrier.
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
        if (threadIdx.x == 0) {
            float a = 0.0f;
            for (u32 q = 0; q < ATTNRES_SPLIT; ++q) a += attnres_peer(&hss_mine, q);
            hss_total = a;
        }
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
        __syncthreads();
        const float inv = rsqrtf(hss_total / (float)d + eps);
        if (vec) {
            for (int c = c0 / 4 + threadIdx.x; c < c1 / 4; c += blockDim.x) {
                float4* o = reinterpret_cast<float4*>(out + base) + c;
                const float4 g = reinterpret_cast<const float4*>(norm)[c];
                const float4 h = *o;
                *o = make_float4(h.x * inv * g.x, h.y * inv * g.y, h.z * inv * g.z, h.w * inv * g.w);
                if (has_bf16) attnres_store_bf16x4(out_bf16 + base + 4 * c, *o);
            }
        } else {
            for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
                out[base + c] = out[base + c] * inv * norm[c];
                if (has_bf16) out_bf16[base + c] = f32_to_bf16_bits(out[base + c]);
            }
        }
    }
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
