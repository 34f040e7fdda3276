// KDA chunked prefill on tensor cores (k3-architecture.md §1.5): drop-in for kda_chunk_fwd_f32
// (same arguments, same arena/checkpoint contract), launched on grid (KDA_V / 32, heads), 128 threads.
//
// Work split: block (vt, h) owns a 128 x 32 slice of head h's state and walks the chunks in order
// (the recurrence is sequential only per (head, V-slice)), so one sequence gives 4 * H blocks; the
// 4 slices of a head are adjacent block ids and read the same q/k/g rows while they are in L2.
// The K-side algebra of a chunk (decayed keys, L, A_qk) is recomputed by each slice; it is small.
//
// Chunk C = 16 (one m16 tile): with the K3 lower bound |g| <= 5, |Gamma| <= 80 inside a chunk, so
// k * exp(-Gamma) (<= e^80) stays finite in f32 and no sub-chunk rescaling is needed; the whole
// working set (incl. the 128 x 32 state slice) fits the 48 KiB of static shared memory (no launch
// attribute needed), and with <= 170 registers (launch bounds) 3 blocks share an SM: the 384 blocks
// of one K3 sequence are all resident on 132 SMs, one block's barriers hide behind the others.
// (C = 64 as in fla needs sub-chunk rescaling and ~170 KiB of dynamic shared memory: next step.)
//
// Products (all m16n8k8 TF32, f32 accumulate):
//   Lkk = beta * tril(Kp Kn^T, -1)    Aqk = tril(Qp Kn^T)       (Kp = k 2^G, Qp = q 2^G, Kn = k 2^-G)
//   X   = beta * (V - Kp S)           Ointer = Qp S
//   (I + Lkk) Vt = X                  (16-row forward substitution, SIMT)
//   O   = Ointer + Aqk Vt             S <- diag(2^G_C) S + (Kn * 2^G_C)^T Vt
// Two entry points, one body:
//   kda_chunk_tc_f32       3xTF32 (hi*hi + hi*lo + lo*hi): f32-level accuracy (~3e-7 relative in a
//                          lane-level emulation), so the 1e-4 tolerance against the f32 reference holds.
//   kda_chunk_tc_fast_f32  plain TF32 (10-bit mantissa): ~7e-4 relative, 1/3 of the mma work; needs a
//                          2e-3 tolerance (fla's bf16 chunk_kda is coarser still).
#include "kda.cuh"

#define TC_C 16                 // chunk length (one mma M tile)
#define TC_BV 32                // value columns per block
#define TC_KP (KDA_K + 4)       // row stride of [C][K] tiles: fragment loads hit 32 distinct banks
#define TC_XP (TC_BV + 8)       // row stride of the [C][BV] tile: B-fragment loads conflict-free
#define TC_AP (TC_C + 4)        // row stride of the [C][C] matrices
#define TC_LOG2E 1.4426950408889634f

__device__ __forceinline__ u32 tc_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void tc_mma(float* c, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[jt][16 x 8] += A[16 x 8*ksteps] * B_jt[8*ksteps x 8], jt < NT, for one warp: the A fragment is
// loaded (and split) once per k-step for all NT tiles. fa(row, col) / fb(jt, k, n) return operand
// values (f32); fragment ownership (PTX m16n8k8 .tf32): g = lane / 4, t = lane % 4,
// A: (g, t) (g+8, t) (g, t+4) (g+8, t+4); B: (t, g) (t+4, g); C: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1).
template <bool SPLIT, int NT, class FA, class FB>
__device__ __forceinline__ void tc_tiles(float (*c)[4], int ksteps, FA fa, FB fb) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 2
    for (int ks = 0; ks < ksteps; ++ks) {
        const int k0 = ks * 8;
        const float af[4] = {fa(g, k0 + t), fa(g + 8, k0 + t), fa(g, k0 + t + 4), fa(g + 8, k0 + t + 4)};
        u32 ah[4], al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            ah[i] = tc_tf32(af[i]);
            al[i] = SPLIT ? tc_tf32(af[i] - __uint_as_float(ah[i])) : 0u;
        }
#pragma unroll
        for (int jt = 0; jt < NT; ++jt) {
            const float bf[2] = {fb(jt, k0 + t, g), fb(jt, k0 + t + 4, g)};
            u32 bh[2], bl[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                bh[i] = tc_tf32(bf[i]);
                bl[i] = SPLIT ? tc_tf32(bf[i] - __uint_as_float(bh[i])) : 0u;
            }
            if (SPLIT) {
                tc_mma(c[jt], al, bh);  // small terms first
                tc_mma(c[jt], ah, bl);
            }
            tc_mma(c[jt], ah, bh);
        }
    }
}

