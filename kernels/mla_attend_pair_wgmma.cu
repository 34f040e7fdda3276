// Absorbed MLA decode attend on Hopper wgmma, clusters of two blocks (mla_attend_pair_wgmma_f32: the MLA
// decode attend on sm_90a; ops.rs mla_decode). The contract of mla_attend_bf16_f32
// (kernels/mla_attend_bf16.cu, the fallback elsewhere) unchanged - qt [items, H, row], the paged f32
// latent cache, per-item splits (chunk <= 0), partials [items, H, splits, kv_lora + 2] (o~
// unnormalised, m, l; empty splits: 0, -inf, 0) for mla_merge_f32 - and its rounding: q~ * scale
// and the rows rounded to bf16 (RNE), f32 scores and online softmax, P rounded to bf16 for P V and
// the row sums. Only the tile differs (64 positions here, 32 there): emulators.py runs
// _emu_mla_attend_bf16 with tile=64 for it.
// final_rows = 1 (one split only; ops.rs when geometry::mla_splits_wg picks 1): the partial is
// already the answer, so the epilogue writes o~ * (1 / l) - mla_merge_f32's arithmetic, bitwise -
// as the latent [items, H, kv_lora] into `part` and the merge launch is skipped.
//
// Why this shape. The mma.sync kernel is capped by ldmatrix traffic and its per-tile latency
// chain; here the tensor cores read the staged tile straight from shared memory.
// - Transposed products, 48 heads as the N dimension (no padding to m64): S^T = K Q^T is
//   m64 (positions) x n48 (heads) x k576 with A = the bf16 tile (K-major) and B = Q^T (K-major);
//   O^T += V^T P^T is m64 (value columns) x n48 x k16 (positions) with A = the same tile read
//   M-major (imm-trans-a) and B = P^T. Each cached row is converted and stored once, read by both
//   products. o~^T (512 x 48 f32 = 96 KB) lives in the registers of the two consumer warpgroups,
//   96 per thread (m64n48 fragments of value columns [256 c, 256 c + 256) in warpgroup c).
// - 384 threads: warpgroup 0 produces (f32 rows -> registers -> bf16 -> the swizzled tile),
//   warpgroups 1 and 2 consume. Warpgroup 1 computes S^T for the whole tile: the tensor core is
//   shared by the SM, so splitting the 36 k-steps over both warpgroups would not make them finish
//   sooner, and it would need a second 12 KB score buffer that does not fit.
// - Scores go through shared memory (sp [48][68] f32) to the softmax: half a warp per 3 heads,
//   4 consecutive positions per lane. One shuffle reduction per head and tile, l kept per lane.
//   P^T (bf16, swizzled [48][64]) and the per-head rescale go back through shared memory.
// - Ring of two 64-position bf16 tiles (2 x 72 KB) + Q^T (54 KB) + P^T + scores: 223 KB, one CTA per
//   SM.
// - No L2 prefetch of the next tile: the prefetch needs the page start, a dependent global load
//   that stalls the producer warp once per batch, and it was slower at every measured shape.
// - The consumers stage Q^T (7 chunks per thread per round, loads first) while the producer fetches
//   tile 0; at the end o~^T goes through the idle ring to whole-row float2 stores of the partials.
// - No setmaxnreg: 384 x 168 registers fit all roles (ptxas: 168, no spills).
// The producer bounds it (f32 rows through registers to bf16), so the two head-group blocks of an
// (item, split) form a cluster: block r loads positions 32 r .. 32 r + 31 of every tile (4 per
// producer thread, in MLW_NB batches) and stores each bf16 chunk into its own ring and, by
// st.async, into the partner's (same offsets). Each row is read once per pair. The ring barriers
// are mbarriers: full[slot] = 128 local producer arrivals, one carrying expect_tx of the
// partner's 36,864 bytes (the st.async complete_tx releases them, no cluster fence per store);
// empty[slot] = lane 0 of all 16 consumer warps of the pair (local + remote arrive), since each
// producer writes both rings. Consumers fence.proxy.async after the full wait (the partner's
// half was written by st.async, not by a local writer that fenced). Grid x is rounded up to
// pairs (a block past the last head still loads for its partner and writes nothing).
//
// Shared-memory layouts (128-byte swizzle, every slab base 1024-aligned; "chunk" = 16 bytes):
//   tile: element (pos p, feature f) at slab(f / 64) * 8192 + p * 128 + ((f / 8 % 8) ^ (p % 8)) * 16 + (f % 8) * 2
//   Q^T:  element (head h, feature f) at slab(f / 64) * 6144 + h * 128 + ((f / 8 % 8) ^ (h % 8)) * 16 + (f % 8) * 2
//   P^T:  element (head h, pos p) at h * 128 + ((p / 8) ^ (h % 8)) * 16 + (p % 8) * 2
// Descriptors (PTX "matrix descriptor": start >> 4 | LBO >> 4 << 16 | SBO >> 4 << 32 | 1 << 62 = 128B):
//   S^T, k-step kk (0..35): A = tile + (kk / 4) * 8192 + (kk % 4) * 32, K-major, SBO = 1024 (8 rows
//     of 128 B), LBO unused (16); B = Q^T + (kk / 4) * 6144 + (kk % 4) * 32, same fields.
//   O^T, m-tile (slab) s, k-step ks (positions 16 ks..): A = tile + s * 8192 + ks * 2048, M-major
//     (trans-a = 1): rows of 128 B are 64 value columns, consecutive rows are positions, SBO = 1024
//     (next 8 positions), LBO = 8192 (next 64 columns; unused at M = 64); B = P^T + ks * 32,
//     K-major, SBO = 1024.
// Self-check of the layouts: the canonical K-major SW128 atom is 8 rows x 128 B with chunk c of
// row r at c ^ r; the M-major one is the same 8 x 128 B with rows = K and 64 contiguous M elements
// per row - so one stored tile is both. Advancing the start address by 32 B per k16 step inside a
// row keeps address bits 7-9 (the row) intact, which is what the hardware XORs with bits 4-6.
// Accumulator fragment (m64nN f32): d[4j + v] of lane (g = lane / 4, t = lane % 4) in warp w of the
// warpgroup is row 16 w + g + 8 (v >> 1), column 8 j + 2 t + (v & 1).
#include "tensor_core.cuh"

