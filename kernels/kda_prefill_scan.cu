// KDA chunked prefill in two passes (docs/k3-model.md §3, chunked form): the default path for conv <= 4
// (conv > 4 takes the one-pass kernels of kda_chunk.cu).
//
//   kda_prefill_record_f32  fully parallel, one 128-thread block per (8 x 16-token chunks, head): conv +
//                        SiLU, L2 norms, gate, beta, and every state-independent piece of the chunk
//                        algebra in plain f32 (decays, Lkk, Aqk, the (I + Lkk) solve), written as one
//                        "chunk record" per (chunk, head) in the mma fragment order the scan loads.
//   kda_prefill_scan_f32  the only sequential part, grid (V / 32, heads), the state in mma registers:
//                        per chunk X = U - W S,   O = Qp S + Aqk X,   S <- diag(e) S + Kd^T X (3xTF32).
//
// Why: a one-pass tensor-core kernel (deleted) kept the decays, Lkk/Aqk and a 16-row forward
// substitution inside the sequential loop; its per-chunk latency, not its math, set the time. Here
// the loop is three small mma products per chunk, and the record pass replaces conv + prep at the
// same DRAM bytes (reads raw q, k, v, f; writes 4 tiles per chunk instead of q, k, v, g). It is
// faster than fla's chunk_kda at K3 shapes, and than the dropped alternatives: a one-warp-per-16-
// columns scan, the one-pass tensor-core kernel, two-pass kernels with the state in shared memory,
// one chunk per record block (figures: docs/performance-history.md).
//
// With Tm = (I + Lkk)^-1 diag(beta): W = Tm Kp, U = Tm V, so the delta-rule corrections are
// Vt = Tm (V - Kp S) = U - W S (linear in S). Kp = k 2^G, Qp = q 2^G, Kd = k 2^(G_C - G), e = 2^G_C
// (G: in-chunk cumulative gate in log2 units, G_C its last row); padded rows are all zero.
//
// Record of chunk c, head h: rec + (c * heads + h) * KDA_REC floats (c counted from t_begin / 16),
// float4 f (lane = 4g + t), in the order the scan's fragments want (see the scan's comment):
//   W, Qp  f = s*32 + lane: {M[g][k], M[g][k+1], M[g+8][k], M[g+8][k+1]}, k = 8s + 2t
//   Kd     f = (s2*8 + p)*32 + lane: {Kd[j][d], Kd[j+1][d], Kd[j][d+8], Kd[j+1][d+8]}, j = 8s2 + 2t, d = 16p + g
//   U      f = (mc*2 + nt)*32 + lane: {U[i][c], U[i+1][c], U[i][c+8], U[i+1][c+8]}, i = 8nt + 2t, c = 16mc + g
//   Aqk    f = s2*32 + lane: {A[g][j], A[g][j+1], A[g+8][j], A[g+8][j+1]}, j = 8s2 + 2t
//   e      float t*32 + 2n + r: e[8n + 2t + r]
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
#define KDA_REC_NCH 8        // chunks per record-pass block (ops.rs KDA_REC_NCH)

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

// SiLU and gate with __fdividef (2 ulp) instead of k3_silu / kda_gate's IEEE division (rcp + a
// slow-path branch each); the limits at +-inf are still right: a denominator past 2^126 gives 0.
__device__ __forceinline__ float rec_silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
__device__ __forceinline__ float rec_gate(float f, float dt_bias, float a_exp, float lower_bound) {
    return lower_bound * __fdividef(1.0f, 1.0f + __expf(-a_exp * (f + dt_bias)));
}

// Step 6: the record in the scan's B-operand / accumulator order (layout in the file header).
__device__ __forceinline__ void kda_rec_store(RecSmem& sm, float* __restrict__ R, int tid) {
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

// A block runs KDA_REC_NCH consecutive chunks of one head, the conv history carried in registers
// and the next chunk's raw loads issued into the input registers as soon as step 3 has staged the
// current one (Kd then comes from the staged k 2^-G), so DRAM overlaps steps 4-6 (168 registers,
// 3 blocks per SM). Loading each chunk at its start with 4 blocks per SM instead is slower, and a
// variant at ~1/3 fewer instructions (in-place conv, Lkk / Aqk in 3xTF32 on tensor cores) misses
// the 1e-4 budget against the f32 path (this one is ~1e-6); both were deleted.
template <int C>
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
    const int cb = t_begin + blockIdx.x * (KDA_REC_NCH * RC);  // the block's first chunk
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
    for (int jc = 0; jc < KDA_REC_NCH; ++jc) {
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
                    x[r][i] = rec_silu(acc);
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
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < RC; ++i) {
            acc += (i < cl ? rec_gate(fv[i], dtb, a, lower_bound) : 0.0f) * RLOG2E;
            const float ep = exp2f(acc), en = exp2f(-acc);
            const float kk = x[1][i] * nrm[RC + i];
            kp[i][tid] = kk * ep;
            kn[i][tid] = kk * en;
            qp[i][tid] = x[0][i] * nrm[i] * ep;
            vv[i][tid] = x[2][i];
        }
        if (jc + 1 < KDA_REC_NCH && c0 + RC < t_end) load_chunk(c0 + RC);  // x, fv, bv dead from here
        const i64 rbase = ((i64)((c0 - t_begin) / RC) * heads + h) * KDA_REC;
        float* R = rec + rbase;
        // e for key d = 8n + 2t + r at (t * 32 + 2n + r), the lane order of the scan's accumulators.
        R[REC_E + ((tid >> 1) & 3) * 32 + 2 * (tid >> 3) + (tid & 1)] = exp2f(acc);
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
                kn[i][tid] *= exp2f(acc);
            }
        }
        __syncthreads();

        // 6. The record in fragment order, float4 stores (consecutive threads, consecutive 16 B).
        kda_rec_store(sm, R, tid);
    }  // chunk loop
}

