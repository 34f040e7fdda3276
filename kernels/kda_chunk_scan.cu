// KDA chunked prefill in two passes (k3-architecture.md §1.5): the default path for conv <= 4.
//
//   kda_chunk_rec_f32    fully parallel, one 128-thread block per (16-token chunk, head): conv +
//                        SiLU, L2 norms, gate, beta, and every state-independent piece of the chunk
//                        algebra in plain f32 (decays, Lkk, Aqk, the (I + Lkk) solve), written as one
//                        "chunk record" per (chunk, head) in the mma fragment order the scan loads.
//   kda_chunk_scan_f32   the only sequential part, grid (V / 32, heads): per chunk
//                            X = U - W S,   O = Qp S + Aqk X,   S <- diag(e) S + Kd^T X
//                        in 3xTF32 (kda_chunk_scan_fast_f32: 1xTF32).
//   *2_f32               the same math, cheaper instructions (v2, the default): the tf32 rounding as an
//                        integer add + mask (ptxas expands cvt.rna.tf32.f32 to 4 instructions with an
//                        Inf/NaN guard: 9 per 3xTF32 split, ~55% of the scan loop; now 5, bit-identical
//                        for finite values), SiLU and gate without the IEEE-division slow path, and the
//                        record pass at 4 blocks / SM. The v1 kernels stay for one A/B run.
//   kda_chunk_rec3_f32   v2 math, records in the v3 layout of kernels/kda_chunk_scan3.cu (state in
//                        mma registers); kda_chunk_rec3m_f32 the same over 8 chunks per block, the
//                        next chunk's loads in flight during this one's algebra.
//
// Why: kda_chunk_tc_f32 keeps the decays, Lkk/Aqk and a 16-row forward substitution inside the
// sequential loop; its per-chunk latency, not its math, set the time. Here the loop is three
// small mma products and one barrier per chunk, and the record pass replaces conv + prep at the
// same DRAM bytes (reads raw q, k, v, f; writes 4 tiles per chunk instead of q, k, v, g).
//
// With Tm = (I + Lkk)^-1 diag(beta): W = Tm Kp, U = Tm V, so the delta-rule corrections are
// Vt = Tm (V - Kp S) = U - W S (linear in S). Kp = k 2^G, Qp = q 2^G, Kd = k 2^(G_C - G), e = 2^G_C
// (G: in-chunk cumulative gate in log2 units, G_C its last row); padded rows are all zero.
//
// Record of chunk c, head h: rec + (c * heads + h) * KDA_REC floats (c counted from t_begin / 16):
//   REC_W, REC_Q  W, Qp as mma A operands [16 tokens x 128 keys]: warp w's keys 32w..32w+31, k-step
//                 s, lane (g = lane/4, t = lane%4): ((w*32 + lane)*4 + s)*4 + r holds
//                 {M[g][k0+t], M[g+8][k0+t], M[g][k0+t+4], M[g+8][k0+t+4]}[r], k0 = 32w + 8s.
//   REC_KD        Kd^T as A operand [keys x tokens]: ((w*32 + lane)*4 + 2*mt + s)*4 + r holds
//                 {Kd[j][d0+g], Kd[j][d0+g+8], Kd[j+4][d0+g], Kd[j+4][d0+g+8]}[r], j = 8s + t,
//                 d0 = 32w + 16mt.
//   REC_U         U as B operand per 32-column slice vt: (vt*32 + lane)*16 + (s*4 + nt)*2 + r holds
//                 U[8s + t + 4r][32vt + 8nt + g].
//   REC_A         Aqk (j <= i) as A operand: (lane*2 + s)*4 + r, same pattern as W with k0 = 8s.
//   REC_E         e[d], d < 128.
// Segments: the host runs rec + scan on token ranges [t_begin, t_end) (t_begin a multiple of 16),
// the state and conv windows carried in the arena between them, so the record buffer stays bounded.
#include "kda.cuh"

#define KDA_REC 8576
#define REC_W 0
#define REC_Q 2048
#define REC_KD 4096
#define REC_U 6144
#define REC_A 8192
#define REC_E 8448
#define RC 16                // chunk length
#define RKP (KDA_K + 4)      // smem row stride: float4 rows, conflict-free 8-row phases
#define RLOG2E 1.4426950408889634f

// ---------------------------------------------------------------------------------------------
// Record pass. Thread d = key/value channel d of head h for all 16 rows: the conv runs along the
// thread's own registers; only the norms (butterfly + 4-warp smem sum) and Lkk/Aqk cross threads.

