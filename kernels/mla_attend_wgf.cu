// Absorbed MLA decode attend on Hopper wgmma, the block pair split by features (ops.rs
// MlaDecodeMode::WgFeatures): the contract of mla_attend_wg2_f32 (kernels/mla_attend_wg.cu) - qt
// [items, H, row], the paged f32 latent cache, per-item splits (chunk <= 0), partials [items, H,
// splits, kv_lora + 2] for mla_merge_f32 or, with final_rows (one split), the latent [items, H,
// kv_lora] - and its rounding (q~ * scale and the rows rounded to bf16, f32 scores and online
// softmax over 64-position tiles, P rounded to bf16): emulators.py runs the same emulator for both.
//
// Why this shape. mla_attend_wg2_f32 splits the 96 heads of a pair between its two blocks, so each
// block needs every feature of every row: the pair sends half of each tile to the partner (36 KB
// per tile and block, st.async), each tile is 72 KB of shared memory (only two fit next to Q^T),
// and its m64n48 products re-read the tile once per 48 heads. Here the two blocks split the row
// instead: block r holds value columns [256 r, 256 r + 256) and rope features [512 + 32 r, + 32) of
// every position, for all 96 heads.
// - S^T = K Q^T over the block's 288 features gives partial scores of all 96 heads; warpgroup c
//   computes those of heads [48 c, 48 c + 48) (m64n48, 18 k-steps) and sends them to block c (its
//   own when c = r, by st.async otherwise). Block r's softmax sums the two partials of its 48 heads
//   (f32), as the whole-row S^T would, up to the order of the f32 additions.
// - P^T of its heads and their rescale factors go to both blocks (local stores + st.async), so each
//   block runs O^T += V^T P^T for its 256 value columns over all 96 heads (m64n96: the tile is read
//   once per product, not once per 48 heads).
// - No tile crosses the cluster, a tile is 40 KB (4 value slabs + the rope quarter in a fifth slab),
//   and three fit: the producer runs up to two tiles ahead of the consumers.
// - Per block and tile the producer loads 64 positions x 1152 contiguous bytes (the same bytes as
//   wg2's 32 whole rows) and stores 36 KB to its own ring only; named barriers FULL / EMPTY per slot
//   as in mla_attend_wg_f32. Thread (c8 = tid % 8, rs = tid / 8) owns positions rs + 16 a (a =
//   0..3) and float4 columns c8 + 8 k of the block's part (k < 8: the value part; k = 8: rope).
// - Cross-block traffic per tile and block: 12 KB of partial scores out, 6 KB of P^T + 192 B of
//   rescale factors out, each counted by the receiver's mbarrier (expect_tx by one local thread
//   per tile). A warpgroup sends its next tile's partial scores only after the other warpgroup's
//   P V of this tile is done (named barrier PFREE): the partner answers them with P^T rows and rescale
//   factors that overwrite what that P V reads.
// - The epilogue stages o~^T (96 heads x 256 columns) through the idle ring and writes whole row
//   halves; with final_rows the partner's 1 / l of its heads arrives by st.async (mbarrier L).
// Layouts and descriptors are mla_attend_wg.cu's (128-byte swizzle, 1024-aligned slabs), with 96
// rows per Q^T slab and P^T [96][64]. The rope slab uses its first 4 chunks (k-steps 0 and 1).
#include "tensor_core.cuh"
#include "wgmma_sm90.cuh"