// State slice [K][BV] in shared memory, XOR-swizzled so that both B-fragment reads (rows t, t+4 of
// one column group) and row-major writes spread over the banks without padding (fits 48 KiB).
__device__ __forceinline__ int tc_sidx(int d, int v) { return d * TC_BV + (v ^ ((d & 3) << 3)); }

struct TcSmem {
    float kp[TC_C][TC_KP];  // k * 2^Gamma        (<= 1)
    float kn[TC_C][TC_KP];  // k * 2^-Gamma       (<= 2^116)
    float qp[TC_C][TC_KP];  // q * 2^Gamma
    float s[KDA_K * TC_BV]; // state slice, tc_sidx layout
    float lkk[TC_C][TC_AP]; // beta_i <kp_i, kn_j>, j < i
    float aqk[TC_C][TC_AP]; // <qp_i, kn_j>, j <= i
    float x[TC_C][TC_XP];   // v, then X = beta (v - Kp S), then Vt
    float ec[KDA_K];        // 2^Gamma_C (chunk-end decay)
    float em[KDA_K];        // 2^Gamma_{m-1} for a checkpoint inside the chunk
    float beta[TC_C];
};

// S' = diag(e) S + (Kn * e)^T[:, j < m] Vt[j < m] for this warp's 32 state rows; written to shared
// memory (chunk end) or to a checkpoint slice in global memory.
template <bool SPLIT>
__device__ __forceinline__ void tc_state_update(TcSmem& sm, const float* e, int m, float* gdst, int vcol0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const int d0 = warp * 32 + mt * 16, r0 = d0 + g, r1 = d0 + g + 8;
        float c[TC_BV / 8][4];
#pragma unroll
        for (int nt = 0; nt < TC_BV / 8; ++nt) {
            const int c0 = nt * 8 + 2 * t;
            c[nt][0] = sm.s[tc_sidx(r0, c0)] * e[r0];
            c[nt][1] = sm.s[tc_sidx(r0, c0 + 1)] * e[r0];
            c[nt][2] = sm.s[tc_sidx(r1, c0)] * e[r1];
            c[nt][3] = sm.s[tc_sidx(r1, c0 + 1)] * e[r1];
        }
        tc_tiles<SPLIT, TC_BV / 8>(
            c, TC_C / 8, [&](int r, int j) { return j < m ? sm.kn[j][d0 + r] * e[d0 + r] : 0.0f; },
            [&](int nt, int j, int n) { return sm.x[j][nt * 8 + n]; });
#pragma unroll
        for (int nt = 0; nt < TC_BV / 8; ++nt) {
            const int c0 = nt * 8 + 2 * t;
            if (gdst) {
                gdst[(i64)r0 * KDA_V + vcol0 + c0] = c[nt][0];
                gdst[(i64)r0 * KDA_V + vcol0 + c0 + 1] = c[nt][1];
                gdst[(i64)r1 * KDA_V + vcol0 + c0] = c[nt][2];
                gdst[(i64)r1 * KDA_V + vcol0 + c0 + 1] = c[nt][3];
            } else {
                sm.s[tc_sidx(r0, c0)] = c[nt][0];
                sm.s[tc_sidx(r0, c0 + 1)] = c[nt][1];
                sm.s[tc_sidx(r1, c0)] = c[nt][2];
                sm.s[tc_sidx(r1, c0 + 1)] = c[nt][3];
            }
        }
    }
}