// One butterfly stage over v[0 .. 2S): afterwards v[i < S] holds the sum over lane pairs (l, l ^ S)
// of original entry i + (lane & S); five stages leave lane l with entry l summed over the warp.
template <int S>
__device__ __forceinline__ void rec_fold(float* v, int lane) {
    const bool upper = lane & S;
#pragma unroll
    for (int i = 0; i < S; ++i) {
        const float send = upper ? v[i] : v[i + S];
        const float keep = upper ? v[i + S] : v[i];
        v[i] = keep + __shfl_xor_sync(K3_FULL_MASK, send, S);
    }
}

// Shared memory of the record pass, declared once in the entry (not per conv instantiation).
struct RecSmem {
    __align__(16) float kp[RC][RKP];  // k 2^G, then W
    __align__(16) float kn[RC][RKP];  // k 2^-G, then Kd
    __align__(16) float qp[RC][RKP];  // q 2^G
    __align__(16) float vv[RC][RKP];  // v, then U
    float lm[RC][RC + 1], am[RC][RC + 1], red[4][32], nrm[32], bs[RC];
};

// v1: k3_silu / kda_gate (IEEE division: rcp + a slow-path branch each). v2: __fdividef (2 ulp; the
// limits at +-inf are still right: a denominator past 2^126 gives 0).
template <bool V2>
__device__ __forceinline__ float rec_silu(float x) {
    return V2 ? __fdividef(x, 1.0f + __expf(-x)) : k3_silu(x);
}
template <bool V2>
__device__ __forceinline__ float rec_gate(float f, float dt_bias, float a_exp, float lower_bound) {
    return V2 ? lower_bound * __fdividef(1.0f, 1.0f + __expf(-a_exp * (f + dt_bias)))
              : kda_gate(f, dt_bias, a_exp, lower_bound);
}

// v3 record layout (kernels/kda_chunk_scan3.cu): the same regions, B-operand / accumulator order of
// the register-state scan; written from the same smem tiles as the v1 layout.
__device__ __forceinline__ void kda_rec_store3(RecSmem& sm, float* __restrict__ R, int tid) {
    float4* R4 = reinterpret_cast<float4*>(R);
    const int ln = tid & 31, g = ln >> 2, t = ln & 3;
#pragma unroll
    for (int e = tid; e < 512; e += 128) {
        const int s = e >> 5, k = 8 * s + 2 * t;  // W, Qp: k-step s (keys 8s + 2t, +1), tokens g, g + 8
        R4[(REC_W >> 2) + e] = make_float4(sm.kp[g][k], sm.kp[g][k + 1], sm.kp[g + 8][k], sm.kp[g + 8][k + 1]);
        R4[(REC_Q >> 2) + e] = make_float4(sm.qp[g][k], sm.qp[g][k + 1], sm.qp[g + 8][k], sm.qp[g + 8][k + 1]);
        const int s2 = e >> 8, p = (e >> 5) & 7, j = 8 * s2 + 2 * t, d = 16 * p + g;  // Kd: tokens j, j + 1
        R4[(REC_KD >> 2) + e] = make_float4(sm.kn[j][d], sm.kn[j + 1][d], sm.kn[j][d + 8], sm.kn[j + 1][d + 8]);
        const int mc = e >> 6, nt = (e >> 5) & 1, i = 8 * nt + 2 * t, col = 16 * mc + g;  // U^T accumulators
        R4[(REC_U >> 2) + e] = make_float4(sm.vv[i][col], sm.vv[i + 1][col], sm.vv[i][col + 8], sm.vv[i + 1][col + 8]);
    }
    if (tid < 64) {
        const int s2 = tid >> 5, j = 8 * s2 + 2 * t;  // Aqk^T: k = tokens j, j + 1; n = rows g, g + 8
        R4[(REC_A >> 2) + tid] = make_float4(sm.am[g][j], sm.am[g][j + 1], sm.am[g + 8][j], sm.am[g + 8][j + 1]);
    }
}