#define MLF_HEADS 96     // heads per block pair: the n of the P V products
#define MLF_HALF 48      // heads whose softmax a block owns: the n of S^T
#define MLF_POS 64       // positions per tile
#define MLF_ROW 576      // largest latent row
#define MLF_VCOLS 256    // value columns per block
#define MLF_SLABS 5      // 4 value slabs + the rope slab (32 of its 64 features used)
#define MLF_KSTEPS 18    // k16 steps of S^T: 4 slabs x 4 + 2
#define MLF_RING 3
#define MLF_THREADS 384
#define MLF_CONSUMERS 256
#ifndef MLF_P16
#define MLF_P16 0        // harness-only: 16 lanes per position in the producer (see there)
#endif
#ifndef MLF_NB
#define MLF_NB (MLF_P16 ? 4 : 2)  // positions per producer batch
#endif
// Harness-only timing probes (benchmarks.py bench_mla_diag, never built by the host): 1 = the
// consumers skip their math and exchanges (producer-bound time), 2 = the producer skips its global
// loads, + 4 = no partial scores cross the pair, + 8 = no P^T rows or factors cross it (4 and 8
// compute garbage on purpose). 0 in every real build.
#ifndef MLF_DIAG
#define MLF_DIAG 0
#endif
#define MLF_SSTR 68      // f32 per score row
#define MLF_OSTR 260     // f32 per staged o~ row in the epilogue

// Dynamic shared memory (bytes from the 1024-aligned base); geometry.rs MLA_WGF_SHARED must match.
#define MLF_QSLAB (MLF_HEADS * 128)                            // 12288
#define MLF_KSLAB (MLF_POS * 128)                              // 8192
#define MLF_KTILE (MLF_SLABS * MLF_KSLAB)                      // 40960
#define MLF_OFF_K (MLF_SLABS * MLF_QSLAB)                      // Q^T [5][96][64] bf16
#define MLF_OFF_P (MLF_OFF_K + MLF_RING * MLF_KTILE)           // tiles [3][5][64][64] bf16
#define MLF_OFF_S (MLF_OFF_P + MLF_HEADS * 128)                // P^T [96][64] bf16
#define MLF_OFF_C (MLF_OFF_S + 2 * MLF_HALF * MLF_SSTR * 4)    // scores: own [48][68], partner's [48][68]
#define MLF_OFF_L (MLF_OFF_C + MLF_HEADS * 4)                  // rescale factors [96] f32
#define MLF_OFF_BAR (MLF_OFF_L + MLF_HEADS * 4)                // 1 / l [96] f32
#define MLF_END (MLF_OFF_BAR + 24)                             // mbarriers SC, P, L
#define MLF_SHARED (MLF_END + 1024)                            // + slack to align the base: 224536 B
#define MLF_SC_TX (MLF_HALF * MLF_POS * 4)                     // partial scores the partner sends
#define MLF_P_TX (MLF_HALF * MLF_POS * 2 + MLF_HALF * 4)       // P^T rows + rescale factors
#define MLF_L_TX (MLF_HALF * 4)                                // 1 / l of its heads

#define MLF_BAR_A 1      // consumers: Q staged / own scores stored / ring idle for the epilogue
#define MLF_BAR_B 2      // consumers: P^T and rescale stored / o~ staged
#define MLF_BAR_FULL 3   // + slot: producer arrives, consumers wait
#define MLF_BAR_EMPTY 6  // + slot: consumers arrive, producer waits
#define MLF_BAR_PFREE 9  // warpgroup r arrives after its P V, warpgroup 1 - r waits before sending

