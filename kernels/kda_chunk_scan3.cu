// KDA chunk scan v3: the state in registers (k3-architecture.md §1.5; records of kda_chunk_rec3_f32,
// kernels/kda_chunk_scan.cu, which documents the per-chunk algebra and the record regions).
//
// Per chunk, transposed so the state never leaves the mma accumulators:
//     X^T = U^T - S^T W^T,   O^T = S^T Qp^T + X^T Aqk^T,   S^T <- S^T diag(e) + X^T Kd
// Warp = 16 state columns x all 128 keys: S^T [16 cols x 128 keys] is 16 m16n8 accumulators (64
// registers). An accumulator holds (col g, key 2t | 2t + 1) and the A operand of the next product wants
// (col g, k = t | t + 4): the same registers once k = t <-> key 2t, k = t + 4 <-> key 2t + 1 inside each
// 8-key step, so the record stores W^T / Qp^T with that key order (and Kd / Aqk^T with the same order
// over tokens, which X^T's accumulators hand over the same way). No shared-memory state, no
// cross-warp reduction (a warp has every key), no state address math.
// Block = NW warps (16 NW columns): the chunk record (W, Qp, Kd, Aqk, e and the block's U^T) is
// staged in shared memory by cp.async, once per block, while the previous chunk's S update runs.
//
// 3xTF32 with a 3-instruction split (hi = x truncated to tf32, lo = x - hi exactly, then truncated):
// per product error < 2^-19 relative (lo's truncation and the dropped lo*lo, each < 2^-20), i.e.
// f32-grade against the 1e-4 budget, where 1xTF32 measured ~7e-4; the split is ~half the scan's
// instructions (272 values per warp and chunk), so v2's rounded split (4 instructions) is not kept.
// Neither product can drop to 1xTF32: O and the state recurrence both need the 3 terms.
//
// Record v3, per (chunk, head), float4 f (lane = 4g + t):
//   W, Qp  f = s*32 + lane: {M[g][k], M[g][k+1], M[g+8][k], M[g+8][k+1]}, k = 8s + 2t
//   Kd     f = (s2*8 + p)*32 + lane: {Kd[j][d], Kd[j+1][d], Kd[j][d+8], Kd[j+1][d+8]}, j = 8s2 + 2t, d = 16p + g
//   U      f = (mc*2 + nt)*32 + lane: {U[i][c], U[i+1][c], U[i][c+8], U[i+1][c+8]}, i = 8nt + 2t, c = 16mc + g
//   Aqk    f = s2*32 + lane: {A[g][j], A[g][j+1], A[g+8][j], A[g+8][j+1]}, j = 8s2 + 2t
//   e      float t*32 + 2n + r: e[8n + 2t + r]
#include "kda.cuh"

#define KDA_REC 8576
#define REC_W 0
#define REC_Q 2048
#define REC_KD 4096
#define REC_U 6144
#define REC_A 8192
#define REC_E 8448
#define RC 16
#define RLOG2E 1.4426950408889634f

// hi = x truncated to tf32, lo = x - hi (exact in f32) truncated to tf32.
__device__ __forceinline__ void s3_split(float x, u32& hi, u32& lo) {
    hi = __float_as_uint(x) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}