// NCH > 1 (rec3m): a block runs NCH consecutive chunks of one head, the conv history carried in
// registers and the next chunk's raw loads issued into the input registers as soon as step 3 has
// staged the current one (Kd then comes from the staged k 2^-G), so DRAM overlaps steps 4-6.
template <int C, bool V2, bool R3, int NCH = 1>
__device__ __forceinline__ void kda_rec_impl(
    RecSmem& sm, const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
    const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt, int t_begin, int t_end,
    int heads, float lower_bound) {
    float(*kp)[RKP] = sm.kp;
    float(*kn)[RKP] = sm.kn;
    float(*qp)[RKP] = sm.qp;
    float(*vv)[RKP] = sm.vv;
    float(*lm)[RC + 1] = sm.lm;
    float(*am)[RC + 1] = sm.am;
    float(*red)[32] = sm.red;
    float* nrm = sm.nrm;
    float* bs = sm.bs;
    constexpr int H1 = C > 1 ? C - 1 : 1;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = blockIdx.y;
    const int cb = t_begin + blockIdx.x * (NCH * RC);  // the block's first chunk
    if (h >= heads || cb >= t_end) return;  // block-uniform, before any barrier
    const int hk = heads * KDA_K, ch = h * KDA_K + tid;
    const i64 wf = kda_window_floats(hk, C);
    auto ins = [&](int r) { return r == 0 ? q_in : r == 1 ? k_in : v_in; };  // r is unrolled: no stack array
    auto cws = [&](int r) { return r == 0 ? conv_q : r == 1 ? conv_k : conv_v; };

    // All loads first (64 independent per thread: the pass is DRAM-bound).
    float x[3][RC], fv[RC], bv = 0.0f;
    auto load_chunk = [&](int c0) {
        const int cl = min(RC, t_end - c0);
#pragma unroll
        for (int i = 0; i < RC; ++i) {
            const i64 o = (i64)(c0 + i) * hk + ch;
            const bool in = i < cl;
#pragma unroll
            for (int r = 0; r < 3; ++r) x[r][i] = in ? ins(r)[o] : 0.0f;
            fv[i] = in ? f_in[o] : 0.0f;
        }
        if (tid < RC) bv = tid < cl ? k3_sigmoid(b_in[(i64)(c0 + tid) * heads + h]) : 0.0f;
    };
    load_chunk(cb);
    float w[3][C], hist[3][H1];
#pragma unroll
    for (int r = 0; r < 3; ++r) {
#pragma unroll
        for (int j = 0; j < C; ++j) w[r][j] = cws(r)[(i64)ch * C + j];
        // hist[j] = input at token c0 - (C-1) + j; before token 0 it is window slot c0 + j (c0 = 0).
#pragma unroll
        for (int j = 0; j < C - 1; ++j) {
            const int p = cb - (C - 1) + j;
            hist[r][j] = p >= 0 ? ins(r)[(i64)p * hk + ch] : arena[state_off + r * wf + (i64)ch * (C - 1) + cb + j];
        }
    }
    const float dtb = dt_bias[ch], a = expf(a_log[h]);
    int next_ck = 0;
    {
        int lo = 0, hi = n_ckpt;  // first checkpoint n >= cb + 1 (ckpt_n ascending)
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (ckpt_n[mid] < cb + 1) lo = mid + 1; else hi = mid;
        }
        next_ck = lo;
    }
    for (int jc = 0; jc < NCH; ++jc) {
        const int c0 = cb + jc * RC;
        if (c0 >= t_end) break;  // block-uniform
        const int cl = min(RC, t_end - c0);

        // 1. Causal conv + SiLU along the thread's rows; window checkpoints after token n - 1.
#pragma unroll
        for (int i = 0; i < RC; ++i) {
            if (i < cl) {
#pragma unroll
                for (int r = 0; r < 3; ++r) {
                    float acc = w[r][C - 1] * x[r][i];
#pragma unroll
                    for (int j = 0; j < C - 1; ++j) acc += w[r][j] * hist[r][j];
#pragma unroll
                    for (int j = 0; j < C - 1; ++j) hist[r][j] = j + 1 < C - 1 ? hist[r][j + 1] : x[r][i];
                    x[r][i] = rec_silu<V2>(acc);
                }
                while (next_ck < n_ckpt && ckpt_n[next_ck] == c0 + i + 1) {
#pragma unroll
                    for (int r = 0; r < 3; ++r)
#pragma unroll
                        for (int j = 0; j < C - 1; ++j)
                            arena[ckpt_off[next_ck] + r * wf + (i64)ch * (C - 1) + j] = hist[r][j];
                    ++next_ck;
                }
            }
        }
        // The working window after t_end, by the segment's first block only (for segment 0 it alone
        // read the old window; a one-chunk segment has it in hist, incl. old slots when T < C - 1).
        if (blockIdx.x == 0 && jc == 0) {
#pragma unroll
            for (int r = 0; r < 3; ++r)
#pragma unroll
                for (int j = 0; j < C - 1; ++j) {
                    const int p = t_end - (C - 1) + j;
                    const float val = c0 + cl == t_end ? hist[r][j] : ins(r)[(i64)p * hk + ch];
                    arena[state_off + r * wf + (i64)ch * (C - 1) + j] = val;
                }
        }

        // 2. Row norms of q and k: lane l of each warp ends with the warp's sum for value l (q rows
        //    0-15, k rows 16-31) after a 31-shuffle butterfly, then the 4 warps add up in smem.
        {
            float v[32];
#pragma unroll
            for (int i = 0; i < RC; ++i) {
                v[i] = x[0][i] * x[0][i];
                v[RC + i] = x[1][i] * x[1][i];
            }
            rec_fold<16>(v, lane);
            rec_fold<8>(v, lane);
            rec_fold<4>(v, lane);
            rec_fold<2>(v, lane);
            rec_fold<1>(v, lane);
            red[warp][lane] = v[0];
        }
        __syncthreads();
        if (tid < 32) {
            const float s = red[0][tid] + red[1][tid] + red[2][tid] + red[3][tid];
            nrm[tid] = (tid < RC ? rsqrtf((float)KDA_K) : 1.0f) / sqrtf(s + 1e-6f);
            if (tid < RC) bs[tid] = bv;  // here: the previous chunk's steps 4-5 read bs before barrier 1
        }
        __syncthreads();

        // 3. Gate, in-chunk decays (padded rows: g = 0, k = q = v = 0), staged for the products.
        float gcum[RC], acc = 0.0f;
#pragma unroll
        for (int i = 0; i < RC; ++i) {
            acc += (i < cl ? rec_gate<V2>(fv[i], dtb, a, lower_bound) : 0.0f) * RLOG2E;
            gcum[i] = acc;
            const float ep = exp2f(acc), en = exp2f(-acc);
            const float kk = x[1][i] * nrm[RC + i];
            x[1][i] = kk;
            kp[i][tid] = kk * ep;
            kn[i][tid] = kk * en;
            qp[i][tid] = x[0][i] * nrm[i] * ep;
            vv[i][tid] = x[2][i];
        }
        if (NCH > 1 && jc + 1 < NCH && c0 + RC < t_end) load_chunk(c0 + RC);  // x, fv, bv dead from here
        const i64 rbase = ((i64)((c0 - t_begin) / RC) * heads + h) * KDA_REC;
        float* R = rec + rbase;
        // v3: e for key d = 8n + 2t + r at (t * 32 + 2n + r), the lane order of the scan's accumulators.
        R[REC_E + (R3 ? ((tid >> 1) & 3) * 32 + 2 * (tid >> 3) + (tid & 1) : tid)] = exp2f(acc);
        __syncthreads();

        // 4. Lkk = beta_i <kp_i, kn_j> (j < i), Aqk = <qp_i, kn_j> (j <= i): pairs (i, j), (i + 8, j).
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = (tid >> 4) + 8 * half, j = tid & 15;
            float sl = 0.0f, sa = 0.0f;
            if (j <= i) {
#pragma unroll 8
                for (int d = 0; d < KDA_K; d += 4) {
                    const float4 b = *reinterpret_cast<const float4*>(&kn[j][d]);
                    const float4 p = *reinterpret_cast<const float4*>(&kp[i][d]);
                    const float4 q = *reinterpret_cast<const float4*>(&qp[i][d]);
                    sl += p.x * b.x + p.y * b.y + p.z * b.z + p.w * b.w;
                    sa += q.x * b.x + q.y * b.y + q.z * b.z + q.w * b.w;
                }
            }
            lm[i][j] = j < i ? bs[i] * sl : 0.0f;
            am[i][j] = j <= i ? sa : 0.0f;
        }
        __syncthreads();

        // 5. (I + Lkk)[W | U] = diag(beta)[Kp | V], column by column (own column only: no barrier);
        //    Kd = k 2^(G_C - G) over kn (read by step 4 only).
        {
            float wv[RC], uv[RC];
#pragma unroll
            for (int i = 0; i < RC; ++i) {
                float sw = bs[i] * kp[i][tid], su = bs[i] * vv[i][tid];
#pragma unroll
                for (int j = 0; j < i; ++j) {
                    sw -= lm[i][j] * wv[j];
                    su -= lm[i][j] * uv[j];
                }
                wv[i] = sw;
                uv[i] = su;
                kp[i][tid] = sw;
                vv[i][tid] = su;
                kn[i][tid] = NCH > 1 ? kn[i][tid] * exp2f(acc) : x[1][i] * exp2f(acc - gcum[i]);
            }
        }
        __syncthreads();

        // 6. The record in fragment order, float4 stores (consecutive threads, consecutive 16 B).
        if (R3) {
            kda_rec_store3(sm, R, tid);
            continue;
        }
        float4* R4 = reinterpret_cast<float4*>(R);