// Needs |lower_bound| * TC_C < 88 (exp(-Gamma) finite in f32; K3: 5 * 16 = 80), like kda_chunk_fwd_f32.
template <bool SPLIT>
__device__ __forceinline__ void kda_chunk_tc(const float* __restrict__ q, const float* __restrict__ k,
                                             const float* __restrict__ v, const float* __restrict__ g,
                                             const float* __restrict__ beta, float* __restrict__ arena,
                                             i64 state_off, const int* __restrict__ ckpt_n,
                                             const i64* __restrict__ ckpt_off, int n_ckpt, float* __restrict__ o_out,
                                             int tokens, int heads, int conv) {
    __shared__ TcSmem sm;
    const int vt = blockIdx.x, h = blockIdx.y;
    if (h >= heads || vt * TC_BV >= KDA_V) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int hk = heads * KDA_K, vcol0 = vt * TC_BV;
    const i64 s_base = kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    float* S = arena + state_off + s_base;
    for (int e = tid; e < KDA_K * TC_BV; e += 128) {
        const int d = e / TC_BV, c = e % TC_BV;
        sm.s[tc_sidx(d, c)] = S[(i64)d * KDA_V + vcol0 + c];
    }

    // Chunk inputs in registers: thread tid owns key channel d = tid of each of the C rows (coalesced
    // rows), plus 4 elements of the C x 32 value tile. The next chunk's loads are issued right after
    // the current one is staged, so they are in flight during the chunk's math.
    float pq[TC_C], pk[TC_C], pg[TC_C], pv[TC_C * TC_BV / 128], pb = 0.0f;
    auto load = [&](int c0) {
        const int cl = min(TC_C, tokens - c0);
#pragma unroll
        for (int i = 0; i < TC_C; ++i) {
            const i64 off = (i64)(c0 + i) * hk + h * KDA_K + tid;
            const bool in = i < cl;
            pq[i] = in ? q[off] : 0.0f;
            pk[i] = in ? k[off] : 0.0f;
            pg[i] = in ? g[off] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < TC_C * TC_BV / 128; ++r) {
            const int e = tid + 128 * r, i = e / TC_BV, c = e % TC_BV;
            pv[r] = i < cl ? v[(i64)(c0 + i) * hk + h * KDA_V + vcol0 + c] : 0.0f;
        }
        pb = tid < cl ? beta[(i64)(c0 + tid) * heads + h] : 0.0f;
    };
    if (tokens > 0) load(0);
    int next_ck = 0;

    for (int c0 = 0; c0 < tokens; c0 += TC_C) {
        const int cl = min(TC_C, tokens - c0);
        // 1. Stage decayed keys / queries (log2 units, padded rows have g = 0, k = q = v = beta = 0).
        {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < TC_C; ++i) {
                acc += pg[i] * TC_LOG2E;
                const float ep = exp2f(acc), en = exp2f(-acc);
                sm.kp[i][tid] = pk[i] * ep;
                sm.kn[i][tid] = pk[i] * en;
                sm.qp[i][tid] = pq[i] * ep;
            }
            sm.ec[tid] = exp2f(acc);
#pragma unroll
            for (int r = 0; r < TC_C * TC_BV / 128; ++r) {
                const int e = tid + 128 * r;
                sm.x[e / TC_BV][e % TC_BV] = pv[r];
            }
            if (tid < TC_C) sm.beta[tid] = pb;
        }
        __syncthreads();
        if (c0 + TC_C < tokens) load(c0 + TC_C);

        // 2. Warps 0-1 multiply Kp, warps 2-3 Qp (one A fragment for 3 B tiles): warp w computes
        //    the (w & 1) n-tile of Lkk (Kp Kn^T) or Aqk (Qp Kn^T) and n-tiles 2(w & 1), 2(w & 1) + 1
        //    of Kp S (-> X, in place over v) or Qp S (-> Ointer, kept in registers for step 4).
        const bool is_q = warp >= 2;
        const int half = warp & 1;
        float acc[3][4];
#pragma unroll
        for (int jt = 0; jt < 3; ++jt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[jt][r] = 0.0f;
        {
            const float(*lhs)[TC_KP] = is_q ? sm.qp : sm.kp;
            tc_tiles<SPLIT, 3>(
                acc, KDA_K / 8, [&](int i, int d) { return lhs[i][d]; },
                [&](int jt, int d, int n) {
                    return jt == 0 ? sm.kn[half * 8 + n][d] : sm.s[tc_sidx(d, (half * 2 + jt - 1) * 8 + n)];
                });
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = gq + (r >> 1) * 8, j = half * 8 + 2 * tq + (r & 1);
                if (is_q) sm.aqk[i][j] = j <= i ? acc[0][r] : 0.0f;
                else sm.lkk[i][j] = j < i ? sm.beta[i] * acc[0][r] : 0.0f;
            }
            if (!is_q) {
                // This warp alone reads and writes these X columns: no barrier between.
#pragma unroll
                for (int jt = 1; jt < 3; ++jt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = gq + (r >> 1) * 8, col = (half * 2 + jt - 1) * 8 + 2 * tq + (r & 1);
                        sm.x[i][col] = sm.beta[i] * (sm.x[i][col] - acc[jt][r]);
                    }
            }
        }
        __syncthreads();

        // 3. (I + Lkk) Vt = X by forward substitution, one column per lane of warp 0 (16 rows).
        if (warp == 0) {
            float xv[TC_C];
#pragma unroll
            for (int i = 0; i < TC_C; ++i) {
                float acc = sm.x[i][lane];
#pragma unroll
                for (int j = 0; j < i; ++j) acc -= sm.lkk[i][j] * xv[j];
                xv[i] = acc;
                sm.x[i][lane] = acc;
            }
        }
        __syncthreads();

        // 4. O = Ointer + Aqk Vt by warps 2-3 (the n-tiles of their Ointer); rows past the end are
        //    not stored.
        if (is_q) {
            tc_tiles<SPLIT, 2>(
                acc + 1, TC_C / 8, [&](int i, int j) { return sm.aqk[i][j]; },
                [&](int jt, int j, int n) { return sm.x[j][(half * 2 + jt) * 8 + n]; });
#pragma unroll
            for (int jt = 0; jt < 2; ++jt)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = gq + (r >> 1) * 8, col = vcol0 + (half * 2 + jt) * 8 + 2 * tq + (r & 1);
                    if (i < cl) o_out[(i64)(c0 + i) * hk + h * KDA_V + col] = acc[1 + jt][r];
                }
        }

        // 5. Checkpoints inside this chunk (from the chunk-start state, first m rows), then the
        //    chunk-end state. Each warp reads and writes only its own 32 state rows.
        while (next_ck < n_ckpt && ckpt_n[next_ck] <= c0 + cl) {
            const int m = ckpt_n[next_ck] - c0;
            if (m >= 1) {
                // Gamma_{m-1} again from g (rare path; the same sum as step 1, no 16-float array to keep).
                float gm = 0.0f;
                for (int i = 0; i < m; ++i) gm += g[(i64)(c0 + i) * hk + h * KDA_K + tid] * TC_LOG2E;
                sm.em[tid] = exp2f(gm);
                __syncthreads();
                tc_state_update<SPLIT>(sm, sm.em, m, arena + ckpt_off[next_ck] + s_base, vcol0);
                __syncthreads();  // em is rewritten by the next checkpoint
            }
            ++next_ck;
        }
        tc_state_update<SPLIT>(sm, sm.ec, TC_C, nullptr, 0);
        __syncthreads();  // the staged chunk arrays are rewritten next
    }
    for (int e = tid; e < KDA_K * TC_BV; e += 128) {
        const int d = e / TC_BV, c = e % TC_BV;
        S[(i64)d * KDA_V + vcol0 + c] = sm.s[tc_sidx(d, c)];
    }
}

extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_tc_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ arena,
                 i64 state_off, const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                 float* __restrict__ o_out, int tokens, int heads, int conv) {
    kda_chunk_tc<true>(q, k, v, g, beta, arena, state_off, ckpt_n, ckpt_off, n_ckpt, o_out, tokens, heads, conv);
}

extern "C" __global__ void __launch_bounds__(128, 3)
kda_chunk_tc_fast_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ arena,
                      i64 state_off, const int* __restrict__ ckpt_n, const i64* __restrict__ ckpt_off, int n_ckpt,
                      float* __restrict__ o_out, int tokens, int heads, int conv) {
    kda_chunk_tc<false>(q, k, v, g, beta, arena, state_off, ckpt_n, ckpt_off, n_ckpt, o_out, tokens, heads, conv);
}