#define MLW_HEADS 48   // heads per CTA = the n of every wgmma
#define MLW_POS 64     // positions per tile: m of S^T, k of P V
#define MLW_ROW 576    // largest latent row; Q and the tile are zero past the row
#define MLW_SLABS 9    // 64-feature slabs of a row
#define MLW_THREADS 384
#ifndef MLW_NB
#define MLW_NB 2       // positions per producer batch (9 float4 each); the harness times others
#endif
// Harness-only timing probes (benchmarks.py bench_mla_diag, never built by the host): 1 = the
// consumers skip their math (producer-bound time), 2 = the producer skips its global loads
// (consumer- and store-bound time), 3 = both; + 4 = no transfer to the partner block, + 8 = no
// local stores of the bf16 rows, + 16 / 32 / 64 = no S^T wgmma / no P V wgmma / no softmax, + 128 /
// 256 / 512 = no proxy fence after the producer's stores / after the full wait / after the softmax
// (racy: for timing only). 0 in every real build.
#ifndef MLW_DIAG
#define MLW_DIAG 0
#endif
#define MLW_SSTR 68    // f32 per score row: the fragment stores hit 32 distinct banks
#define MLW_OSTR 516   // f32 per staged o~ row in the epilogue (same reason)

// Dynamic shared memory (bytes from the 1024-aligned base); geometry.rs MLA_WG_SHARED must match.
#define MLW_QSLAB (MLW_HEADS * 128)                         // 6144
#define MLW_KSLAB (MLW_POS * 128)                           // 8192
#define MLW_KTILE (MLW_SLABS * MLW_KSLAB)                   // 73728
#define MLW_OFF_K (MLW_SLABS * MLW_QSLAB)                   // Q^T [9][48][64] bf16
#define MLW_OFF_P (MLW_OFF_K + 2 * MLW_KTILE)               // tiles [2][9][64][64] bf16
#define MLW_OFF_S (MLW_OFF_P + MLW_HEADS * 128)             // P^T [48][64] bf16
#define MLW_OFF_C (MLW_OFF_S + MLW_HEADS * MLW_SSTR * 4)    // scores [48][68] f32
#define MLW_END (MLW_OFF_C + MLW_HEADS * 4)                 // corr [48] f32
#define MLW_SHARED (MLW_END + 1024)                         // + slack to align the base: 223168 B
// mla_attend_pair_wgmma_f32 only: mbarriers full[2], empty[2] after corr; geometry.rs MLA_WGMMA_SHARED.
#define MLW_OFF_BAR MLW_END
#define MLW_SHARED_PAIR (MLW_END + 32 + 1024)                  // 223200 B
#define MLW_PAIR_TX (32 * MLW_SLABS * 128)                  // bytes the partner stores per tile