static_assert(MLF_OFF_K % 1024 == 0 && MLF_OFF_P % 1024 == 0 && MLF_QSLAB % 1024 == 0, "SW128 atoms");
static_assert(MLF_HEADS * MLF_OSTR * 4 <= MLF_RING * MLF_KTILE, "o~ staging fits in the ring");
static_assert(MLF_OFF_BAR % 8 == 0 && MLF_SHARED == 224536, "keep geometry.rs MLA_WGF_SHARED in step");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mlf_attend(const float* __restrict__ qt, const float* __restrict__ arena,
                                           const i64* __restrict__ page_start, const int* __restrict__ pt_base,
                                           const int* __restrict__ lens, float* __restrict__ part, int items,
                                           int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk,
                                           float scale, int final_rows) {
    extern __shared__ __align__(1024) unsigned char mlf_raw[];
    const u32 raw_a = (u32)__cvta_generic_to_shared(mlf_raw);
    const u32 sm_a = (raw_a + 1023u) & ~1023u;
    unsigned char* sm = mlf_raw + (sm_a - raw_a);
    const int h0 = (int)(blockIdx.x >> 1) * MLF_HEADS, n = blockIdx.y, spl = blockIdx.z;
    const int row = kv_lora + rope;
    // Uniform over the pair (same item and split), so both blocks reach the cluster barriers.
    if (n >= items || row > MLF_ROW || kv_lora > 2 * MLF_VCOLS || page_tokens <= 0 || (final_rows && splits != 1))
        return;
    const int tid = threadIdx.x;
    const u32 rank = mlw_cluster_rank(), peer = rank ^ 1u;
    const int len = lens[n], base = pt_base[n];
    const int ch = chunk > 0 ? chunk : (len + splits - 1) / splits;
    const int j0 = spl * ch, j1 = min(len, j0 + ch);
    const int tiles = j1 > j0 ? (j1 - j0 + MLF_POS - 1) / MLF_POS : 0;
    const u32 bar_a = sm_a + MLF_OFF_BAR;  // SC (partner's partial scores), P (its P^T rows), L (its 1 / l)
    if (tid == 0) {
        mlw_mbar_init(bar_a, 1);
        mlw_mbar_init(bar_a + 8, 1);
        mlw_mbar_init(bar_a + 16, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    mlw_cluster_arrive();  // waited on before each role's first use of the partner

    if (tid < 128) {
        // ---------------- producer warpgroup: this block's part of every row ----------------
#if MLF_P16
        // 16 lanes per position (a warp instruction reads 2 x 256 contiguous bytes): positions rs + 8 a,
        // float4 k < 4 at value features 64 k + 4 c of the part, k = 4 the rope (lanes c < 8 only).
        const int c = tid & 15, rs = tid >> 4;
        constexpr int PP = 8, NK = 5, RSTEP = 8;
        auto has = [&](int k) { return k < 4 || c < 8; };
        auto feat = [&](int k) { return k < 4 ? MLF_VCOLS * (int)rank + 64 * k + 4 * c : 512 + 32 * (int)rank + 4 * c; };
        auto soff = [&](int k) -> u32 {
            return (u32)k * MLF_KSLAB + ((((u32)c >> 1) ^ (u32)(rs & 7)) << 4) + (((u32)c & 1u) << 3);
        };
#else
        // 8 lanes per position: positions rs + 16 a, float4 k < 8 at value features 32 k + 4 c, k = 8 the rope.
        const int c = tid & 7, rs = tid >> 3;
        constexpr int PP = 4, NK = 9, RSTEP = 16;
        auto has = [&](int) { return true; };
        auto feat = [&](int k) { return k < 8 ? MLF_VCOLS * (int)rank + 32 * k + 4 * c : 512 + 32 * (int)rank + 4 * c; };
        auto soff = [&](int k) -> u32 {
            const u32 chunk16 = k < 8 ? 4u * (u32)(k & 1) + (u32)(c >> 1) : (u32)(c >> 1);
            const u32 slab = k < 8 ? (u32)(k >> 1) : 4u;
            return slab * MLF_KSLAB + ((chunk16 ^ (u32)(rs & 7)) << 4) + ((u32)(c & 1) << 3);
        };
#endif
        const int total = tiles * PP;
        auto pos_of = [&](int u) { return j0 + MLF_POS * (u / PP) + rs + RSTEP * (u % PP); };
        auto live = [&](int u) { return u < total && pos_of(u) < j1; };
        auto page_of = [&](int u) -> i64 {
            return (MLF_DIAG & 2) != 0 ? 0 : page_start[base + pos_of(u) / page_tokens];
        };
        auto row_ptr = [&](int u, i64 pg) { return arena + pg + (i64)(pos_of(u) % page_tokens) * row; };
        i64 pg[MLF_NB], pgn[MLF_NB];  // page starts of this batch and of the next
#pragma unroll
        for (int b = 0; b < MLF_NB; ++b) {
            pg[b] = live(b) ? page_of(b) : 0;
            pgn[b] = live(MLF_NB + b) ? page_of(MLF_NB + b) : 0;
        }
        mlw_cluster_wait();  // pairs the arrive above; the producer never touches the partner
#pragma unroll 1
        for (int u0 = 0; u0 < total; u0 += MLF_NB) {
            float4 v[MLF_NB][NK];
#pragma unroll
            for (int b = 0; b < MLF_NB; ++b) {
                const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const int u = u0 + b;
                if (live(u)) {
                    const float* src = row_ptr(u, pg[b]);
                    const bool aligned = ((reinterpret_cast<size_t>(src) | ((size_t)row * 4)) & 15) == 0;
#pragma unroll
                    for (int k = 0; k < NK; ++k) {
                        const int f = feat(k);
                        if (!has(k)) {
                            v[b][k] = z;
                        } else if ((MLF_DIAG & 2) != 0) {
                            v[b][k] = make_float4(__int_as_float(f + u), 1.0f, 2.0f, 3.0f);
                        } else if (aligned) {  // row % 4 == 0: a float4 is all in or all out
                            v[b][k] = f >= row ? z : ld_stream_f4(src + f);
                        } else {
                            v[b][k].x = f < row ? ld_stream_f1(src + f) : 0.0f;
                            v[b][k].y = f + 1 < row ? ld_stream_f1(src + f + 1) : 0.0f;
                            v[b][k].z = f + 2 < row ? ld_stream_f1(src + f + 2) : 0.0f;
                            v[b][k].w = f + 3 < row ? ld_stream_f1(src + f + 3) : 0.0f;
                        }
                    }
                } else {  // past the split: zero rows (scores are masked, but V must not be garbage)
#pragma unroll
                    for (int k = 0; k < NK; ++k) v[b][k] = z;
                }
            }
#pragma unroll
            for (int b = 0; b < MLF_NB; ++b) {
                pg[b] = pgn[b];
                pgn[b] = live(u0 + 2 * MLF_NB + b) ? page_of(u0 + 2 * MLF_NB + b) : 0;
            }
#pragma unroll
            for (int b = 0; b < MLF_NB; ++b) {
                const int u = u0 + b;
                if (u >= total) break;  // uniform over the warpgroup
                const int t = u / PP, a = u % PP, slot = t % MLF_RING;
                if (a == 0 && t >= MLF_RING) mlw_bar_sync(MLF_BAR_EMPTY + slot, MLF_THREADS);  // tile t - 3 done
                unsigned char* dst = sm + MLF_OFF_K + slot * MLF_KTILE + (rs + RSTEP * a) * 128;
#pragma unroll
                for (int k = 0; k < NK; ++k)
                    if (has(k))
                        *reinterpret_cast<uint2*>(dst + soff(k)) =
                            make_uint2(tc_pack_bf16(v[b][k].x, v[b][k].y), tc_pack_bf16(v[b][k].z, v[b][k].w));
                if (a == PP - 1) {
                    mlw_fence_async();
                    mlw_bar_arrive(MLF_BAR_FULL + slot, MLF_THREADS);
                }
            }
        }
        mlw_cluster_arrive();  // neither block leaves while the other may still signal it
        mlw_cluster_wait();
        return;
    }

    // ---------------- consumer warpgroups ----------------
    const int ct = tid - 128, cwg = ct >> 7, cw = ct >> 5, lane = tid & 31;
    const int wl = cw & 3, g = lane >> 2, t4 = lane & 3;
    float* sc_own = reinterpret_cast<float*>(sm + MLF_OFF_S);
    float* sc_rcv = sc_own + MLF_HALF * MLF_SSTR;
    float* cs = reinterpret_cast<float*>(sm + MLF_OFF_C);
    float* ls = reinterpret_cast<float*>(sm + MLF_OFF_L);
    u16* ps = reinterpret_cast<u16*>(sm + MLF_OFF_P);

    // Q^T: bf16(q~ * scale) of the 96 heads over this block's features (36 chunks of 8 per head:
    // 32 value chunks, 4 rope chunks), zero past the row and past the last head.
    {
        constexpr int CH = 36, NQ = MLF_HEADS * CH;
        const bool q16 = ((reinterpret_cast<size_t>(qt) | ((size_t)row * 4)) & 15) == 0;
#pragma unroll 1
        for (int r0 = 0; r0 < NQ; r0 += 7 * MLF_CONSUMERS) {
            float4 x[7][2];
#pragma unroll
            for (int i = 0; i < 7; ++i) {
                const int e = r0 + ct + i * MLF_CONSUMERS, hl = e / CH, c = e - hl * CH, h = h0 + hl;
                const int f0 = c < 32 ? MLF_VCOLS * (int)rank + 8 * c : 512 + 32 * (int)rank + 8 * (c - 32);
                const float* src = qt + ((i64)n * heads + min(h, heads - 1)) * row + f0;
                const bool any = e < NQ && h < heads && f0 < row;
                if (any && q16) {
                    x[i][0] = __ldg(reinterpret_cast<const float4*>(src));
                    x[i][1] = f0 + 4 < row ? __ldg(reinterpret_cast<const float4*>(src + 4))
                                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                } else {
                    float y[8];
#pragma unroll
                    for (int k = 0; k < 8; ++k) y[k] = any && f0 + k < row ? __ldg(src + k) : 0.0f;
                    x[i][0] = make_float4(y[0], y[1], y[2], y[3]);
                    x[i][1] = make_float4(y[4], y[5], y[6], y[7]);
                }
            }
#pragma unroll
            for (int i = 0; i < 7; ++i) {
                const int e = r0 + ct + i * MLF_CONSUMERS, hl = e / CH, c = e - hl * CH;
                const int slab = c < 32 ? c >> 3 : 4, c16 = c < 32 ? c & 7 : c - 32;
                if (e < NQ)
                    *reinterpret_cast<uint4*>(sm + slab * MLF_QSLAB + hl * 128 + ((c16 ^ (hl & 7)) << 4)) =
                        make_uint4(tc_pack_bf16(x[i][0].x * scale, x[i][0].y * scale),
                                   tc_pack_bf16(x[i][0].z * scale, x[i][0].w * scale),
                                   tc_pack_bf16(x[i][1].x * scale, x[i][1].y * scale),
                                   tc_pack_bf16(x[i][1].z * scale, x[i][1].w * scale));
            }
        }
    }
    mlw_fence_async();
    mlw_bar_sync(MLF_BAR_A, MLF_CONSUMERS);
    mlw_cluster_wait();  // the partner's mbarriers are initialised
    const u32 bar_sc = bar_a, bar_p = bar_a + 8, bar_l = bar_a + 16;
    const u32 peer_sm = mlw_mapa(sm_a, peer);
    const u32 peer_sc = peer_sm + MLF_OFF_S + MLF_HALF * MLF_SSTR * 4, peer_bar = mlw_mapa(bar_a, peer);
    if (ct == 0) mlw_mbar_arrive_tx(bar_l, MLF_L_TX);

    float acc[2][48];  // o~^T: value columns 64 (2 cwg + m) + fragment row, the 96 heads as columns
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < 48; ++i) acc[m][i] = 0.0f;
    // Softmax of this block's heads 48 r + (6 cw .. 6 cw + 5): half-warp hw the three heads from
    // 6 cw + 3 hw, lane q = lane % 16 the positions 4 q .. 4 q + 3 (mla_attend_wg.cu's mapping).
    constexpr int NH = 3;
    const int hl0 = 6 * cw + 3 * (lane >> 4), q16 = lane & 15;
    auto heads_sum = [&](float x) {
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        return x;
    };
    float m_run[NH], l_lane[NH];
#pragma unroll
    for (int i = 0; i < NH; ++i) {
        m_run[i] = K3_NEG_INF;
        l_lane[i] = 0.0f;
    }
    const u32 q_a = sm_a, p_a = sm_a + MLF_OFF_P;
    const u64 d_k = mlw_desc(0, 16, 1024), d_vt = mlw_desc(0, 8192, 1024);
    const bool own_heads = cwg == (int)rank;  // this warpgroup's S^T heads are this block's

#pragma unroll 1
    for (int t = 0; t < tiles; ++t) {
        const int slot = t % MLF_RING;
        const u32 k_a = sm_a + MLF_OFF_K + slot * MLF_KTILE;
        if (ct == 0) {  // this tile's phases: the partner's partial scores, then its P^T rows
            if ((MLF_DIAG & 5) == 0) mlw_mbar_arrive_tx(bar_sc, MLF_SC_TX);
            if ((MLF_DIAG & 9) == 0) mlw_mbar_arrive_tx(bar_p, MLF_P_TX);
        }
        mlw_bar_sync(MLF_BAR_FULL + slot, MLF_THREADS);
        if ((MLF_DIAG & 1) == 0) {
        {
            // Partial S^T of heads [48 cwg, 48 cwg + 48) over this block's features.
            float s[24];
#pragma unroll
            for (int i = 0; i < 24; ++i) s[i] = 0.0f;
            mlw_pin(s);
            mlw_wg_fence();
#pragma unroll
            for (int kk = 0; kk < MLF_KSTEPS; ++kk) {
                const u32 off = (u32)(kk >> 2) * MLF_KSLAB + (u32)(kk & 3) * 32u;
                const u32 qoff = (u32)(kk >> 2) * MLF_QSLAB + (u32)cwg * (MLF_HALF * 128) + (u32)(kk & 3) * 32u;
                mlw_mma_kmajor(s, d_k + ((k_a + off) >> 4), d_k + ((q_a + qoff) >> 4));
            }
            mlw_wg_commit();
            mlw_wg_wait0();
            mlw_pin(s);
            if (own_heads) {
#pragma unroll
                for (int j = 0; j < 6; ++j)
#pragma unroll
                    for (int v = 0; v < 4; ++v)
                        sc_own[(8 * j + 2 * t4 + (v & 1)) * MLF_SSTR + 16 * wl + g + 8 * (v >> 1)] = s[4 * j + v];
            } else if ((MLF_DIAG & 4) == 0) {
                // The other warpgroup's P V of tile t - 1 is done: the partner's answer may overwrite P^T.
                if (t > 0) mlw_bar_sync(MLF_BAR_PFREE, MLF_CONSUMERS);
#pragma unroll
                for (int j = 0; j < 6; ++j)
#pragma unroll
                    for (int v = 0; v < 4; ++v)
                        mlw_st_async4(peer_sc + 4u * (u32)((8 * j + 2 * t4 + (v & 1)) * MLF_SSTR + 16 * wl + g +
                                                           8 * (v >> 1)),
                                      s[4 * j + v], peer_bar);
            }
        }
        mlw_bar_sync(MLF_BAR_A, MLF_CONSUMERS);  // own partial stored
        if ((MLF_DIAG & 4) == 0) mlw_mbar_wait(bar_sc, (u32)t & 1u);  // the partner's partial arrived

        // Online softmax of this block's 48 heads over the summed partials; P^T rows and the
        // rescale factors to both blocks.
        {
            const int p0 = j0 + t * MLF_POS + 4 * q16;
            float sc[NH][4], mx[NH];
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const float4 a = *reinterpret_cast<const float4*>(sc_own + (hl0 + i) * MLF_SSTR + 4 * q16);
                const float4 b = *reinterpret_cast<const float4*>(sc_rcv + (hl0 + i) * MLF_SSTR + 4 * q16);
                sc[i][0] = p0 < j1 ? a.x + b.x : K3_NEG_INF;
                sc[i][1] = p0 + 1 < j1 ? a.y + b.y : K3_NEG_INF;
                sc[i][2] = p0 + 2 < j1 ? a.z + b.z : K3_NEG_INF;
                sc[i][3] = p0 + 3 < j1 ? a.w + b.w : K3_NEG_INF;
                mx[i] = fmaxf(fmaxf(sc[i][0], sc[i][1]), fmaxf(sc[i][2], sc[i][3]));
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1)
#pragma unroll
                for (int i = 0; i < NH; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], off));
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const int hg = MLF_HALF * (int)rank + hl0 + i;  // head within the pair
                const float mn = fmaxf(m_run[i], mx[i]);  // finite: every tile has a valid position
                const float corr = m_run[i] == K3_NEG_INF ? 0.0f : __expf(m_run[i] - mn);
                u16 pb[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) pb[k] = f32_to_bf16_bits(p0 + k < j1 ? __expf(sc[i][k] - mn) : 0.0f);
                const u32 px = (u32)pb[0] | ((u32)pb[1] << 16), py = (u32)pb[2] | ((u32)pb[3] << 16);
                const u32 poff = (u32)hg * 128u + ((((u32)q16 >> 1) ^ (u32)(hg & 7)) << 4) + 8u * (u32)(q16 & 1);
                *reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(ps) + poff) = make_uint2(px, py);
                if ((MLF_DIAG & 8) == 0) mlw_st_async8(peer_sm + MLF_OFF_P + poff, px, py, peer_bar + 8);
                l_lane[i] = l_lane[i] * corr + ((bf16_bits_to_f32(pb[0]) + bf16_bits_to_f32(pb[1])) +
                                                (bf16_bits_to_f32(pb[2]) + bf16_bits_to_f32(pb[3])));
                m_run[i] = mn;
                if (q16 == 0) {
                    cs[hg] = corr;
                    if ((MLF_DIAG & 8) == 0) mlw_st_async4(peer_sm + MLF_OFF_C + 4u * (u32)hg, corr, peer_bar + 8);
                }
            }
            mlw_fence_async();
        }
        mlw_bar_sync(MLF_BAR_B, MLF_CONSUMERS);  // own P^T rows and factors stored
        if ((MLF_DIAG & 8) == 0) mlw_mbar_wait(bar_p, (u32)t & 1u);  // the partner's arrived
        mlw_fence_async();                        // they came by st.async: before wgmma reads them

        // o~^T = corr o~^T + V^T P^T for value columns 64 (2 cwg + m) ..: 2 m-tiles x 4 k-steps, n96.