#pragma unroll
        for (int e = tid; e < 512; e += 128) {
            const int s = e & 3, ln = (e >> 2) & 31, wq = e >> 7, g = ln >> 2, t = ln & 3;
            const int k0 = 32 * wq + 8 * s;
            R4[(REC_W >> 2) + e] = make_float4(kp[g][k0 + t], kp[g + 8][k0 + t], kp[g][k0 + t + 4], kp[g + 8][k0 + t + 4]);
            R4[(REC_Q >> 2) + e] = make_float4(qp[g][k0 + t], qp[g + 8][k0 + t], qp[g][k0 + t + 4], qp[g + 8][k0 + t + 4]);
            const int d0 = 32 * wq + 16 * (s >> 1), j = 8 * (s & 1) + t;
            R4[(REC_KD >> 2) + e] = make_float4(kn[j][d0 + g], kn[j][d0 + g + 8], kn[j + 4][d0 + g], kn[j + 4][d0 + g + 8]);
            // U: e = (vt*32 + lane)*4 + q; q covers (s*4 + nt)*2 + r for s = q / 2, nt = 2 (q % 2) + {0, 1}.
            const int vt = wq, su = s >> 1, nt0 = 2 * (s & 1), col = 32 * vt + 8 * nt0 + g;
            R4[(REC_U >> 2) + e] = make_float4(vv[8 * su + t][col], vv[8 * su + t + 4][col], vv[8 * su + t][col + 8],
                                               vv[8 * su + t + 4][col + 8]);
        }
        if (tid < 64) {
            const int s = tid & 1, ln = tid >> 1, g = ln >> 2, t = ln & 3, k0 = 8 * s;
            R4[(REC_A >> 2) + tid] = make_float4(am[g][k0 + t], am[g + 8][k0 + t], am[g][k0 + t + 4], am[g + 8][k0 + t + 4]);
        }
    }  // chunk loop
}

