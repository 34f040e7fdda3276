// Routed experts in MXFP4 for 1-token decode steps (moe/single_token.rs):
//   mxfp4_experts_single_token_up_f32    gu = W1_e z_t, W3_e z_t per part of the row
//   mxfp4_experts_single_token_down_f32  act = SiTU-GLU(sum of gu's parts), y = W2_e act, and the combine
//                             out[t] = sum_j w[t,j] y[t*k + j] folded in: no third launch
// The math is the per-lane table form (each lane's 32-value block in its own mma column, E2M1
// pairs from a per-lane replicated bf16x2 table, x as hi + lo bf16, scales in f32 per block,
// mxfp4_mma.cuh); what this pair changes is how the bytes get there. A plain register ring of
// weight loads stays near half the weight-traffic floor. Why, from its SASS: ptxas puts every weight
// load of the register ring on one scoreboard across the loop's back edge, so each trip (D steps:
// up 2, down 4) starts by waiting for *all* loads in flight, including those issued just before:
// the ring drains once per trip, and a warp has about one step of loads in flight. Here:
// - Weights go through a per-warp ring of MXV_STAGES steps in shared memory, filled by cp.async
//   (16-byte copies with the L2::256B prefetch hint: one DRAM burst per 4 steps of a row, which
//   the pair needs to stream at full rate) and waited
//   by group count (cp.async.wait_group: only the oldest step), so 3 steps (6 KB per warp, 96 KB
//   per SM) stay in flight across unit boundaries. A lane copies exactly the 16 bytes it later
//   reads (its MX block of rows g and g + 8), so the weights need no barrier; the step's scales
//   (one 4-byte word per row: blocks 4s .. 4s + 3) are copied one word per lane and read after a
//   __syncwarp.
// - One 512-thread block per SM (16 warps): one 64 KB table instead of two
//   leaves room for the rings. The table sits on a 64 KB boundary of the
//   shared window, so a lookup's address is one PRMT (byte of the weight word into bits 8..15, the
//   lane and the table's upper bits from a register), one IADD per weight byte fewer than an
//   unaligned table.
// - Each step multiplies two 16-row sets: up W1 and W3 of one tile, down two adjacent
//   tiles of W2, so the staged x fragments and the unit bookkeeping serve twice the
//   rows. Only the 8 lanes whose B column carries x read it (not all 32: 24 of them would read a zero block).
// - down: consecutive units of a warp on the same (assignment, 32-row group) add into one run
//   (one partial per run instead of per part); each run's partial goes to yp[a, first part], its
//   part's bit to a mask and its unit count to a counter per (token, group). The warp that brings
//   a counter to top_k * parts sums that group's rows over the slots (in slot order) and written
//   parts (in part order): fixed order, so the result does not depend on scheduling. The up
//   kernel zeroes the counters and masks (it runs first on the same stream).
// Widths must be multiples of 128 (whole steps: no padding blocks; K3 3584 / 3072) and <= 3968;
// dispatch.rs gives other widths the few-token pair. Scale rows are then 4-byte aligned (nb % 4 == 0).
#include "mxfp4_mma.cuh"

#define MXV_WARPS 16                           // warps per block (one block per SM)
#define MXV_STAGES 4                           // ring depth: steps per warp in shared memory
#define MXV_SET 1024                           // bytes of one 16-row set per step: 2 halves x 32 lanes x 16
#define MXV_STAGE (2 * MXV_SET + 128)          // one step: 2 sets, then 32 scale words
#define MXV_RING (MXV_STAGES * MXV_STAGE)      // 8,704 bytes per warp
#define MXV_TABLE 65536                        // decode table + staged x (upper half of each 256-byte row)
// Dynamic shared memory (geometry.rs SINGLE_TOKEN_SHARED): table, 16 rings and the most that
// packing rings around the 64 KB-aligned table can waste (less than one ring).
#define MXV_SHARED (MXV_TABLE + (MXV_WARPS + 1) * MXV_RING)
#define MXV_MAX_BLOCKS 124                     // 32-value blocks per staged row (cols <= 3968)