#define KDA_REC_ARGS                                                                                          \
    sm, q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, rec, arena, state_off, ckpt_n, ckpt_off, \
        n_ckpt, t_begin, t_end, heads, lower_bound

// Grid (ceil(chunks / KDA_REC_NCH), heads), 128 threads: 3 blocks / SM leave room for the loop's
// registers while the next chunk's loads are in flight. conv > 4: the launchers take the
// kda_chunk.cu path.
// (Parameter list written out: the harness parses the entries' signatures without a preprocessor.)
extern "C" __global__ void __launch_bounds__(128, 3)
kda_prefill_record_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
                    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
                    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
                    const float* __restrict__ dt_bias, float* __restrict__ rec, float* __restrict__ arena,
                    i64 state_off, const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                    int t_begin, int t_end, int heads, int conv, float lower_bound) {
    __shared__ RecSmem sm;
    switch (conv) {
        case 1: kda_rec_impl<1>(KDA_REC_ARGS); break;
        case 2: kda_rec_impl<2>(KDA_REC_ARGS); break;
        case 3: kda_rec_impl<3>(KDA_REC_ARGS); break;
        case 4: kda_rec_impl<4>(KDA_REC_ARGS); break;
        default: break;
    }
}
#undef KDA_REC_ARGS

// ---------------------------------------------------------------------------------------------
// Scan: the state in registers. Per chunk, transposed so the state never leaves the mma accumulators:
//     X^T = U^T - S^T W^T,   O^T = S^T Qp^T + X^T Aqk^T,   S^T <- S^T diag(e) + X^T Kd
// S^T [16 cols x 64 keys] of one warp is 8 m16n8 accumulators (32 registers). An accumulator holds
// (col g, key 2t | 2t + 1) and the A operand of the next product wants (col g, k = t | t + 4): the
// same registers once k = t <-> key 2t, k = t + 4 <-> key 2t + 1 inside each 8-key step, so the
// record stores W^T / Qp^T with that key order (and Kd / Aqk^T with the same order over tokens,
// which X^T's accumulators hand over the same way). No shared-memory state, no state address math.
// The chunk record (W, Qp, Kd, Aqk, e and the block's U^T) is staged in shared memory by cp.async,
// once per block, while the previous chunk's S update runs.
//
// 3xTF32 with a 3-instruction split (hi = x truncated to tf32, lo = x - hi exactly, then truncated):
// per product error < 2^-19 relative (lo's truncation and the dropped lo*lo, each < 2^-20), i.e.
// f32-grade against the 1e-4 budget, which 1xTF32 (~7e-4) misses; the split is ~half the scan's
// instructions (272 values per warp and chunk). Neither product can drop to 1xTF32: O and the state
// recurrence both need the 3 terms.

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

// ---------------------------------------------------------------------------------------------
// The scan, key-split: a block is 4 warps, column tiles 2 bx + (w & 1) of 16 columns, key halves
// kh = w >> 1. Why: one warp per 16 columns and all 128 keys (deleted, slower) is
// 768 warps for 528 SM sub-partitions at H = 96, so at 3 blocks per SM two of the four
// sub-partitions run 2 warps and time the kernel (its mma + split work per chunk is fixed by the
// state, not by DRAM). Here 1536 half-warps of work, 3 per sub-partition, with half the per-warp
// chain per chunk. The key halves meet once per chunk: each writes its partial S^T W^T (both token
// tiles) and the other half's token tile of S^T Qp^T into shared memory at the barrier that
// already frees W / Qp; both then form the same X^T (a + b == b + a exactly), and warp kh writes
// the O token tile kh and updates its own 64 keys.
struct Scan4Smem {
    __align__(16) float wq[2][2048];    // W, Qp (read by the first products only: one buffer)
    __align__(16) float kd[2][2048];    // Kd, double-buffered with the rest
    __align__(16) float u[2][512];      // U^T of the block's two column tiles
    __align__(16) float a[2][256];      // Aqk^T
    __align__(16) float e[2][128];
    __align__(16) float4 xp[2][2][3][32];  // [kh][column tile][P nt 0, P nt 1, Q nt kh ^ 1][lane]
    float gm[4][2][64];                 // checkpoint decays of the warp's keys
};