// Named barriers (0 is __syncthreads, unused here).
#define MLW_BAR_A 1      // consumers: Q staged / scores stored / epilogue staging
#define MLW_BAR_B 2      // consumers: P and corr stored / o~ staged
#define MLW_BAR_FULL 3   // + slot: producer arrives, consumers wait
#define MLW_BAR_EMPTY 5  // + slot: consumers arrive, producer waits
#define MLW_CONSUMERS 256

static_assert(MLW_SLABS * 64 == MLW_ROW, "slabs cover the padded row");
static_assert(MLW_OFF_P % 1024 == 0 && MLW_OFF_K % 1024 == 0 && MLW_QSLAB % 1024 == 0, "SW128 atoms");
static_assert(MLW_HEADS * MLW_OSTR * 4 <= 2 * MLW_KTILE, "o~ staging fits in the ring");
static_assert(MLW_SHARED == 223168, "keep geometry.rs MLA_WG_SHARED in step");
static_assert(MLW_SHARED_PAIR == 223200 && MLW_OFF_BAR % 8 == 0, "keep geometry.rs MLA_WGMMA_SHARED in step");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void mlw_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void mlw_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// Generic-proxy st.shared -> wgmma (async proxy) reads: each writer fences before the barrier.
__device__ __forceinline__ void mlw_fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mlw_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving accumulator reads / writes across the async window.
__device__ __forceinline__ void mlw_pin(float* d) {
#pragma unroll
    for (int i = 0; i < 24; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// 128-byte-swizzle matrix descriptor (base offset 0: every atom is 1024-aligned).
__device__ __forceinline__ u64 mlw_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// d[0..23] += A B, m64n48k16, bf16 in, f32 accumulate; TA = imm-trans-a (1: A is M-major).
// Cluster pieces of mla_attend_pair_wgmma_f32 (clusters of 2 blocks: the two head groups).
__device__ __forceinline__ u32 mlw_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 mlw_mapa(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ void mlw_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// Arrive on the partner's mbarrier (a shared::cluster address from mlw_mapa).
__device__ __forceinline__ void mlw_mbar_arrive_remote(u32 rbar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(rbar) : "memory");
}
// 8 bytes into the partner's shared memory, counted by its mbarrier's transaction bytes (no
// cluster-scope release fence per store: the complete_tx releases them).
__device__ __forceinline__ void mlw_st_async8(u32 raddr, u32 x, u32 y, u32 rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                 ::"r"(raddr), "r"(x), "r"(y), "r"(rbar) : "memory");
}

#define MLW_WGMMA_N48(NAME, TA)                                                                                 \
    __device__ __forceinline__ void NAME(float* d, u64 da, u64 db) {                                             \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"                                               \
                     "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "                                     \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                     "%20, %21, %22, %23}, %24, %25, p, 1, 1, " #TA ", 0;\n}\n"                                  \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
                       "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),   \
                       "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),             \
                       "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])                                        \
                     : "l"(da), "l"(db), "r"(1));                                                                \
    }
MLW_WGMMA_N48(mlw_mma_kmajor, 0)
MLW_WGMMA_N48(mlw_mma_amajor_m, 1)