__device__ __forceinline__ void s3_mma1(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b, 3xTF32 (small terms first); a split, b = {b0, b1} as floats.
__device__ __forceinline__ void s3_mma(float* c, const u32* ah, const u32* al, float b0, float b1) {
    u32 h0, l0, h1, l1;
    s3_split(b0, h0, l0);
    s3_split(b1, h1, l1);
    s3_mma1(c, al, h0, h1);
    s3_mma1(c, ah, l0, l1);
    s3_mma1(c, ah, h0, h1);
}

// An accumulator {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)} as an A operand in the permuted k order.
__device__ __forceinline__ void s3_afrag(const float* c, u32* ah, u32* al) {
    s3_split(c[0], ah[0], al[0]);
    s3_split(c[2], ah[1], al[1]);
    s3_split(c[1], ah[2], al[2]);
    s3_split(c[3], ah[3], al[3]);
}

__device__ __forceinline__ void s3_cp16(float* dst, const float* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}

template <int NW>
struct Scan3Smem {
    __align__(16) float wq[2][2048];     // W, Qp (read by the first products only: one buffer)
    __align__(16) float kd[2][2048];     // Kd, double-buffered with the rest
    __align__(16) float u[2][NW * 256];  // U^T of the block's column tiles
    __align__(16) float a[2][256];       // Aqk^T
    __align__(16) float e[2][128];
    float gm[NW][2][KDA_K];              // checkpoint decays, per warp
};

template <int NW>
__device__ __forceinline__ void kda_scan3_impl(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                                               const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off,
                                               int n_ckpt, float* __restrict__ o_out, const float* __restrict__ f_in,
                                               const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                               float lower_bound, int t_begin, int t_end, int heads, int conv) {
    __shared__ Scan3Smem<NW> sm;
    const int h = blockIdx.y, tid = threadIdx.x;
    if (h >= heads || blockIdx.x * NW * 16 >= KDA_V) return;  // block-uniform
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mc = blockIdx.x * NW + warp, col0 = 16 * mc;  // the warp's 16 columns
    const int hk = heads * KDA_K;
    const i64 s_base = kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    float* S = arena + state_off + s_base;
    const int nchunks = (t_end - t_begin + RC - 1) / RC;

    // One chunk's record into the stage buffers: W, Qp to the single buffer, the rest to buffer b.
    // Unrolled with one base per region: the copies' addresses are immediate offsets.
    constexpr int NT = NW * 32;
    auto stage = [&](int c, int b) {
        const float* R = rec + ((i64)c * heads + h) * KDA_REC + 4 * tid;
#pragma unroll
        for (int i = 0; i < 1024 / NT; ++i) s3_cp16(&sm.wq[0][4 * tid] + 4 * NT * i, R + REC_W + 4 * NT * i);
#pragma unroll
        for (int i = 0; i < 512 / NT; ++i) s3_cp16(&sm.kd[b][4 * tid] + 4 * NT * i, R + REC_KD + 4 * NT * i);
#pragma unroll
        for (int i = 0; i < 2; ++i)
            s3_cp16(&sm.u[b][4 * tid] + 4 * NT * i, R + REC_U + blockIdx.x * NW * 256 + 4 * NT * i);
        if (tid < 64) s3_cp16(&sm.a[b][4 * tid], R + REC_A);
        if (tid < 32) s3_cp16(&sm.e[b][4 * tid], R + REC_E);
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (nchunks > 0) stage(0, 0);

    // st[n][r]: S[8n + 2t + (r & 1)][col0 + g + 8 (r >> 1)] (S^T accumulator n-tile n).
    float st[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) st[n][r] = S[(i64)(8 * n + 2 * t + (r & 1)) * KDA_V + col0 + g + 8 * (r >> 1)];
    int next_ck = 0;
    while (next_ck < n_ckpt && ckpt_n[next_ck] <= t_begin) ++next_ck;

    for (int c = 0; c < nchunks; ++c) {
        const int c0 = t_begin + c * RC, cl = min(RC, t_end - c0), b = c & 1;
        asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads();  // chunk c staged by every thread
        // a) S^T W^T and S^T Qp^T over the 16 key steps; two partial sets halve the mma chains.
        float P[2][2][4] = {}, Q[2][2][4] = {};
        const float4* W4 = reinterpret_cast<const float4*>(sm.wq[0]);
        const float4* Q4 = reinterpret_cast<const float4*>(sm.wq[1]);
#pragma unroll
        for (int s = 0; s < 16; ++s) {
            u32 ah[4], al[4];
            s3_afrag(st[s], ah, al);
            const float4 w = W4[s * 32 + lane], q = Q4[s * 32 + lane];
            s3_mma(P[s & 1][0], ah, al, w.x, w.y);
            s3_mma(P[s & 1][1], ah, al, w.z, w.w);
            s3_mma(Q[s & 1][0], ah, al, q.x, q.y);
            s3_mma(Q[s & 1][1], ah, al, q.z, q.w);
        }
        __syncthreads();  // W, Qp read by all warps: the next chunk may land
        if (c + 1 < nchunks) stage(c + 1, b ^ 1);
        // b) X^T = U^T - S^T W^T (accumulator n-tile = tokens 8nt..), then A fragments (k = tokens).
        u32 xh[2][4], xl[2][4];
        float xa[2][4], oa[2][4];
        const float4* U4 = reinterpret_cast<const float4*>(sm.u[b]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const float4 u = U4[(warp * 2 + nt) * 32 + lane];
            const float uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                xa[nt][r] = uv[r] - (P[0][nt][r] + P[1][nt][r]);
                oa[nt][r] = Q[0][nt][r] + Q[1][nt][r];
            }
            s3_afrag(xa[nt], xh[nt], xl[nt]);
        }
        // c) O^T += X^T Aqk^T; O[token][col] stores (8 lanes of a token row: one 32 B sector).
        const float4* A4 = reinterpret_cast<const float4*>(sm.a[b]);
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) {
            const float4 a = A4[s2 * 32 + lane];
            s3_mma(oa[0], xh[s2], xl[s2], a.x, a.y);
            s3_mma(oa[1], xh[s2], xl[s2], a.z, a.w);
        }
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 8 * ni + 2 * t + (r & 1);
                if (i < cl) o_out[(i64)(c0 + i) * hk + h * KDA_V + col0 + g + 8 * (r >> 1)] = oa[ni][r];
            }
        const float4* K4 = reinterpret_cast<const float4*>(sm.kd[b]);
        // d) Checkpoints inside the chunk (rare): S_m^T = S^T diag(2^G_{m-1}) + X^T[:, j < m] (Kd 2^(G_{m-1} - G_C)),
        //    G recomputed from f as the record pass summed it (v2 gate).
        while (next_ck < n_ckpt && ckpt_n[next_ck] <= c0 + cl) {
            const int m = ckpt_n[next_ck] - c0;
            float* gdst = arena + ckpt_off[next_ck] + s_base;
            const float ae = expf(a_log[h]);
            for (int d = lane; d < KDA_K; d += 32) {
                float acc = 0.0f, gmv = 0.0f;
                for (int i = 0; i < cl; ++i) {
                    const float z = -ae * (f_in[(i64)(c0 + i) * hk + h * KDA_K + d] + dt_bias[h * KDA_K + d]);
                    acc += lower_bound * __fdividef(1.0f, 1.0f + __expf(z)) * RLOG2E;
                    if (i == m - 1) gmv = acc;
                }
                sm.gm[warp][0][d] = exp2f(gmv);
                sm.gm[warp][1][d] = exp2f(gmv - acc);
            }
            __syncwarp();
            u32 mh[2][4], ml[2][4];
#pragma unroll
            for (int s2 = 0; s2 < 2; ++s2) {  // X^T columns (tokens) j >= m cleared
                const int j = 8 * s2 + 2 * t;
                const float xm[4] = {j < m ? xa[s2][0] : 0.0f, j + 1 < m ? xa[s2][1] : 0.0f,
                                     j < m ? xa[s2][2] : 0.0f, j + 1 < m ? xa[s2][3] : 0.0f};
                s3_afrag(xm, mh[s2], ml[s2]);
            }
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                float cc[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) cc[r] = st[n][r] * sm.gm[warp][0][8 * n + 2 * t + (r & 1)];
                const float sc = sm.gm[warp][1][8 * n + g];
#pragma unroll
                for (int s2 = 0; s2 < 2; ++s2) {
                    const float4 k = K4[(s2 * 8 + (n >> 1)) * 32 + lane];
                    s3_mma(cc, mh[s2], ml[s2], ((n & 1) ? k.z : k.x) * sc, ((n & 1) ? k.w : k.y) * sc);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    gdst[(i64)(8 * n + 2 * t + (r & 1)) * KDA_V + col0 + g + 8 * (r >> 1)] = cc[r];
            }
            __syncwarp();
            ++next_ck;
        }
        // e) S^T <- S^T diag(e) + X^T Kd: 16 independent accumulators.
        const float2* E2 = reinterpret_cast<const float2*>(sm.e[b]);
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            const float4 k0 = K4[p * 32 + lane], k1 = K4[(8 + p) * 32 + lane];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int n = 2 * p + hf;
                const float2 e = E2[t * 16 + n];
                st[n][0] *= e.x;
                st[n][1] *= e.y;
                st[n][2] *= e.x;
                st[n][3] *= e.y;
                s3_mma(st[n], xh[0], xl[0], hf ? k0.z : k0.x, hf ? k0.w : k0.y);
                s3_mma(st[n], xh[1], xl[1], hf ? k1.z : k1.x, hf ? k1.w : k1.y);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) S[(i64)(8 * n + 2 * t + (r & 1)) * KDA_V + col0 + g + 8 * (r >> 1)] = st[n][r];
}

#define KDA_SCAN3_ARGS                                                                                   \
    rec, arena, state_off, ckpt_n, ckpt_off, n_ckpt, o_out, f_in, a_log, dt_bias, lower_bound, t_begin, t_end, heads, \
        conv

// Grid (V / 32, heads), 64 threads: 384 blocks at H = 96, ~3 per SM in one wave.
extern "C" __global__ void __launch_bounds__(64)
kda_chunk_scan3_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                    const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                    float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                    const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads, int conv) {
    kda_scan3_impl<2>(KDA_SCAN3_ARGS);
}
// Grid (V / 64, heads), 128 threads: half the record traffic from L2, coarser SM balance.
extern "C" __global__ void __launch_bounds__(128)
kda_chunk_scan3_w4_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                       const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                       float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                       const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads,
                       int conv) {
    kda_scan3_impl<4>(KDA_SCAN3_ARGS);
}
#undef KDA_SCAN3_ARGS