#pragma unroll
        for (int j = 0; j < 12; ++j) {
            const float2 c = *reinterpret_cast<const float2*>(cs + 8 * j + 2 * t4);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                acc[m][4 * j + 0] *= c.x;
                acc[m][4 * j + 1] *= c.y;
                acc[m][4 * j + 2] *= c.x;
                acc[m][4 * j + 3] *= c.y;
            }
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) mlw_pin<48>(acc[m]);
        mlw_wg_fence();
#pragma unroll
        for (int ks = 0; ks < MLF_POS / 16; ++ks)
#pragma unroll
            for (int m = 0; m < 2; ++m)
                mlw_mma96_amajor_m(acc[m], d_vt + ((k_a + (u32)(2 * cwg + m) * MLF_KSLAB + (u32)ks * 2048u) >> 4),
                                   d_k + ((p_a + (u32)ks * 32u) >> 4));
        mlw_wg_commit();
        mlw_wg_wait0();
#pragma unroll
        for (int m = 0; m < 2; ++m) mlw_pin<48>(acc[m]);
        if (own_heads && t + 1 < tiles && (MLF_DIAG & 4) == 0) mlw_bar_arrive(MLF_BAR_PFREE, MLF_CONSUMERS);
        }  // MLF_DIAG & 1
        if (t + MLF_RING < tiles) mlw_bar_arrive(MLF_BAR_EMPTY + slot, MLF_THREADS);
    }

    // Epilogue. l of this block's heads: 1 / l to both blocks (final rows), m and l to the partials.
    float* out = part + ((i64)n * heads * splits + spl) * (final_rows ? kv_lora : kv_lora + 2);
    const i64 hstride = (i64)splits * (final_rows ? kv_lora : kv_lora + 2);