extern __shared__ __align__(16) unsigned char mxv_smem[];

// Shared-window accesses by 32-bit address. volatile: ordered with the cp.async waits and
// barriers around them (the ring is rewritten while the loop runs).
__device__ __forceinline__ uint4 mxv_lds128(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ u32 mxv_lds8(u32 a) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ void mxv_sts128(u32 a, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void mxv_cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void mxv_cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void mxv_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void mxv_wait_ring() {  // the oldest of the MXV_STAGES - 1 groups in flight
    asm volatile("cp.async.wait_group %0;" ::"n"(MXV_STAGES - 2) : "memory");
}
__device__ __forceinline__ void mxv_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Release / acquire at device scope (the combine's counters): lighter than __threadfence (SC).
__device__ __forceinline__ void mxv_fence() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Table entry (byte `by` of `word`, this lane): the table is 64 KB-aligned, so the address is the
// lane register (table address | 4 * lane) with byte 1 replaced by the weight byte. Not volatile:
// the table is constant after the fill, and the address depends on a ring read.
__device__ __forceinline__ u32 mxv_pair(u32 word, u32 lanetab, int by) {
    const u32 a = __byte_perm(word, lanetab, 0x7604u + 16u * (u32)by);
    u32 v;
    asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

struct MxvSmem {
    u32 tab;   // decode table (64 KB-aligned shared address)
    u32 ring;  // this warp's ring
};

// Rings below the table while whole ones fit there, the rest after it (MXV_SHARED covers the
// worst case). The same for every thread of the block.
__device__ __forceinline__ MxvSmem mxv_layout() {
    const u32 base = (u32)__cvta_generic_to_shared(mxv_smem);
    const u32 tab = (base + 0xffffu) & ~0xffffu;
    const u32 below = (tab - base) / MXV_RING, w = threadIdx.x >> 5;
    return {tab, w < below ? base + w * MXV_RING : tab + MXV_TABLE + (w - below) * MXV_RING};
}

// Entry b of lane l at byte 256 b + 4 l of the table: bf16x2 of E2M1(b & 15), E2M1(b >> 4).
__device__ __forceinline__ void mxv_fill_table(u32 tab) {
    for (int i = threadIdx.x; i < 256 * 8; i += blockDim.x) {
        const u32 b = (u32)i >> 3, v = mx_bf16_of(b & 15u) | (mx_bf16_of(b >> 4) << 16);
        mxv_sts128(tab + (b << 8) + (((u32)i & 7u) << 4), make_uint4(v, v, v, v));
    }
}

// Stage one input row (cols values, a multiple of 128; val8(col, v) gives columns col .. col + 7
// in f32) as hi / lo bf16 into x slot `slot`: block c in the upper half of table row 128 slot + c,
// 32 hi then 32 lo bf16, 16-byte piece q at q ^ (c & 3).
template <typename Val8>
__device__ __forceinline__ void mxv_stage(u32 tab, int cols, int slot, Val8 val8) {
    for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) {
        const int c = i >> 2, q = i & 3;
        float v[8];
        val8(8 * i, v);
        u32 hi[4], lo[4];
        split8_bf16(v, hi, lo);
        const u32 p = tab + ((u32)(128 * slot + c) << 8) + 128u + 16u * (u32)(q ^ (c & 3));
        mxv_sts128(p, make_uint4(hi[0], hi[1], hi[2], hi[3]));
        mxv_sts128(p + 64u, make_uint4(lo[0], lo[1], lo[2], lo[3]));
    }
}

// The block's part of the units (assignment a < n_assign, group of 16 * (2 / NM) rows, part p <
// parts) of NM matrices [experts, rows, cols] (packed wp[m], scales ws[m]); units are split evenly
// over all warps of the grid. A step is 128 columns of two 16-row sets: set r is
// matrix r of the group's tile (NM = 2) or tile r of the group (NM = 1). stage(j, slot) stages
// assignment j's input; emit(a, grp, p, run, m, row, v, ok) is called by every lane at the end of
// a run (MERGE: consecutive units of one (a, group), else each unit) with its row's partial sum.
template <int NM, bool MERGE, typename Stage, typename Emit>
__device__ __forceinline__ void mxv_drive(const u8* const (&wp)[NM], const u8* const (&ws)[NM],
                                          const int* __restrict__ idx, int experts, int n_assign, int rows, int cols,
                                          int parts, Stage stage, Emit emit) {
    constexpr int RT = 2 / NM;  // 16-row tiles per group
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nb = cols / 32, ns = nb / 4, groups = rows / (16 * RT);
    // Host-checked (moe/single_token.rs single_token_plan); an empty part would never end.
    if (cols % 128 != 0 || nb > MXV_MAX_BLOCKS || rows % (16 * RT) != 0 || parts < 1 || parts > ns) return;
    const int per_a = groups * parts;
    const i64 n = (i64)n_assign * per_a;  // < 2^31 (host-checked)
    const i64 nw = (i64)gridDim.x * MXV_WARPS, w0 = (i64)blockIdx.x * MXV_WARPS;
    const i64 b0 = n * w0 / nw, b1 = n * (w0 + MXV_WARPS) / nw;
    if (b1 <= b0) return;  // block-uniform
    const int q0 = (int)(n * (w0 + warp) / nw), q1 = (int)(n * (w0 + warp + 1) / nw);
    const int jlo = (int)(b0 / per_a), jhi = (int)((b1 - 1) / per_a);
    const u32 rowb = (u32)nb * 16u;
    const MxvSmem sm = mxv_layout();
    const u32 lanetab = sm.tab | ((u32)lane << 2);
    const u32 own = (u32)lane * 16u;  // this lane's 16 bytes in each (set, half) of a stage
    // The scale word this lane copies: set t >> 1, row g + 8 (t & 1).
    const u32 sword = 2u * MXV_SET + 4u * (16u * (u32)(t >> 1) + (u32)g + 8u * (u32)(t & 1));

    // Load cursor: runs MXV_STAGES - 1 steps ahead of the compute cursor over the round's units.
    // Both cursors step (assignment, group, part) incrementally: a division per unit (its end
    // step), not four.
    int lu = 0, lend = 0, la = 0, lgrp = 0, lp = 0, ls = 0, lleft = 0;
    const u8* lsrc[2][2];
    const u8* lscale = nullptr;
    auto l_rows = [&]() {  // pointers of (la, lgrp) at step ls
        int e = __ldg(idx + la);
        if (e < 0 || e >= experts) e = 0;  // skipped assignment: loads stay in bounds, nothing stored
        const i64 rb = (i64)e * rows + lgrp * 16 * RT;
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                lsrc[r][h] = wp[r % NM] + (rb + 16 * (r / NM) + g + 8 * h) * rowb + (u32)(4 * ls + t) * 16u;
        const int rs = t >> 1;  // runtime: pick the matrix without indexing a local array
        lscale = (NM == 1 || rs == 0 ? ws[0] : ws[NM - 1]) + (rb + 16 * (rs / NM) + g + 8 * (t & 1)) * nb + 4 * ls;
    };
    auto l_issue = [&](u32 st) {  // always commits a group (empty past the end): counts stay aligned
        if (lu < lend) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mxv_cp16(st + (u32)(r * MXV_SET + h * 512) + own, lsrc[r][h]);
                    lsrc[r][h] += 64;
                }
            mxv_cp4(st + sword, lscale);
            lscale += 4;
            ++ls;
            if (--lleft == 0 && ++lu < lend) {
                if (++lp == parts) {  // next (assignment, group): its row starts
                    lp = 0;
                    ls = 0;
                    if (++lgrp == groups) {
                        lgrp = 0;
                        ++la;
                    }
                    l_rows();
                }  // else the next part of the row: the pointers run on
                lleft = (lp + 1) * ns / parts - ls;
            }
        }
        mxv_commit();
    };
    auto start = [&](int lo, int hi) {
        lu = lo;
        lend = hi;
        if (lu < lend) {
            la = lu / per_a;
            const int rem = lu - la * per_a;
            lgrp = rem / parts;
            lp = rem - lgrp * parts;
            ls = lp * ns / parts;
            lleft = (lp + 1) * ns / parts - ls;
            l_rows();
        }
#pragma unroll
        for (int k = 0; k < MXV_STAGES - 1; ++k) l_issue(sm.ring + k * MXV_STAGE);
    };

    // Compute cursor.
    int jr = jlo;
    int cu = 0, cend = 0, cleft = 0, cs = 0, ca = 0, cgrp = 0, cp = 0, cp0 = 0, run = 0;
    bool cok = false;
    float acc[2][2];
    auto c_run = [&]() {  // a run starts at (ca, cgrp, cp), step cs
        cp0 = cp;
        run = 0;
        const int e = __ldg(idx + ca);
        cok = e >= 0 && e < experts;
#pragma unroll
        for (int r = 0; r < 2; ++r) acc[r][0] = acc[r][1] = 0.0f;
    };
    auto c_begin = [&]() {  // the round's first unit
        ca = cu / per_a;
        const int rem = cu - ca * per_a;
        cgrp = rem / parts;
        cp = rem - cgrp * parts;
        cs = cp * ns / parts;
        c_run();
        run = 1;
        cleft = (cp + 1) * ns / parts - cs;
    };
    auto c_next = [&](bool cont) {  // the next unit (cont: it continues the current run)
        if (++cp == parts) {
            cp = 0;
            cs = 0;
            if (++cgrp == groups) {
                cgrp = 0;
                ++ca;
            }
        }
        if (!cont) c_run();
        ++run;
        cleft = (cp + 1) * ns / parts - cs;
    };
    const bool xlane = (g >> 1) == t;  // this lane's B column carries x (block t of the step)
    const u32 xhalf = 128u + 64u * (u32)(g & 1);
    auto c_step = [&](u32 st) {
        uint4 wv[2][2];
        u32 sc[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[r][h] = mxv_lds128(st + (u32)(r * MXV_SET + h * 512) + own);
                sc[r][h] = mxv_lds8(st + 2u * MXV_SET + 4u * (u32)(16 * r + g + 8 * h) + (u32)t);
            }
        u32 b[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) b[q] = 0u;
        if (xlane) {
            const u32 xo = sm.tab + ((u32)(128 * (ca - jr) + 4 * cs + t) << 8) + xhalf;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint4 v = mxv_lds128(xo + 16u * (u32)(q ^ t));
                b[4 * q] = v.x;
                b[4 * q + 1] = v.y;
                b[4 * q + 2] = v.z;
                b[4 * q + 3] = v.w;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 x0 = mx_word(wv[r][0], j >> 1), x1 = mx_word(wv[r][1], j >> 1);
                const int by = 2 * (j & 1);
                tc_mma_bf16(c4, mxv_pair(x0, lanetab, by), mxv_pair(x1, lanetab, by), mxv_pair(x0, lanetab, by + 1),
                            mxv_pair(x1, lanetab, by + 1), b[2 * j], b[2 * j + 1]);
            }
            acc[r][0] = fmaf(c4[0] + c4[1], e8m0_to_f32((u8)sc[r][0]), acc[r][0]);
            acc[r][1] = fmaf(c4[2] + c4[3], e8m0_to_f32((u8)sc[r][1]), acc[r][1]);
        }
        ++cs;
        if (--cleft == 0) {
            const bool cont = MERGE && cu + 1 < cend && cp + 1 < parts;
            if (!cont) {  // run done: sum the quad's blocks, lane t takes set t >> 1, half t & 1
                float v = 0.0f;
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float s = acc[r][h];
                        s += __shfl_xor_sync(K3_FULL_MASK, s, 1);
                        s += __shfl_xor_sync(K3_FULL_MASK, s, 2);
                        if (t == 2 * r + h) v = s;
                    }
                const int set = t >> 1;
                emit(ca, cgrp, cp0, run, set % NM, cgrp * 16 * RT + 16 * (set / NM) + g + 8 * (t & 1), v, cok);
            }
            if (++cu < cend) c_next(cont);
        }
    };

    int lo = max(q0, jlo * per_a), hi = min(q1, (jlo + 2) * per_a);
    start(lo, hi);  // the first weights are in flight while the table is built
    mxv_fill_table(sm.tab);
    for (; jr <= jhi; jr += 2) {
        if (jr != jlo) {
            lo = max(q0, jr * per_a);
            hi = min(q1, (jr + 2) * per_a);
            start(lo, hi);
        }
        __syncthreads();  // table written (first round); the previous round is done with the x slots
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int j = jr + s;
            const int e = j <= jhi ? __ldg(idx + j) : -1;
            if (e >= 0 && e < experts) stage(sm.tab, j, s);
        }
        __syncthreads();
        cu = lo;
        cend = hi;
        if (cu < cend) c_begin();
        for (int i = 0; cu < cend; ++i) {
            mxv_wait_ring();  // step i's copies (this lane's) are in
            __syncwarp();     // ... and every lane's: the scale words; step i - 1's slot is free
            l_issue(sm.ring + ((i + MXV_STAGES - 1) % MXV_STAGES) * MXV_STAGE);
            c_step(sm.ring + (i % MXV_STAGES) * MXV_STAGE);
        }
        mxv_wait_all();
        __syncwarp();  // every lane is done with the ring before the next round refills it
    }
}