// PAIR = false: mla_attend_wg_f32, one block per head group. PAIR = true: mla_attend_pair_wgmma_f32, the
// block pair of a cluster splits every tile's loads (rank r: positions 32 r .. 32 r + 31) and
// each stores its bf16 half into both blocks' rings; mbarriers replace the named FULL / EMPTY.
template <bool PAIR>
__device__ __forceinline__ void mlw_attend(const float* __restrict__ qt, const float* __restrict__ arena,
                                           const i64* __restrict__ page_start, const int* __restrict__ pt_base,
                                           const int* __restrict__ lens, float* __restrict__ part, int items,
                                           int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk,
                                           float scale, int final_rows) {
    extern __shared__ __align__(1024) unsigned char mlw_raw[];
    const u32 raw_a = (u32)__cvta_generic_to_shared(mlw_raw);
    const u32 sm_a = (raw_a + 1023u) & ~1023u;  // the SW128 atoms need 1024-aligned bases
    unsigned char* sm = mlw_raw + (sm_a - raw_a);
    const int h0 = blockIdx.x * MLW_HEADS, n = blockIdx.y, spl = blockIdx.z;
    const int row = kv_lora + rope;
    // final_rows needs one split (the host's contract): otherwise nothing is written.
    if (n >= items || row > MLW_ROW || kv_lora > 512 || page_tokens <= 0 || (final_rows && splits != 1)) return;
    const int tid = threadIdx.x;
    const int len = lens[n], base = pt_base[n];
    const int ch = chunk > 0 ? chunk : (len + splits - 1) / splits;  // chunk <= 0: per item
    const int j0 = spl * ch, j1 = min(len, j0 + ch);
    const int tiles = j1 > j0 ? (j1 - j0 + MLW_POS - 1) / MLW_POS : 0;
    // PAIR: full[slot] = 128 local producer arrivals (one with the partner's MLW_PAIR_TX bytes);
    // empty[slot] = lane 0 of the 8 consumer warps of both blocks. Uniform early return above, so
    // both blocks of a cluster reach the cluster barriers.
    const u32 bar_a = sm_a + MLW_OFF_BAR;  // full[0], full[1], empty[0], empty[1]
    const u32 peer = PAIR ? mlw_cluster_rank() ^ 1u : 0u;
    if (PAIR) {
        if (tid == 0) {
            mbar_init(bar_a, 128);
            mbar_init(bar_a + 8, 128);
            mbar_init(bar_a + 16, 16);
            mbar_init(bar_a + 24, 16);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        mlw_cluster_arrive();  // waited on just before each role's first use of the partner
    }

    if (tid < 128) {
        // ---------------- producer warpgroup ----------------
        const int c16 = tid & 15, rs = tid >> 4;
        // Byte offset of this thread's 8 bytes inside a slab row of position rs + 8 a (p % 8 = rs).
        const u32 swz = ((((u32)c16 >> 1) ^ (u32)rs) << 4) | (((u32)c16 & 1u) << 3);
        constexpr int PP = PAIR ? 4 : 8;  // positions this thread stores per tile
        const int aoff = PAIR ? 4 * (int)(peer ^ 1u) : 0;
        const int total = tiles * PP;
        auto pos_of = [&](int u) { return j0 + MLW_POS * (u / PP) + rs + 8 * (aoff + u % PP); };
        auto live = [&](int u) { return u < total && pos_of(u) < j1; };
        auto page_of = [&](int u) -> i64 {
            return (MLW_DIAG & 2) != 0 ? 0 : page_start[base + pos_of(u) / page_tokens];  // DIAG 2: no loads at all
        };
        auto row_ptr = [&](int u, i64 pg) { return arena + pg + (i64)(pos_of(u) % page_tokens) * row; };
        auto aligned = [&](const float* src) {
            return ((reinterpret_cast<size_t>(src) | ((size_t)row * 4)) & 15) == 0;
        };
        i64 pg[MLW_NB], pgn[MLW_NB];  // page starts of this batch and of the next
#pragma unroll
        for (int b = 0; b < MLW_NB; ++b) {
            pg[b] = live(b) ? page_of(b) : 0;
            pgn[b] = live(MLW_NB + b) ? page_of(MLW_NB + b) : 0;
        }
        const u32 peer_sm = PAIR ? mlw_mapa(sm_a, peer) : 0u, peer_bar = PAIR ? mlw_mapa(bar_a, peer) : 0u;
        if (PAIR) mlw_cluster_wait();
#pragma unroll 1
        for (int u0 = 0; u0 < total; u0 += MLW_NB) {
            float4 v[MLW_NB][MLW_SLABS];
#pragma unroll
            for (int b = 0; b < MLW_NB; ++b) {
                const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const int u = u0 + b;
                if (live(u)) {
                    const float* src = row_ptr(u, pg[b]);
                    if (aligned(src)) {
#pragma unroll
                        for (int k = 0; k < MLW_SLABS; ++k) {
                            const int f = 4 * (c16 + 16 * k);
                            v[b][k] = f >= row                ? z
                                      : (MLW_DIAG & 2) != 0 ? make_float4(__int_as_float(f + u), 1.0f, 2.0f, 3.0f)
                                                            : ld_stream_f4(src + f);
                        }
                    } else {  // rows only 4-byte aligned (or a row width not a multiple of 4)
#pragma unroll
                        for (int k = 0; k < MLW_SLABS; ++k) {
                            const int f = 4 * (c16 + 16 * k);
                            v[b][k].x = f < row ? ld_stream_f1(src + f) : 0.0f;
                            v[b][k].y = f + 1 < row ? ld_stream_f1(src + f + 1) : 0.0f;
                            v[b][k].z = f + 2 < row ? ld_stream_f1(src + f + 2) : 0.0f;
                            v[b][k].w = f + 3 < row ? ld_stream_f1(src + f + 3) : 0.0f;
                        }
                    }
                } else {  // past the split: zero rows (scores are masked, but V must not be garbage)
#pragma unroll
                    for (int k = 0; k < MLW_SLABS; ++k) v[b][k] = z;
                }
            }
#pragma unroll
            for (int b = 0; b < MLW_NB; ++b) {
                pg[b] = pgn[b];
                pgn[b] = live(u0 + 2 * MLW_NB + b) ? page_of(u0 + 2 * MLW_NB + b) : 0;
            }
#pragma unroll
            for (int b = 0; b < MLW_NB; ++b) {
                const int u = u0 + b;
                if (u >= total) break;  // uniform over the warpgroup
                const int t = u / PP, a = u % PP, slot = t & 1;
                if (a == 0 && t >= 2) {  // tile t - 2 released by every consumer (of both blocks)
                    if (PAIR) mbar_wait_cluster(bar_a + 16 + 8 * slot, (u32)((t >> 1) + 1) & 1u);
                    else mlw_bar_sync(MLW_BAR_EMPTY + slot, MLW_THREADS);
                }
                const u32 off = MLW_OFF_K + slot * MLW_KTILE + (rs + 8 * (aoff + a)) * 128 + swz;
#pragma unroll
                for (int k = 0; k < MLW_SLABS; ++k) {
                    const u32 x = tc_pack_bf16(v[b][k].x, v[b][k].y), y = tc_pack_bf16(v[b][k].z, v[b][k].w);
                    if ((MLW_DIAG & 8) == 0) *reinterpret_cast<uint2*>(sm + off + k * MLW_KSLAB) = make_uint2(x, y);
                    if (PAIR && (MLW_DIAG & 4) == 0) mlw_st_async8(peer_sm + off + k * MLW_KSLAB, x, y, peer_bar + 8 * slot);
                }
                if (a == PP - 1) {
                    if ((MLW_DIAG & 128) == 0) mlw_fence_async();
                    if (!PAIR) mlw_bar_arrive(MLW_BAR_FULL + slot, MLW_THREADS);
                    else if (tid == 0 && (MLW_DIAG & 4) == 0) mbar_arrive_expect_tx(bar_a + 8 * slot, MLW_PAIR_TX);
                    else mbar_arrive(bar_a + 8 * slot);
                }
            }
        }
        if (PAIR) {  // neither block leaves while the other may still signal it
            mlw_cluster_arrive();
            mlw_cluster_wait();
        }
        return;
    }

    // ---------------- consumer warpgroups ----------------
    const int ct = tid - 128, cwg = ct >> 7, cw = ct >> 5, lane = tid & 31;
    const int wl = cw & 3, g = lane >> 2, t4 = lane & 3;
    float* sp = reinterpret_cast<float*>(sm + MLW_OFF_S);
    float* cs = reinterpret_cast<float*>(sm + MLW_OFF_C);
    u16* ps = reinterpret_cast<u16*>(sm + MLW_OFF_P);

    // Q^T: bf16(q~ * scale), zero past the row and past the last head (the k-loops rely on it).
    // 8-feature chunks, 7 per thread per round with every load issued before the first store: two
    // round trips instead of one per chunk, while the producer fetches tile 0.
    {
        const bool q16 = ((reinterpret_cast<size_t>(qt) | ((size_t)row * 4)) & 15) == 0;
#pragma unroll 1
        for (int r0 = 0; r0 < MLW_HEADS * (MLW_ROW / 8); r0 += 7 * MLW_CONSUMERS) {
            float4 x[7][2];
#pragma unroll
            for (int i = 0; i < 7; ++i) {
                const int e = r0 + ct + i * MLW_CONSUMERS, hl = e / (MLW_ROW / 8), h = h0 + hl;
                const int f0 = 8 * (e - hl * (MLW_ROW / 8));
                const float* src = qt + ((i64)n * heads + min(h, heads - 1)) * row + f0;
                const bool any = e < MLW_HEADS * (MLW_ROW / 8) && h < heads && f0 < row;
                if (any && q16) {  // row % 4 == 0: a chunk is all in or all out past f0 + 4
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
                const int e = r0 + ct + i * MLW_CONSUMERS, hl = e / (MLW_ROW / 8), c = e - hl * (MLW_ROW / 8);
                if (e < MLW_HEADS * (MLW_ROW / 8))
                    *reinterpret_cast<uint4*>(sm + (c >> 3) * MLW_QSLAB + hl * 128 + (((c & 7) ^ (hl & 7)) << 4)) =
                        make_uint4(tc_pack_bf16(x[i][0].x * scale, x[i][0].y * scale),
                                   tc_pack_bf16(x[i][0].z * scale, x[i][0].w * scale),
                                   tc_pack_bf16(x[i][1].x * scale, x[i][1].y * scale),
                                   tc_pack_bf16(x[i][1].z * scale, x[i][1].w * scale));
            }
        }
    }
    mlw_fence_async();
    mlw_bar_sync(MLW_BAR_A, MLW_CONSUMERS);
    const u32 peer_bar = PAIR ? mlw_mapa(bar_a, peer) : 0u;
    if (PAIR) mlw_cluster_wait();

    float acc[4][24];  // o~^T, value columns 256 cwg + 64 mt + (fragment row), heads = fragment columns
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int i = 0; i < 24; ++i) acc[m][i] = 0.0f;
    // Softmax: warp cw owns heads 6 cw .. 6 cw + 5. PAIR: its half-warp hw the three heads 6 cw +
    // 3 hw .., lane q = lane % 16 the positions 4 q .. 4 q + 3 of every tile (one 16-byte score load
    // and one 8-byte P^T store per head). !PAIR: the whole warp the six heads, positions lane and
    // lane + 32 (a single-block instance spills with the other mapping).
    // m_run is uniform over the lanes of a head; l_lane is this lane's share, summed at the end.
    constexpr int NH = PAIR ? 3 : 6, HLANES = PAIR ? 16 : 32;
    const int hl0 = 6 * cw + (PAIR ? 3 * (lane >> 4) : 0), q16 = lane & 15;
    auto heads_sum = [&](float x) {  // over the lanes that share this lane's heads
#pragma unroll
        for (int off = HLANES / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        return x;
    };
    const bool head_writer = (lane & (HLANES - 1)) == 0;
    float m_run[NH], l_lane[NH];
#pragma unroll
    for (int i = 0; i < NH; ++i) {
        m_run[i] = K3_NEG_INF;
        l_lane[i] = 0.0f;
    }
    const u32 q_a = sm_a, p_a = sm_a + MLW_OFF_P;
    // Descriptor templates (start address 0); the per-step start is added in units of 16 bytes.
    const u64 d_k = mlw_desc(0, 16, 1024), d_vt = mlw_desc(0, 8192, 1024);

#pragma unroll 1
    for (int t = 0; t < tiles; ++t) {
        const int slot = t & 1;
        const u32 k_a = sm_a + MLW_OFF_K + slot * MLW_KTILE;
        if (PAIR) {
            mbar_wait_cluster(bar_a + 8 * slot, (u32)(t >> 1) & 1u);
            if ((MLW_DIAG & 256) == 0) mlw_fence_async();  // the partner's half came by st.async: before wgmma
        } else {
            mlw_bar_sync(MLW_BAR_FULL + slot, MLW_THREADS);
        }
        if ((MLW_DIAG & 1) == 0) {
        if (cwg == 0) {
            // S^T = K Q^T over the 576 features (zeros past the row on both sides).
            float s[24];
#pragma unroll
            for (int i = 0; i < 24; ++i) s[i] = 0.0f;
            mlw_pin(s);
            mlw_wg_fence();
#pragma unroll
            for (int kk = 0; kk < ((MLW_DIAG & 16) ? 0 : 4 * MLW_SLABS); ++kk) {
                const u32 off = (u32)(kk & 3) * 32u;  // k16 step inside the 128-byte row
                mlw_mma_kmajor(s, d_k + ((k_a + (u32)(kk >> 2) * MLW_KSLAB + off) >> 4),
                               d_k + ((q_a + (u32)(kk >> 2) * MLW_QSLAB + off) >> 4));
            }
            mlw_wg_commit();
            mlw_wg_wait0();
            mlw_pin(s);
#pragma unroll
            for (int j = 0; j < 6; ++j)
#pragma unroll
                for (int v = 0; v < 4; ++v)
                    sp[(8 * j + 2 * t4 + (v & 1)) * MLW_SSTR + 16 * wl + g + 8 * (v >> 1)] = s[4 * j + v];
        }
        mlw_bar_sync(MLW_BAR_A, MLW_CONSUMERS);

        // Online softmax of this tile (the mapping above), then corr and P^T for the P V below.
        if ((MLW_DIAG & 64) == 0) {
            constexpr int PL = PAIR ? 4 : 2;  // positions per lane and head
            // PAIR: positions p0 .. p0 + 3; else p0 and p0 + 32 (p0 = this lane's first).
            const int p0 = j0 + t * MLW_POS + (PAIR ? 4 * q16 : lane);
            auto valid = [&](int k) { return (PAIR ? p0 + k : p0 + 32 * k) < j1; };
            float sc[NH][PL], mx[NH];
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const float* r = sp + (hl0 + i) * MLW_SSTR;
                if constexpr (PAIR) {
                    const float4 v = *reinterpret_cast<const float4*>(r + 4 * q16);
                    sc[i][0] = valid(0) ? v.x : K3_NEG_INF;
                    sc[i][1] = valid(1) ? v.y : K3_NEG_INF;
                    sc[i][2] = valid(2) ? v.z : K3_NEG_INF;
                    sc[i][3] = valid(3) ? v.w : K3_NEG_INF;
                    mx[i] = fmaxf(fmaxf(sc[i][0], sc[i][1]), fmaxf(sc[i][2], sc[i][3]));
                } else {
                    sc[i][0] = valid(0) ? r[lane] : K3_NEG_INF;
                    sc[i][1] = valid(1) ? r[lane + 32] : K3_NEG_INF;
                    mx[i] = fmaxf(sc[i][0], sc[i][1]);
                }
            }
#pragma unroll
            for (int off = HLANES / 2; off > 0; off >>= 1)
#pragma unroll
                for (int i = 0; i < NH; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], off));
#pragma unroll
            for (int i = 0; i < NH; ++i) {
                const int hl = hl0 + i;
                const float mn = fmaxf(m_run[i], mx[i]);  // finite: every tile has a valid position
                const float corr = m_run[i] == K3_NEG_INF ? 0.0f : __expf(m_run[i] - mn);
                u16 pb[PL];
#pragma unroll
                for (int k = 0; k < PL; ++k) pb[k] = f32_to_bf16_bits(valid(k) ? __expf(sc[i][k] - mn) : 0.0f);
                if constexpr (PAIR) {
                    // 4 positions = half of a 16-byte chunk of the swizzled P^T row (8-byte aligned).
                    *reinterpret_cast<uint2*>(ps + hl * 64 + ((((q16 >> 1) ^ (hl & 7))) << 3) + 4 * (q16 & 1)) =
                        make_uint2((u32)pb[0] | ((u32)pb[1] << 16), (u32)pb[2] | ((u32)pb[3] << 16));
                    l_lane[i] = l_lane[i] * corr + ((bf16_bits_to_f32(pb[0]) + bf16_bits_to_f32(pb[1])) +
                                                    (bf16_bits_to_f32(pb[2]) + bf16_bits_to_f32(pb[3])));
                } else {
                    u16* prow = ps + hl * 64;
                    prow[((((lane >> 3) ^ (hl & 7)) << 3)) + (lane & 7)] = pb[0];
                    prow[(((((lane + 32) >> 3) ^ (hl & 7)) << 3)) + (lane & 7)] = pb[1];
                    l_lane[i] = l_lane[i] * corr + bf16_bits_to_f32(pb[0]) + bf16_bits_to_f32(pb[1]);
                }
                m_run[i] = mn;
                if (head_writer) cs[hl] = corr;
            }
            if ((MLW_DIAG & 512) == 0) mlw_fence_async();
        }
        mlw_bar_sync(MLW_BAR_B, MLW_CONSUMERS);

        // o~^T = corr o~^T + V^T P^T for value columns [256 cwg, 256 cwg + 256): 4 m-tiles x 4 k-steps.
#pragma unroll
        for (int j = 0; j < 6; ++j) {
            const float2 c = *reinterpret_cast<const float2*>(cs + 8 * j + 2 * t4);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                acc[m][4 * j + 0] *= c.x;
                acc[m][4 * j + 1] *= c.y;
                acc[m][4 * j + 2] *= c.x;
                acc[m][4 * j + 3] *= c.y;
            }
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) mlw_pin(acc[m]);
        mlw_wg_fence();
#pragma unroll
        for (int ks = 0; ks < ((MLW_DIAG & 32) ? 0 : MLW_POS / 16); ++ks)
#pragma unroll
            for (int m = 0; m < 4; ++m)
                mlw_mma_amajor_m(acc[m], d_vt + ((k_a + (u32)(4 * cwg + m) * MLW_KSLAB + (u32)ks * 2048u) >> 4),
                                 d_k + ((p_a + (u32)ks * 32u) >> 4));
        mlw_wg_commit();
        mlw_wg_wait0();
#pragma unroll
        for (int m = 0; m < 4; ++m) mlw_pin(acc[m]);
        }  // MLW_DIAG & 1
        // The producer refills this slot with tile t + 2 only if there is one (it waits then).
        if (t + 2 < tiles) {
            if (PAIR) {
                __syncwarp();
                if (lane == 0) {
                    mbar_arrive(bar_a + 16 + 8 * slot);
                    mlw_mbar_arrive_remote(peer_bar + 16 + 8 * slot);
                }
            } else {
                mlw_bar_arrive(MLW_BAR_EMPTY + slot, MLW_THREADS);
            }
        }
    }

    // Epilogue: o~^T -> [48][516] f32 in the (now idle) ring, then whole rows to the partials.
    mlw_bar_sync(MLW_BAR_A, MLW_CONSUMERS);  // every consumer's P V is done reading the ring
    float* os = reinterpret_cast<float*>(sm + MLW_OFF_K);
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int j = 0; j < 6; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v)
                os[(8 * j + 2 * t4 + (v & 1)) * MLW_OSTR + 256 * cwg + 64 * m + 16 * wl + g + 8 * (v >> 1)] =
                    acc[m][4 * j + v];
    if (final_rows) {  // 1 / l per head for the row writes below (corr is free again)
#pragma unroll
        for (int i = 0; i < NH; ++i) {
            const float l = heads_sum(l_lane[i]);
            if (head_writer) cs[hl0 + i] = l > 0.0f ? 1.0f / l : 0.0f;
        }
    }
    mlw_bar_sync(MLW_BAR_B, MLW_CONSUMERS);
    // Partials [items, H, splits, kv_lora + 2], or with final_rows the latent [items, H, kv_lora].
    const int prow = final_rows ? kv_lora : kv_lora + 2;
    float* out = part + ((i64)n * heads * splits + spl) * prow;
    const i64 hstride = (i64)splits * prow;
    const int hn = min(MLW_HEADS, heads - h0);
    // Warp cw writes head rows cw, cw + 8, ..: rows start at even float offsets (kv_lora (+ 2) per
    // row), so float2 stores when kv_lora is even.
    for (int hl = cw; hl < hn; hl += 8) {
        float* dst = out + (h0 + hl) * hstride;
        const float* srow = os + hl * MLW_OSTR;
        if (final_rows) {  // mla_merge_f32's arithmetic for one split: o~ * (1 / l)
            const float inv_l = cs[hl];
            if ((kv_lora & 1) == 0) {
                for (int c = 2 * lane; c < kv_lora; c += 64) {
                    const float2 x = *reinterpret_cast<const float2*>(srow + c);
                    *reinterpret_cast<float2*>(dst + c) = make_float2(x.x * inv_l, x.y * inv_l);
                }
            } else {
                for (int c = lane; c < kv_lora; c += 32) dst[c] = srow[c] * inv_l;
            }
        } else if ((kv_lora & 1) == 0) {
            for (int c = 2 * lane; c < kv_lora; c += 64)
                *reinterpret_cast<float2*>(dst + c) = *reinterpret_cast<const float2*>(srow + c);
        } else {
            for (int c = lane; c < kv_lora; c += 32) dst[c] = srow[c];
        }
    }
#pragma unroll
    for (int i = 0; i < NH; ++i) {
        const float l = heads_sum(l_lane[i]);
        const int hh = h0 + hl0 + i;
        if (head_writer && hh < heads && !final_rows) {
            out[hh * hstride + kv_lora] = m_run[i];
            out[hh * hstride + kv_lora + 1] = l;
        }
    }
    if (PAIR) {
        __syncwarp();
        mlw_cluster_arrive();
        mlw_cluster_wait();
    }
}
#endif

// Grid (2 * ceil(H / 96), items, splits) in clusters of 2, 384 threads, MLW_SHARED_PAIR bytes.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(MLW_THREADS, 1)
mla_attend_pair_wgmma_f32(const float* __restrict__ qt, const float* __restrict__ arena, const i64* __restrict__ page_start,
                   const int* __restrict__ pt_base, const int* __restrict__ lens, float* __restrict__ part, int items,
                   int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk, float scale,
                   int final_rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    mlw_attend<true>(qt, arena, page_start, pt_base, lens, part, items, heads, kv_lora, rope, page_tokens, splits,
                     chunk, scale, final_rows);
#else
    __trap();
#endif
}