#define KDA_REC_ARGS                                                                                          \
    sm, q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, rec, arena, state_off, ckpt_n, ckpt_off, \
        n_ckpt, t_begin, t_end, heads, lower_bound

template <bool V2, bool R3 = false, int NCH = 1>
__device__ __forceinline__ void kda_rec_entry(
    RecSmem& sm, const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
    const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt, int t_begin, int t_end, int heads,
    int conv, float lower_bound) {
    switch (conv) {
        case 1: kda_rec_impl<1, V2, R3, NCH>(KDA_REC_ARGS); break;
        case 2: kda_rec_impl<2, V2, R3, NCH>(KDA_REC_ARGS); break;
        case 3: kda_rec_impl<3, V2, R3, NCH>(KDA_REC_ARGS); break;
        case 4: kda_rec_impl<4, V2, R3, NCH>(KDA_REC_ARGS); break;
        default: break;  // conv > 4: the launchers take the kda_chunk.cu path
    }
}

extern "C" __global__ void __launch_bounds__(128)
kda_chunk_rec_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
                  const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
                  const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
                  const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                  const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt, int t_begin, int t_end,
                  int heads, int conv, float lower_bound) {
    __shared__ RecSmem sm;
    kda_rec_entry<false>(sm, q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, rec, arena,
                         state_off, ckpt_n, ckpt_off, n_ckpt, t_begin, t_end, heads, conv, lower_bound);
}

// 4 blocks / SM (128 registers): the pass alternates DRAM phases (loads, record stores) with
// barrier-separated math, so more resident blocks overlap one block's math with another's traffic.
extern "C" __global__ void __launch_bounds__(128, 4)
kda_chunk_rec2_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
                   const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
                   const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
                   const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                   const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt, int t_begin, int t_end,
                   int heads, int conv, float lower_bound) {
    __shared__ RecSmem sm;
    kda_rec_entry<true>(sm, q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, rec, arena,
                        state_off, ckpt_n, ckpt_off, n_ckpt, t_begin, t_end, heads, conv, lower_bound);
}
// v2 math, v3 record layout (for kda_chunk_scan3*_f32).
extern "C" __global__ void __launch_bounds__(128, 4)
kda_chunk_rec3_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
                   const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
                   const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
                   const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                   const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt, int t_begin, int t_end,
                   int heads, int conv, float lower_bound) {
    __shared__ RecSmem sm;
    kda_rec_entry<true, true>(sm, q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, rec, arena,
                              state_off, ckpt_n, ckpt_off, n_ckpt, t_begin, t_end, heads, conv, lower_bound);
}
// rec3 with KDA_REC_NCH chunks per block (grid (ceil(chunks / KDA_REC_NCH), heads)): the next
// chunk's loads overlap this one's algebra; 3 blocks / SM leave room for the loop's registers.
#define KDA_REC_NCH 8
extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_rec3m_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
                    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
                    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
                    const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena,
                    i64 state_off, const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                    int t_begin, int t_end, int heads, int conv, float lower_bound) {
    __shared__ RecSmem sm;
    kda_rec_entry<true, true, KDA_REC_NCH>(sm, q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias,
                                           rec, arena, state_off, ckpt_n, ckpt_off, n_ckpt, t_begin, t_end, heads,
                                           conv, lower_bound);
}
#undef KDA_REC_ARGS

// ---------------------------------------------------------------------------------------------
// Scan. Block (vt, h) owns state columns 32vt..32vt+31 of head h; warp w owns state rows
// 32w..32w+31 (in smem, XOR-swizzled) and the keys 32w.. of every product, so its W, Qp, Kd
// fragments come straight from the record into registers and the only cross-warp traffic is the
// 16 x 32 partial sums of W S and Qp S (double-buffered: one barrier per chunk).