// Grid (moe/single_token.rs single_token_plan), 512 threads, MXV_SHARED dynamic shared memory (opt-in).
// gu[a, p, 0 | 1, r] = part p of W1_e[r] . z_t | W3_e[r] . z_t for every assignment a < n_assign
// with e = idx[a] in [0, experts), t = a / top_k (others: rows left as they are). Also
// zeroes sync[0 .. n_sync) (the down kernel's counters and masks). latent, inter: multiples of 128,
// latent <= 3968.
extern "C" __global__ void __launch_bounds__(512, 1)
mxfp4_experts_single_token_up_f32(const float* __restrict__ z, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                       const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ idx,
                       float* __restrict__ gu, int* __restrict__ sync, int n_sync, int top_k, int latent, int inter,
                       int experts, int n_assign, int parts) {
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < n_sync; i += blockDim.x) sync[i] = 0;
    const u8* wp[2] = {w1p, w3p};
    const u8* ws[2] = {w1s, w3s};
    auto stage = [&](u32 tab, int j, int slot) {
        const float* x = z + (i64)(j / top_k) * latent;
        mxv_stage(tab, latent, slot, [&](int col, float* v) {
            const float4 a = *reinterpret_cast<const float4*>(x + col), b = *reinterpret_cast<const float4*>(x + col + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        });
    };
    auto emit = [&](int a, int, int p, int, int m, int r, float v, bool ok) {
        if (ok) gu[(((i64)a * parts + p) * 2 + m) * inter + r] = v;
    };
    mxv_drive<2, false>(wp, ws, idx, experts, n_assign, inter, latent, parts, stage, emit);
}