extern "C" __global__ void __launch_bounds__(128, 3)
kda_prefill_scan_f32(const float* __restrict__ rec, float* __restrict__ arena, i64 state_off,
                    const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                    float* __restrict__ o_out, const float* __restrict__ f_in, const float* __restrict__ a_log,
                    const float* __restrict__ dt_bias, float lower_bound, int t_begin, int t_end, int heads, int conv) {
    __shared__ Scan4Smem sm;
    const int h = blockIdx.y, tid = threadIdx.x;
    if (h >= heads || blockIdx.x * 32 >= KDA_V) return;  // block-uniform
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mcl = warp & 1, kh = warp >> 1;           // column tile in the block, key half
    const int col0 = 16 * (blockIdx.x * 2 + mcl), k0 = 64 * kh;
    const int hk = heads * KDA_K;
    const i64 s_base = kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    float* S = arena + state_off + s_base;
    const int nchunks = (t_end - t_begin + RC - 1) / RC;

    auto stage = [&](int c, int b) {
        const float* R = rec + ((i64)c * heads + h) * KDA_REC + 4 * tid;
#pragma unroll
        for (int i = 0; i < 8; ++i) s3_cp16(&sm.wq[0][4 * tid] + 512 * i, R + REC_W + 512 * i);
#pragma unroll
        for (int i = 0; i < 4; ++i) s3_cp16(&sm.kd[b][4 * tid] + 512 * i, R + REC_KD + 512 * i);
        s3_cp16(&sm.u[b][4 * tid], R + REC_U + blockIdx.x * 512);
        if (tid < 64) s3_cp16(&sm.a[b][4 * tid], R + REC_A);
        if (tid < 32) s3_cp16(&sm.e[b][4 * tid], R + REC_E);
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (nchunks > 0) stage(0, 0);

    // st[n][r]: S[k0 + 8n + 2t + (r & 1)][col0 + g + 8 (r >> 1)] (the global n-tile is 8 kh + n).
    float st[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            st[n][r] = S[(i64)(k0 + 8 * n + 2 * t + (r & 1)) * KDA_V + col0 + g + 8 * (r >> 1)];
    int next_ck = 0;
    while (next_ck < n_ckpt && ckpt_n[next_ck] <= t_begin) ++next_ck;

    for (int c = 0; c < nchunks; ++c) {
        const int c0 = t_begin + c * RC, cl = min(RC, t_end - c0), b = c & 1;
        asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads();  // chunk c staged by every thread
        // a) The warp's key half of S^T W^T and S^T Qp^T (8 key steps, two partial sets).
        float P[2][2][4] = {}, Q[2][2][4] = {};
        const float4* W4 = reinterpret_cast<const float4*>(sm.wq[0]);
        const float4* Q4 = reinterpret_cast<const float4*>(sm.wq[1]);
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            u32 ah[4], al[4];
            s3_afrag(st[s], ah, al);
            const int sg = 8 * kh + s;
            const float4 w = W4[sg * 32 + lane], q = Q4[sg * 32 + lane];
            s3_mma(P[s & 1][0], ah, al, w.x, w.y);
            s3_mma(P[s & 1][1], ah, al, w.z, w.w);
            s3_mma(Q[s & 1][0], ah, al, q.x, q.y);
            s3_mma(Q[s & 1][1], ah, al, q.z, q.w);
        }
        float pm[2][4], qm[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                pm[nt][r] = P[0][nt][r] + P[1][nt][r];
                qm[nt][r] = Q[0][nt][r] + Q[1][nt][r];
            }
        float4* xo = sm.xp[kh][mcl][0];
        xo[lane] = make_float4(pm[0][0], pm[0][1], pm[0][2], pm[0][3]);
        xo[32 + lane] = make_float4(pm[1][0], pm[1][1], pm[1][2], pm[1][3]);
        float qo[4], qk[4];  // the other half's O token tile, and this half's (selects: no local memory)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            qo[r] = kh ? qm[0][r] : qm[1][r];
            qk[r] = kh ? qm[1][r] : qm[0][r];
        }
        xo[64 + lane] = make_float4(qo[0], qo[1], qo[2], qo[3]);
        __syncthreads();  // W, Qp read by all warps (the next chunk may land); partials visible
        if (c + 1 < nchunks) stage(c + 1, b ^ 1);
        // b) X^T = U^T - (S^T W^T over all keys), the same in both halves; then A fragments.
        const float4* xi = sm.xp[kh ^ 1][mcl][0];
        u32 xh[2][4], xl[2][4];
        float xa[2][4];
        const float4* U4 = reinterpret_cast<const float4*>(sm.u[b]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const float4 u = U4[(mcl * 2 + nt) * 32 + lane], po = xi[nt * 32 + lane];
            const float uv[4] = {u.x, u.y, u.z, u.w}, pv[4] = {po.x, po.y, po.z, po.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) xa[nt][r] = uv[r] - (pm[nt][r] + pv[r]);
            s3_afrag(xa[nt], xh[nt], xl[nt]);
        }
        // c) O^T token tile kh: both halves' S^T Qp^T + X^T Aqk^T.
        {
            const float4 qi = xi[64 + lane];
            float oa[4] = {qk[0] + qi.x, qk[1] + qi.y, qk[2] + qi.z, qk[3] + qi.w};
            const float4* A4 = reinterpret_cast<const float4*>(sm.a[b]);
#pragma unroll
            for (int s2 = 0; s2 < 2; ++s2) {
                const float4 a = A4[s2 * 32 + lane];
                s3_mma(oa, xh[s2], xl[s2], kh ? a.z : a.x, kh ? a.w : a.y);
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 8 * kh + 2 * t + (r & 1);
                if (i < cl) o_out[(i64)(c0 + i) * hk + h * KDA_V + col0 + g + 8 * (r >> 1)] = oa[r];
            }
        }
        const float4* K4 = reinterpret_cast<const float4*>(sm.kd[b]);
        // d) Checkpoints inside the chunk (rare): S_m^T = S^T diag(2^G_{m-1}) + X^T[:, j < m] (Kd 2^(G_{m-1} - G_C))
        //    on the warp's keys, G recomputed from f as the record pass summed it (rec_gate).
        while (next_ck < n_ckpt && ckpt_n[next_ck] <= c0 + cl) {
            const int m = ckpt_n[next_ck] - c0;
            float* gdst = arena + ckpt_off[next_ck] + s_base;
            const float ae = expf(a_log[h]);
            for (int dl = lane; dl < 64; dl += 32) {
                const int d = k0 + dl;
                float acc = 0.0f, gmv = 0.0f;
                for (int i = 0; i < cl; ++i) {
                    const float z = -ae * (f_in[(i64)(c0 + i) * hk + h * KDA_K + d] + dt_bias[h * KDA_K + d]);
                    acc += lower_bound * __fdividef(1.0f, 1.0f + __expf(z)) * RLOG2E;
                    if (i == m - 1) gmv = acc;
                }
                sm.gm[warp][0][dl] = exp2f(gmv);
                sm.gm[warp][1][dl] = exp2f(gmv - acc);
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
            for (int n = 0; n < 8; ++n) {
                const int ng = 8 * kh + n;
                float cc[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) cc[r] = st[n][r] * sm.gm[warp][0][8 * n + 2 * t + (r & 1)];
                const float sc = sm.gm[warp][1][8 * n + g];
#pragma unroll
                for (int s2 = 0; s2 < 2; ++s2) {
                    const float4 k = K4[(s2 * 8 + (ng >> 1)) * 32 + lane];
                    s3_mma(cc, mh[s2], ml[s2], ((n & 1) ? k.z : k.x) * sc, ((n & 1) ? k.w : k.y) * sc);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    gdst[(i64)(k0 + 8 * n + 2 * t + (r & 1)) * KDA_V + col0 + g + 8 * (r >> 1)] = cc[r];
            }
            __syncwarp();
            ++next_ck;
        }
        // e) The warp's keys: S^T <- S^T diag(e) + X^T Kd, 8 independent accumulators.
        const float2* E2 = reinterpret_cast<const float2*>(sm.e[b]);
#pragma unroll
        for (int pl = 0; pl < 4; ++pl) {
            const int p = 4 * kh + pl;
            const float4 k0v = K4[p * 32 + lane], k1v = K4[(8 + p) * 32 + lane];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int n = 2 * pl + hf;
                const float2 e = E2[t * 16 + 2 * p + hf];
                st[n][0] *= e.x;
                st[n][1] *= e.y;
                st[n][2] *= e.x;
                st[n][3] *= e.y;
                s3_mma(st[n], xh[0], xl[0], hf ? k0v.z : k0v.x, hf ? k0v.w : k0v.y);
                s3_mma(st[n], xh[1], xl[1], hf ? k1v.z : k1v.x, hf ? k1v.w : k1v.y);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            S[(i64)(k0 + 8 * n + 2 * t + (r & 1)) * KDA_V + col0 + g + 8 * (r >> 1)] = st[n][r];
}