// f32 -> tf32, round to nearest, ties away. v1: cvt.rna.tf32.f32. v2: the same rounding on the
// bits (add half an ulp of tf32, clear the 13 low bits): identical for finite x (all values here),
// 2 instructions instead of 4.
template <bool V2>
__device__ __forceinline__ u32 sc_tf32(float x) {
    if (V2) return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

template <bool SPLIT, bool V2, int N>
__device__ __forceinline__ void sc_split(const float* v, u32* hi, u32* lo) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        hi[i] = sc_tf32<V2>(v[i]);
        lo[i] = SPLIT ? sc_tf32<V2>(v[i] - __uint_as_float(hi[i])) : 0u;
    }
}

__device__ __forceinline__ void sc_mma1(float* c, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a b in 3xTF32 (small terms first) or 1xTF32.
template <bool SPLIT>
__device__ __forceinline__ void sc_mma(float* c, const u32* ah, const u32* al, const u32* bh, const u32* bl) {
    if (SPLIT) {
        sc_mma1(c, al, bh);
        sc_mma1(c, ah, bl);
    }
    sc_mma1(c, ah, bh);
}

// [row][col] of a 32-column tile, swizzled so B-fragment reads (rows t, cols 8nt + g) and C-fragment
// float2 accesses (rows g, cols 8nt + 2t) are both conflict-free.
__device__ __forceinline__ int sc_idx(int row, int col) { return row * 32 + (col ^ ((row & 3) << 3)); }

__device__ __forceinline__ float4 sc_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

template <bool SPLIT, bool V2>
__device__ __forceinline__ void kda_scan_impl(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                                              const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off,
                                              int n_ckpt, float* __restrict__ o_out, const float* __restrict__ f_in,
                                              const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                              float lower_bound, int t_begin, int t_end, int heads, int conv) {
    __shared__ __align__(16) float ssm[KDA_K * 32];        // state slice, sc_idx layout (16 KiB)
    __shared__ __align__(16) float red[2][4][2][RC * 32];  // [parity][warp][W S | Qp S] (32 KiB)
    const int vt = blockIdx.x, h = blockIdx.y;
    if (h >= heads || vt * 32 >= KDA_V) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int hk = heads * KDA_K, vcol0 = vt * 32;
    const i64 s_base = kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    float* S = arena + state_off + s_base;
    // Own rows only: the warp's lanes exchange them, no block barrier.
    for (int e = lane; e < 32 * 32; e += 32) {
        const int d = warp * 32 + (e >> 5), c = e & 31;
        ssm[sc_idx(d, c)] = S[(i64)d * KDA_V + vcol0 + c];
    }
    __syncwarp();

    const int nchunks = (t_end - t_begin + RC - 1) / RC;
    // Fragments of the current chunk, each reloaded for the next chunk right after its last use.
    float aw[4][4], aq[4][4], akd[4][4], bu[16], aa[2][4], ev[4];
    auto rp = [&](int c) { return rec + ((i64)c * heads + h) * KDA_REC; };
    auto load_wq = [&](const float* R) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const float4 x = sc_ld4(R + REC_W + ((warp * 32 + lane) * 4 + s) * 4);
            const float4 y = sc_ld4(R + REC_Q + ((warp * 32 + lane) * 4 + s) * 4);
            aw[s][0] = x.x; aw[s][1] = x.y; aw[s][2] = x.z; aw[s][3] = x.w;
            aq[s][0] = y.x; aq[s][1] = y.y; aq[s][2] = y.z; aq[s][3] = y.w;
        }
    };
    auto load_ua = [&](const float* R) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 x = sc_ld4(R + REC_U + (vt * 32 + lane) * 16 + 4 * q);
            bu[4 * q] = x.x; bu[4 * q + 1] = x.y; bu[4 * q + 2] = x.z; bu[4 * q + 3] = x.w;
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const float4 x = sc_ld4(R + REC_A + (lane * 2 + s) * 4);
            aa[s][0] = x.x; aa[s][1] = x.y; aa[s][2] = x.z; aa[s][3] = x.w;
        }
    };
    auto load_kd = [&](const float* R) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 x = sc_ld4(R + REC_KD + ((warp * 32 + lane) * 4 + q) * 4);
            akd[q][0] = x.x; akd[q][1] = x.y; akd[q][2] = x.z; akd[q][3] = x.w;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) ev[i] = R[REC_E + warp * 32 + 16 * (i >> 1) + g + 8 * (i & 1)];
    };
    if (nchunks > 0) {
        load_wq(rp(0));
        load_ua(rp(0));
        load_kd(rp(0));
    }
    int next_ck = 0;
    while (next_ck < n_ckpt && ckpt_n[next_ck] <= t_begin) ++next_ck;

    for (int c = 0; c < nchunks; ++c) {
        const int c0 = t_begin + c * RC, cl = min(RC, t_end - c0);
        const float* Rn = rp(c + 1 < nchunks ? c + 1 : c);
        float* rb = &red[c & 1][warp][0][0];
        // a) Partial W S and Qp S over this warp's 32 keys (4 k-steps, 4 n-tiles).
        {
            float P[4][4] = {}, Q[4][4] = {};
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                u32 wh[4], wl[4], qh[4], ql[4];
                sc_split<SPLIT, V2, 4>(aw[s], wh, wl);
                sc_split<SPLIT, V2, 4>(aq[s], qh, ql);
                const int k0 = warp * 32 + 8 * s;
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const float b[2] = {ssm[sc_idx(k0 + t, 8 * nt + g)], ssm[sc_idx(k0 + t + 4, 8 * nt + g)]};
                    u32 bh[2], bl[2];
                    sc_split<SPLIT, V2, 2>(b, bh, bl);
                    sc_mma<SPLIT>(P[nt], wh, wl, bh, bl);
                    sc_mma<SPLIT>(Q[nt], qh, ql, bh, bl);
                }
            }
            if (c + 1 < nchunks) load_wq(Rn);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int row = g + 8 * hf, col = 8 * nt + 2 * t;
                    *reinterpret_cast<float2*>(rb + sc_idx(row, col)) = make_float2(P[nt][2 * hf], P[nt][2 * hf + 1]);
                    *reinterpret_cast<float2*>(rb + RC * 32 + sc_idx(row, col)) =
                        make_float2(Q[nt][2 * hf], Q[nt][2 * hf + 1]);
                }
        }
        __syncthreads();
        // b) X = U - sum_w (W S)_w as B fragments (all 4 n-tiles: every warp needs X for its rows).
        const float* r0 = &red[c & 1][0][0][0];
        u32 xh[16], xl[16];
        {
            float xv[16];
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int idx = sc_idx(8 * s + t + 4 * r, 8 * nt + g);
                        float sum = 0.0f;
#pragma unroll
                        for (int w = 0; w < 4; ++w) sum += r0[w * 2 * RC * 32 + idx];
                        xv[(s * 4 + nt) * 2 + r] = bu[(s * 4 + nt) * 2 + r] - sum;
                    }
            sc_split<SPLIT, V2, 16>(xv, xh, xl);
        }
        // c) O for n-tile `warp`: sum_w (Qp S)_w + Aqk X; rows past t_end are not stored.
        {
            float o[4];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int idx = sc_idx(g + 8 * hf, 8 * warp + 2 * t);
                float2 sum = make_float2(0.0f, 0.0f);
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const float2 p = *reinterpret_cast<const float2*>(r0 + w * 2 * RC * 32 + RC * 32 + idx);
                    sum.x += p.x;
                    sum.y += p.y;
                }
                o[2 * hf] = sum.x;
                o[2 * hf + 1] = sum.y;
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                u32 ah[4], al[4], bh[2], bl[2];
                sc_split<SPLIT, V2, 4>(aa[s], ah, al);