// Grid from single_token_plan, 512 threads, MXV_SHARED: out [n_assign / top_k, latent] = sum over
// slots j (in order) with a valid id of w[t*k+j] * W2_e act[t*k+j], act = SiTU-GLU(sum over the
// up kernel's parts_up of gu) (built while staging). yp [n_assign, parts, latent]: run partials
// (slot = the run's first part); sync: counters [tokens, latent / 32], then part masks [n_assign,
// latent / 32], zeroed by the up kernel. latent, inter: multiples of 128, inter <= 3968.
extern "C" __global__ void __launch_bounds__(512, 1)
mxfp4_experts_single_token_down_f32(const float* __restrict__ gu, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                         const int* __restrict__ idx, const float* __restrict__ w, float* __restrict__ yp,
                         int* __restrict__ sync, float* __restrict__ out, int top_k, int latent, int inter,
                         float beta, float beta_lin, int has_lin, int experts, int n_assign, int parts_up, int parts) {
    const u8* wp[1] = {w2p};
    const u8* ws[1] = {w2s};
    const int groups = latent / 32, lane = threadIdx.x & 31;
    int* cnt = sync;
    int* mask = sync + (n_assign / top_k) * groups;
    auto stage = [&](u32 tab, int j, int slot) {
        const float* base = gu + (i64)j * parts_up * 2 * inter;
        mxv_stage(tab, inter, slot, [&](int col, float* v) {
            mx_glu_parts8(base, parts_up, inter, col, beta, beta_lin, has_lin, v);
        });
    };
    // Every lane: its row's run partial; then the warp counts the run and, if it completes the
    // (token, group), combines the group's 32 rows (lane l: row 32 grp + l).
    auto emit = [&](int a, int grp, int p, int run, int, int r, float v, bool ok) {
        if (ok) yp[((i64)a * parts + p) * latent + r] = v;
        __syncwarp();  // every lane's partial is ordered before lane 0's release below
        const int tok = a / top_k;
        int last = 0;
        if (lane == 0) {
            if (ok) atomicOr(mask + a * groups + grp, 1 << p);
            mxv_fence();  // release: the partials and the mask bit before the count
            last = atomicAdd(cnt + tok * groups + grp, run) + run == top_k * parts;
            if (last) mxv_fence();  // acquire: every other run's partials and bits
        }
        if (!__shfl_sync(K3_FULL_MASK, last, 0)) return;
        __syncwarp();  // lane 0's acquire orders the reads of every lane below
        // Two round trips for the common case: lane j loads slot j's mask, id and weight; then the
        // first two runs of 16 slots at a time are loaded at once (a row is rarely cut into more
        // by the warp split; further runs are read one by one). Sum: slots in order, each slot's
        // runs in part order.
        const int row = 32 * grp + lane;
        float o = 0.0f;
        for (int j0 = 0; j0 < top_k; j0 += 32) {
            const int jj = j0 + lane, aj = tok * top_k + jj;
            const int e = jj < top_k ? __ldg(idx + aj) : -1;
            const bool use = e >= 0 && e < experts;
            const u32 m = use ? (u32)__ldcg(mask + aj * groups + grp) : 0u;
            const float wj = use ? w[aj] : 0.0f;
            for (int c = j0; c < j0 + 32 && c < top_k; c += 16) {
                float v0[16], v1[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    const u32 mu = __shfl_sync(K3_FULL_MASK, m, (c - j0 + u) & 31), rest = mu & (mu - 1u);
                    const float* yr = yp + (i64)(tok * top_k + c + u) * parts * latent + row;
                    v0[u] = mu ? __ldcg(yr + (i64)(__ffs((int)mu) - 1) * latent) : 0.0f;
                    v1[u] = rest ? __ldcg(yr + (i64)(__ffs((int)rest) - 1) * latent) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    const u32 mu = __shfl_sync(K3_FULL_MASK, m, (c - j0 + u) & 31);
                    const float wu = __shfl_sync(K3_FULL_MASK, wj, (c - j0 + u) & 31);
                    if (c + u >= top_k || !mu) continue;
                    float sum = v0[u] + v1[u];
                    const float* yr = yp + (i64)(tok * top_k + c + u) * parts * latent + row;
                    for (u32 more = mu & (mu - 1u) & (mu & (mu - 1u)) - 1u; more; more &= more - 1u)
                        sum += __ldcg(yr + (i64)(__ffs((int)more) - 1) * latent);
                    o += wu * sum;
                }
            }
        }
        out[(i64)tok * latent + row] = o;
    };
    mxv_drive<1, true>(wp, ws, idx, experts, n_assign, latent, inter, parts, stage, emit);
}