#pragma unroll
    for (int i = 0; i < NH; ++i) {
        const float l = heads_sum(l_lane[i]);
        const int hg = MLF_HALF * (int)rank + hl0 + i;
        if (q16 == 0) {
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            ls[hg] = inv;
            mlw_st_async4(peer_sm + MLF_OFF_L + 4u * (u32)hg, inv, peer_bar + 16);
            if (!final_rows && h0 + hg < heads) {
                out[(h0 + hg) * hstride + kv_lora] = m_run[i];
                out[(h0 + hg) * hstride + kv_lora + 1] = l;
            }
        }
    }
    mlw_bar_sync(MLF_BAR_A, MLF_CONSUMERS);  // every P V is done reading the ring
    float* os = reinterpret_cast<float*>(sm + MLF_OFF_K);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 12; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v)
                os[(8 * j + 2 * t4 + (v & 1)) * MLF_OSTR + 64 * (2 * cwg + m) + 16 * wl + g + 8 * (v >> 1)] =
                    acc[m][4 * j + v];
    mlw_mbar_wait(bar_l, 0u);  // the partner's 1 / l
    mlw_bar_sync(MLF_BAR_B, MLF_CONSUMERS);
    // Warp cw writes head rows cw, cw + 8, ..: this block's value columns of each.
    const int hn = min(MLF_HEADS, heads - h0), c0 = MLF_VCOLS * (int)rank;
    const int vc = min(MLF_VCOLS, kv_lora - c0);
    for (int hd = cw; hd < hn; hd += 8) {
        float* dst = out + (h0 + hd) * hstride + c0;
        const float* srow = os + hd * MLF_OSTR;
        const float f = final_rows ? ls[hd] : 1.0f;  // mla_merge_f32's o~ * (1 / l) for one split
        if ((kv_lora & 1) == 0) {
            for (int c = 2 * lane; c < vc; c += 64) {
                const float2 x = *reinterpret_cast<const float2*>(srow + c);
                *reinterpret_cast<float2*>(dst + c) = final_rows ? make_float2(x.x * f, x.y * f) : x;
            }
        } else {
            for (int c = lane; c < vc; c += 32) dst[c] = final_rows ? srow[c] * f : srow[c];
        }
    }
    __syncwarp();
    mlw_cluster_arrive();
    mlw_cluster_wait();
}
#endif

// Grid (2 * ceil(H / 96), items, splits) in clusters of 2, 384 threads, MLF_SHARED bytes.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(MLF_THREADS, 1)
mla_attend_wgf_f32(const float* __restrict__ qt, const float* __restrict__ arena, const i64* __restrict__ page_start,
                   const int* __restrict__ pt_base, const int* __restrict__ lens, float* __restrict__ part, int items,
                   int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk, float scale,
                   int final_rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    mlf_attend(qt, arena, page_start, pt_base, lens, part, items, heads, kv_lora, rope, page_tokens, splits, chunk,
               scale, final_rows);
#else
    __trap();  // wgmma needs sm_90a: ops.rs only dispatches here on it
#endif
}