#pragma unroll
                for (int r = 0; r < 2; ++r) {  // pick n-tile `warp` without dynamic register indexing
                    bh[r] = xh[(s * 4) * 2 + r];
                    bl[r] = xl[(s * 4) * 2 + r];
#pragma unroll
                    for (int nt = 1; nt < 4; ++nt)
                        if (warp == nt) {
                            bh[r] = xh[(s * 4 + nt) * 2 + r];
                            bl[r] = xl[(s * 4 + nt) * 2 + r];
                        }
                }
                sc_mma<SPLIT>(o, ah, al, bh, bl);
            }
            if (c + 1 < nchunks) load_ua(Rn);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = g + 8 * hf;
                if (i < cl)
                    *reinterpret_cast<float2*>(o_out + (i64)(c0 + i) * hk + h * KDA_V + vcol0 + 8 * warp + 2 * t) =
                        make_float2(o[2 * hf], o[2 * hf + 1]);
            }
        }
        // d) Checkpoints inside the chunk (rare): S_m = 2^G_{m-1} S + (Kd 2^(G_{m-1} - G_C))[j < m]^T X,
        //    with G recomputed from f exactly as the record pass summed it. Own rows, global dst.
        while (next_ck < n_ckpt && ckpt_n[next_ck] <= c0 + cl) {
            const int m = ckpt_n[next_ck] - c0;
            float* gdst = arena + ckpt_off[next_ck] + s_base;
            float em[4], sc[4];
            const float a = expf(a_log[h]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int d = warp * 32 + 16 * (q >> 1) + g + 8 * (q & 1);
                float acc = 0.0f, gm = 0.0f;
                for (int i = 0; i < cl; ++i) {
                    acc += rec_gate<V2>(f_in[(i64)(c0 + i) * hk + h * KDA_K + d], dt_bias[h * KDA_K + d], a,
                                        lower_bound) *
                           RLOG2E;
                    if (i == m - 1) gm = acc;
                }
                em[q] = exp2f(gm);
                sc[q] = exp2f(gm - acc);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int ra = warp * 32 + 16 * mt + g, rb2 = ra + 8;
                float cacc[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const float2 s0 = *reinterpret_cast<const float2*>(&ssm[sc_idx(ra, 8 * nt + 2 * t)]);
                    const float2 s1 = *reinterpret_cast<const float2*>(&ssm[sc_idx(rb2, 8 * nt + 2 * t)]);
                    cacc[nt][0] = s0.x * em[2 * mt];
                    cacc[nt][1] = s0.y * em[2 * mt];
                    cacc[nt][2] = s1.x * em[2 * mt + 1];
                    cacc[nt][3] = s1.y * em[2 * mt + 1];
                }
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const int j = 8 * s + t;
                    const float av[4] = {j < m ? akd[2 * mt + s][0] * sc[2 * mt] : 0.0f,
                                         j < m ? akd[2 * mt + s][1] * sc[2 * mt + 1] : 0.0f,
                                         j + 4 < m ? akd[2 * mt + s][2] * sc[2 * mt] : 0.0f,
                                         j + 4 < m ? akd[2 * mt + s][3] * sc[2 * mt + 1] : 0.0f};
                    u32 ah[4], al[4];
                    sc_split<SPLIT, V2, 4>(av, ah, al);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
                        sc_mma<SPLIT>(cacc[nt], ah, al, &xh[(s * 4 + nt) * 2], &xl[(s * 4 + nt) * 2]);
                }
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const int col = vcol0 + 8 * nt + 2 * t;
                    *reinterpret_cast<float2*>(gdst + (i64)ra * KDA_V + col) = make_float2(cacc[nt][0], cacc[nt][1]);
                    *reinterpret_cast<float2*>(gdst + (i64)rb2 * KDA_V + col) = make_float2(cacc[nt][2], cacc[nt][3]);
                }
            }
            ++next_ck;
        }
        // e) S <- diag(e) S + Kd^T X for the warp's rows.
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int ra = warp * 32 + 16 * mt + g, rb2 = ra + 8;
            float cacc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const float2 s0 = *reinterpret_cast<const float2*>(&ssm[sc_idx(ra, 8 * nt + 2 * t)]);
                const float2 s1 = *reinterpret_cast<const float2*>(&ssm[sc_idx(rb2, 8 * nt + 2 * t)]);
                cacc[nt][0] = s0.x * ev[2 * mt];
                cacc[nt][1] = s0.y * ev[2 * mt];
                cacc[nt][2] = s1.x * ev[2 * mt + 1];
                cacc[nt][3] = s1.y * ev[2 * mt + 1];
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                u32 ah[4], al[4];
                sc_split<SPLIT, V2, 4>(akd[2 * mt + s], ah, al);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                    sc_mma<SPLIT>(cacc[nt], ah, al, &xh[(s * 4 + nt) * 2], &xl[(s * 4 + nt) * 2]);
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                *reinterpret_cast<float2*>(&ssm[sc_idx(ra, 8 * nt + 2 * t)]) = make_float2(cacc[nt][0], cacc[nt][1]);
                *reinterpret_cast<float2*>(&ssm[sc_idx(rb2, 8 * nt + 2 * t)]) = make_float2(cacc[nt][2], cacc[nt][3]);
            }
        }
        if (c + 1 < nchunks) load_kd(Rn);
        __syncwarp();  // next chunk's B fragments read rows other lanes just wrote
    }
    for (int e = lane; e < 32 * 32; e += 32) {
        const int d = warp * 32 + (e >> 5), c = e & 31;
        S[(i64)d * KDA_V + vcol0 + c] = ssm[sc_idx(d, c)];
    }
}

#define KDA_SCAN_ARGS                                                                                    \
    rec, arena, state_off, ckpt_n, ckpt_off, n_ckpt, o_out, f_in, a_log, dt_bias, lower_bound, t_begin, t_end, heads, \
        conv

// Records of kda_chunk_rec_f32 (v1) / kda_chunk_rec2_f32 (v2): the checkpoint step recomputes the
// gate with the same function as the record pass that wrote them.
extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_scan_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                   const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                   float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                   const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads, int conv) {
    kda_scan_impl<true, false>(KDA_SCAN_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_scan_fast_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                   const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                   float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                   const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads, int conv) {
    kda_scan_impl<false, false>(KDA_SCAN_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_scan2_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                   const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                   float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                   const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads, int conv) {
    kda_scan_impl<true, true>(KDA_SCAN_ARGS);
}
extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_scan2_fast_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                   const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                   float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                   const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads, int conv) {
    kda_scan_impl<false, true>(KDA_SCAN_ARGS);
}
#undef KDA_SCAN_ARGS
