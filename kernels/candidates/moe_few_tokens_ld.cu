// CANDIDATE (harness only: benchmarks_moe.py bench_moe_few_tokens_ld, checks_moe.py
// check_moe_few_tokens; the host does not build kernels/candidates/): the few-token pair of
// moe_few_tokens.cu with its shared-memory ring replaced by per-lane register loads, written in a
// session that could get no GPU to measure it. If it beats the landed pair, it replaces that
// pair's walk: rename the entry points and mxl_pos to mx_pos (mxfp4_mma.cuh and the emulator's
// perm), drop the shared-memory sizes (moe/mod.rs, moe/mxfp8.rs, geometry.rs OPT_IN_SHARED) and cap
// few_token_ntiles at MXF_MAXNT (2). If it loses, delete it. Its own description follows.
//
// Routed experts in MXFP4 on tensor cores, for decode steps of 2 tokens and more (1-token steps
// take the single-token pair of moe_single_token.cu; dispatch.rs chooses). Each 16x16 weight tile is
// expanded to bf16 in registers (exact: an E2M1 value times a power of two fits bf16) and
// multiplied by mma.sync m16n8k16 against the step's tokens, each fed as one bf16 column
// (`planes` = 1: the backend's bfloat16 mode) or as two, hi = bf16(x) and lo = bf16(x - hi)
// (common.cuh split_bf16), whose products the f32 accumulator sums: ~16 mantissa bits of x, as
// moe_gemm.cu (`planes` = 2: float32 mode). The MXFP8 pair at the end takes E4M3 activations on
// m16n8k32 instead.
//
// Why this shape. At decode sizes the pair must stream every touched expert's weights at close to
// the HBM rate with few instructions per weight byte. No weight byte is read by two warps (a warp
// owns its rows and multiplies them with every token of the pass), so nothing is staged in shared
// memory: each lane loads its own rows' 16-byte MX blocks straight into a ring of registers
// MXF_PF super-steps ahead (with an L2 256-byte prefetch hint, so DRAM sees 256-byte runs), and the
// tokens' fragments, which every warp of a block reads, come through L1. The ring of shared-memory
// stages this replaced spent a third of its instructions on copies, barriers and shared loads
// (performance-history.md). Blocks are persistent (two per SM): each walks a fixed list of
// (expert, row block) tiles, and its loads run on across tile boundaries. The decode (mxfp4_mma.cuh
// mx_dec: three logic ops per bf16x2 and one fma with the block scale) is most of what is left;
// a stage issues the mma of its pass's n-tiles only (the body is a template on the n-tile count).
//
// Fragment mapping (PTX m16n8k16 .row.col): lane = 4 g + t holds A rows g and g + 8 at k = 2t,
// 2t + 1 (+8), B column g at the same k. The dot over k does not care which physical column a
// k slot stands for as long as A and B agree, so lane t takes one whole 16-byte MX block per
// row and super-step of 128 columns (block 4 ss + t: one uint4 and one scale per row). Word w of
// the block (8 columns, nibble i = column 8 w + i) feeds k-steps s = 2 w + h: mx_dec takes nibbles
// 3 - 2h and 7 - 2h into the register for k 2t, 2t + 1 and nibbles 2 - 2h, 6 - 2h into the one
// for k 2t + 8, 2t + 9. The split activations follow that order (mxl_pos: lane t's 32 values
// contiguous), so a lane's B for two k-steps is one 16-byte load per column. The scale is folded
// into the bf16 weights, so blocks can mix within an mma. With two planes, column n of an n-tile
// q is token 4 q + n / 2, hi (n even) or lo (n odd): lane t's accumulators c0 + c1 (row g) and
// c2 + c3 (row g + 8) are token 4 q + t's whole result. With one plane, column n is token 8 q + n:
// c0 / c2 are token 8 q + 2 t's rows, c1 / c3 token 8 q + 2 t + 1's (mxf_token, mxf_result).
#include "../mxfp4_mma.cuh"

// Column c of a 128-column super-step -> its index in this pair's split rows: c = 32 t + 8 w + i
// (lane t's block, word w, nibble i) feeds k-step s = 2 w + h, h = 1 for nibbles 0, 1, 4, 5; lane
// t's 32 values sit contiguous at 32 t, k-step s's 4 at 32 t + 4 s + j in mx_dec's order.
__device__ __forceinline__ int mxl_pos(int c) {
    const int i = c & 7, h = ((i >> 1) & 1) ^ 1, j = ((i & 1) ? 0 : 2) + (i >> 2);
    return 32 * (c >> 5) + 4 * (2 * ((c >> 3) & 3) + h) + j;
}

// Tiles: (busy expert, block of A-rows), ordered expert-major so that neighbouring blocks read the
// same tokens; block b takes tiles b, b + grid, ... A step is one super-step (128 columns = 4 MX
// blocks) of the tile's 256 A-rows: 32 per warp. Every token of the expert goes through each
// decoded weight fragment: a pass takes up to 8 MXF_MAXNT / planes tokens (n-tiles of 8 columns),
// so the weights are read once per expert (experts with more tokens take another pass). xs layout
// (z and the intermediate): [row][ceil(cols / 128)][planes][128] bf16, column 128 ss + c at index
// mxl_pos(c) of its super-step, columns past `cols` zero.
#define MXF_KC 128
// Super-steps of weights each lane has in flight (register slots of 16 weight and 4 scale bytes
// per row pair); n-tiles per pass (moe/mod.rs FEW_TOKEN_MAX_NTILES): 4 spill registers.
#ifndef MXF_PF
#define MXF_PF 2
#endif
#define MXF_MAXNT 2

// Harness-only timing probes (benchmarks_moe.py bench_moe_few_tokens_diag, never built by the host):
// 1 = no weight decode (the raw words go to the mma), 2 = no mma (the decoded words are folded into
// the accumulators with one xor). Results are garbage on purpose. 0 in every real build.
#ifndef MXF_DIAG
#define MXF_DIAG 0
#endif

// 16 / 4 bytes of weights, read-only for the kernel's life, with the L2 256-byte prefetch.
__device__ __forceinline__ uint4 mxf_ld16(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 mxf_ld4(const u8* p) {
    u32 v;
    asm("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Grid (rows, ceil(cols / 128)), 32 threads: x [rows, cols] f32 -> xs, bf16 (planes 1) or hi / lo
// (planes 2), layout above.
extern "C" __global__ void mxfp4_experts_few_tokens_ld_split_f32(const float* __restrict__ x, u16* __restrict__ xs, int rows, int cols,
                                                              int planes) {
    const int row = blockIdx.x, ss = blockIdx.y, cc = 4 * threadIdx.x, col = MXF_KC * ss + cc;
    if (row >= rows) return;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < cols) {  // cols % 32 == 0: the whole float4 is in the row
        const float4 f = *reinterpret_cast<const float4*>(x + (i64)row * cols + col);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
    u16* dst = xs + ((i64)row * gridDim.y + ss) * 128 * planes;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u16 h, l;
        split_bf16(v[j], h, l);
        dst[mxl_pos(cc + j)] = h;
        if (planes == 2) dst[128 + mxl_pos(cc + j)] = l;
    }
}

// One tile: expert e, row block y (first row r0), its assignments sorted[a0 .. a0 + n) and its
// pass count; npass == 0 past the last tile.
struct MxfTile {
    int e, y, r0, a0, n, npass;
};

// The whole persistent walk of one expert matrix pair. Lane (g, t) of warp w owns A-rows (m, h):
// for UP rows r0 + 16 w + 8 h + g of W1 (m = 0) and of W3 (m = 1) with r0 = 128 y; else rows
// r0 + 32 w + 16 m + 8 h + g of W2 with r0 = 256 y. (wp0, ws0) / (wp1, ws1): all experts' packed
// rows and scales of W1 / W3 (UP) or W2 twice; rows and cols of one expert's matrix; xs the split
// tokens (FP8: e4m3 rows of 128 bytes per super-step, xf their 4 block factors), token of
// assignment a = a / div. emit(tile, t0, nt, acc[m][q]) stores pass results (the tokens and rows
// of mxf_token / mxf_result).
template <bool UP, bool FP8, typename Emit>
__device__ __forceinline__ void few_tokens_walk(const void* __restrict__ xs, const float* __restrict__ xf, int div,
                                                const u8* __restrict__ wp0, const u8* __restrict__ ws0,
                                                const u8* __restrict__ wp1, const u8* __restrict__ ws1, int rows,
                                                int cols, const int* __restrict__ offsets,
                                                const int* __restrict__ sorted, int experts, int ntiles, int planes,
                                                Emit emit) {
    __shared__ int busy_list[MXF_MAX_EXPERTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nb = cols >> 5, rbytes = cols >> 1;
    const int nbusy = mxf_busy_experts(offsets, experts, busy_list);
    const int tile_rows = UP ? 128 : 256, ny = (rows + tile_rows - 1) / tile_rows, ntile = nbusy * ny;
    const int nch = (cols + MXF_KC - 1) / MXF_KC, per = FP8 ? 8 * ntiles : 8 * ntiles / planes;

    auto tile_at = [&](int k, MxfTile& T) {
        T.npass = 0;
        if (k >= ntile) return;
        const int x = k / ny;
        T.e = busy_list[x];
        T.y = k - x * ny;
        T.r0 = T.y * tile_rows;
        T.a0 = offsets[T.e];
        T.n = offsets[T.e + 1] - T.a0;
        T.npass = (T.n + per - 1) / per;
    };

    // The load side: the next super-step to load (tile lt, pass lp, super-step lc), the lane's rows
    // (m, h = 0) in packed weights and scales, and the rows from there to its h = 1 rows (8, or
    // fewer where that is past the matrix's last row: tail rows are clamped, loaded, never stored).
    MxfTile lt = {};
    int lk = blockIdx.x, lp = 0, lc = 0, hoff[2] = {8, 8};
    const u8* wrow[2] = {wp0, wp0};
    const u8* srow[2] = {ws0, ws0};
    auto aim = [&]() {
        const i64 mat = (i64)lt.e * rows;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const int r = min(UP ? lt.r0 + 16 * warp + g : lt.r0 + 32 * warp + 16 * m + g, rows - 1);
            wrow[m] = ((UP && m) ? wp1 : wp0) + (mat + r) * rbytes + (FP8 ? 4 * t : 16 * t);
            srow[m] = ((UP && m) ? ws1 : ws0) + (mat + r) * nb + (FP8 ? 0 : t);
            hoff[m] = min(r + 8, rows - 1) - r;
        }
    };
    tile_at(lk, lt);
    if (lt.npass > 0) aim();
    // Register slots: bf16 mode A[u][m][h] = the lane's MX block of row (m, h), S[u][m][h] its scale
    // byte; FP8 A[u][m][h] = word t of the row's 4 blocks, S the row's 4 scale bytes.
    uint4 A[MXF_PF][2][2];
    u32 S[MXF_PF][2][2];
    auto load = [&](auto u_c) {
        constexpr int u = decltype(u_c)::value;
        if (lt.npass == 0) return;  // block-uniform
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u8* w = wrow[m] + (h ? (i64)hoff[m] * rbytes : 0) + 64 * lc;
                const u8* s = srow[m] + (h ? (i64)hoff[m] * nb : 0) + 4 * lc;
                if constexpr (FP8) {  // past the row's end: zeros (byte 0 decodes to +0)
                    u32 wv[4], sv = 0;
#pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        const bool in = 4 * lc + b < nb;
                        wv[b] = in ? mxf_ld4(w + 16 * b) : 0u;
                        if ((nb & 3) != 0) sv |= (in ? (u32)__ldg(s + b) : 0u) << (8 * b);  // test shapes only
                    }
                    if ((nb & 3) == 0) sv = __ldg(reinterpret_cast<const u32*>(s));  // 4-byte aligned
                    A[u][m][h] = make_uint4(wv[0], wv[1], wv[2], wv[3]);
                    S[u][m][h] = sv;
                } else {
                    const bool in = 4 * lc + t < nb;
                    A[u][m][h] = in ? mxf_ld16(w) : make_uint4(0u, 0u, 0u, 0u);
                    S[u][m][h] = in ? (u32)__ldg(s) : 0u;
                }
            }
        if (++lc == nch) {
            lc = 0;
            if (++lp == lt.npass) {
                lp = 0;
                lk += gridDim.x;
                tile_at(lk, lt);
                if (lt.npass > 0) aim();
            }
        }
    };

    // The compute side: tile ct, pass cp, super-step cc; per pass the lane's B rows (element
    // offsets of token column g of n-tile q at super-step 0) and, FP8, the rows of its accumulator
    // tokens 2 t and 2 t + 1 (their block factors).
    MxfTile ct = {};
    int ck = blockIdx.x, cp = 0, cc = 0, nt = 0, t0 = 0, ntl = 0;
    int boff[MXF_MAXNT], foff[MXF_MAXNT][2];
    float acc[2][MXF_MAXNT][4];
    auto start_pass = [&]() {
        t0 = cp * per;
        nt = min(per, ct.n - t0);
        ntl = (nt * (FP8 ? 1 : planes) + 7) >> 3;
        auto row_of = [&](int i) { return sorted[ct.a0 + t0 + min(i, nt - 1)] / div; };
#pragma unroll
        for (int q = 0; q < MXF_MAXNT; ++q) {
            if constexpr (FP8) {
                boff[q] = row_of(8 * q + g) * nch * 128 + 8 * t;
                foff[q][0] = row_of(8 * q + 2 * t) * nch * 4;
                foff[q][1] = row_of(8 * q + 2 * t + 1) * nch * 4;
            } else {
                const int i = planes == 2 ? 4 * q + (g >> 1) : 8 * q + g, p = planes == 2 ? (g & 1) : 0;
                boff[q] = (row_of(i) * nch * planes + p) * 128 + 32 * t;
            }
        }
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                for (int k = 0; k < 4; ++k) acc[m][q][k] = 0.0f;
    };
    // One super-step of NT n-tiles: decode each weight fragment once and multiply it with the pass's
    // first NT n-tiles. TWO: the two-multiply decode (mx_dec).
    auto mma_stage = [&](const uint4 (&wv)[2][2], const u32 (&sb)[2][2], auto two_c, auto nt_c) {
        constexpr bool two = decltype(two_c)::value;
        constexpr int NT = decltype(nt_c)::value;
        u32 sc[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) sc[m][h] = two ? mx_scale2(sb[m][h]) : mx_scale2_folded(sb[m][h]);
        const u16* bb = static_cast<const u16*>(xs) + (i64)cc * planes * 128;
#pragma unroll
        for (int s2 = 0; s2 < 4; ++s2) {
            uint4 bv[NT];
#pragma unroll
            for (int q = 0; q < NT; ++q) bv[q] = __ldg(reinterpret_cast<const uint4*>(bb + boff[q]) + s2);
#pragma unroll
            for (int hs = 0; hs < 2; ++hs) {
                const int s = 2 * s2 + hs;
                u32 a[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const u32 w0 = mx_word(wv[m][0], s >> 1), w1 = mx_word(wv[m][1], s >> 1);
                    const int sh = 8 * (s & 1);
                    if ((MXF_DIAG & 1) != 0) {
                        a[m][0] = w0 << sh, a[m][1] = w1 << sh, a[m][2] = w0 << (sh + 4), a[m][3] = w1 << (sh + 4);
                        continue;
                    }
                    a[m][0] = mx_dec(w0 << sh, sc[m][0], two);
                    a[m][1] = mx_dec(w1 << sh, sc[m][1], two);
                    a[m][2] = mx_dec(w0 << (sh + 4), sc[m][0], two);
                    a[m][3] = mx_dec(w1 << (sh + 4), sc[m][1], two);
                }
#pragma unroll
                for (int q = 0; q < NT; ++q) {
                    const u32 b0 = hs ? bv[q].z : bv[q].x, b1 = hs ? bv[q].w : bv[q].y;
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        if ((MXF_DIAG & 2) != 0)
                            acc[m][q][0] += __uint_as_float(a[m][0] ^ a[m][1] ^ a[m][2] ^ a[m][3] ^ b0 ^ b1);
                        else
                            tc_mma_bf16(acc[m][q], a[m][0], a[m][1], a[m][2], a[m][3], b0, b1);
                    }
                }
            }
        }
    };
    // MXFP8 super-step: per MX block b, each lane's word t of its four A-rows becomes two e4m3 words
    // (even / odd columns: k slots 4t..4t+3 and 16+4t..), one m16n8k32 per row tile and n-tile into a
    // fresh accumulator, then scaled by the weight block's 2^(s-127) times the token block's factor
    // (the activation scale x 2^6, undoing the decode's 2^-6) into the f32 sums. A token row's
    // fragment bytes 8t of block b sit at 32 b + 8 t.
    auto mma_stage8 = [&](const uint4 (&wv)[2][2], const u32 (&s4)[2][2], auto nt_c) {
        constexpr int NT = decltype(nt_c)::value;
        const u8* bb = static_cast<const u8*>(xs) + (i64)cc * 128;
        const float* fb = xf + (i64)cc * 4;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            u32 a[2][4];
            float fw[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 w = mx_word(wv[m][h], b);
                    a[m][h] = mx_e4m3_even(w);
                    a[m][2 + h] = mx_e4m3_odd(w);
                    fw[m][h] = mx_scale_f32(s4[m][h], b);
                }
#pragma unroll
            for (int q = 0; q < NT; ++q) {
                const uint2 v = __ldg(reinterpret_cast<const uint2*>(bb + boff[q] + 32 * b));
                const float f0 = __ldg(fb + foff[q][0] + b), f1 = __ldg(fb + foff[q][1] + b);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    float p[4];
                    tc_mma_e4m3(p, a[m], v.x, v.y);
                    acc[m][q][0] = fmaf(p[0], fw[m][0] * f0, acc[m][q][0]);
                    acc[m][q][1] = fmaf(p[1], fw[m][0] * f1, acc[m][q][1]);
                    acc[m][q][2] = fmaf(p[2], fw[m][1] * f0, acc[m][q][2]);
                    acc[m][q][3] = fmaf(p[3], fw[m][1] * f1, acc[m][q][3]);
                }
            }
        }
    };
    // The 2^126 of mx_dec folds into the scale unless a block's scale is too large for that
    // (never in trained weights): then the warp takes the two-multiply path for that super-step.
    auto run_stage = [&](const uint4 (&wv)[2][2], const u32 (&sb)[2][2], auto nt_c) {
        if constexpr (FP8) {
            mma_stage8(wv, sb, nt_c);
        } else {
            bool big = false;
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) big |= sb[m][h] > MX_DEC_MAX_FOLDED;
            if (__any_sync(K3_FULL_MASK, big))
                mma_stage(wv, sb, MxfBool<true>{}, nt_c);
            else
                mma_stage(wv, sb, MxfBool<false>{}, nt_c);
        }
    };
    // Consume slot u (the compute side's super-step), refill it MXF_PF super-steps ahead, and
    // emit a finished pass.
    auto step = [&](auto u_c) {
        constexpr int u = decltype(u_c)::value;
        if (ct.npass == 0) return;  // block-uniform
        if (ntl == 1)  // block-uniform
            run_stage(A[u], S[u], MxfInt<1>{});
        else
            run_stage(A[u], S[u], MxfInt<MXF_MAXNT>{});
        load(u_c);
        if (++cc == nch) {
            emit(ct, t0, nt, acc);
            cc = 0;
            if (++cp == ct.npass) {
                cp = 0;
                ck += gridDim.x;
                tile_at(ck, ct);
            }
            if (ct.npass > 0) start_pass();
        }
    };
    static_assert(MXF_MAXNT == 2 && MXF_PF >= 1 && MXF_PF <= 3, "step and run_stage unroll for these");
    tile_at(ck, ct);
    load(MxfInt<0>{});
    if (MXF_PF > 1) load(MxfInt<1 % MXF_PF>{});
    if (MXF_PF > 2) load(MxfInt<2 % MXF_PF>{});
    if (ct.npass > 0) start_pass();
    while (ct.npass > 0) {
        step(MxfInt<0>{});
        if (MXF_PF > 1) step(MxfInt<1 % MXF_PF>{});
        if (MXF_PF > 2) step(MxfInt<2 % MXF_PF>{});
    }
}

// Persistent grid (moe/mod.rs few_token_launch: at most two blocks per SM), 256 threads: tile (x, y)
// writes super-step y of actx = SiTU-GLU(W1 z, W3 z) for every assignment of the x-th busy expert,
// in `planes` bf16 planes (xs layout, rows past inter zero): the down kernel's B. zx:
// mxfp4_experts_few_tokens_ld_split_f32 of z; z's token of assignment a is a / top_k; `experts` = E;
// `ntiles` n-tiles per pass (1..MXF_MAXNT); SiTU-GLU parameters beta, beta_lin, has_lin.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_ld_up_f32(const u16* __restrict__ zx, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                 const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                 const int* __restrict__ sorted, u16* __restrict__ actx, int top_k, int latent, int inter, float beta,
                 float beta_lin, int has_lin, int experts, int ntiles, int planes) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nss = (inter + MXF_KC - 1) / MXF_KC;
    few_tokens_walk<true, false>(zx, nullptr, top_k, w1p, w1s, w3p, w3s, inter, latent, offsets, sorted, experts,
                          max(1, min(ntiles, MXF_MAXNT)), planes,
                          [&](const MxfTile& T, int t0, int nt, const float(&acc)[2][MXF_MAXNT][4]) {
#pragma unroll
                              for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                                  for (int j = 0; j < 2; ++j)
#pragma unroll
                                      for (int h = 0; h < 2; ++h) {
                                          const int i = mxf_token(planes, q, j, t), rl = 16 * warp + 8 * h + g;
                                          if ((j == 0 || planes == 1) && i < nt) {
                                              const float v = T.r0 + rl < inter
                                                                  ? situ_glu_one(mxf_result(acc[0][q], planes, j, h),
                                                                                 mxf_result(acc[1][q], planes, j, h), beta,
                                                                                 beta_lin, has_lin)
                                                                  : 0.0f;
                                              u16 hi, lo;
                                              split_bf16(v, hi, lo);
                                              u16* dst = actx + (((i64)sorted[T.a0 + t0 + i] * nss + T.y) * planes) * 128 + mxl_pos(rl);
                                              dst[0] = hi;
                                              if (planes == 2) dst[128] = lo;
                                          }
                                      }
                          });
}

// The down walk of both pairs: y[a, r] = W2_e[r, :] . act[a, :] for every sorted assignment a of each
// tile's expert, act staged from xs (and xf, MXFP8) as the walk's B.
template <bool FP8>
__device__ __forceinline__ void few_tokens_down(const void* __restrict__ xs, const float* __restrict__ xf,
                                                const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                                                const int* __restrict__ offsets, const int* __restrict__ sorted,
                                                float* __restrict__ y, int latent, int inter, int experts, int ntiles,
                                                int planes) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    few_tokens_walk<false, FP8>(xs, xf, 1, w2p, w2s, w2p, w2s, latent, inter, offsets, sorted, experts,
                                max(1, min(ntiles, MXF_MAXNT)), planes,
                                [&](const MxfTile& T, int t0, int nt, const float(&acc)[2][MXF_MAXNT][4]) {
#pragma unroll
                                    for (int m = 0; m < 2; ++m)
#pragma unroll
                                        for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                                            for (int j = 0; j < 2; ++j)
#pragma unroll
                                                for (int h = 0; h < 2; ++h) {
                                                    const int i = mxf_token(planes, q, j, t),
                                                              r = T.r0 + 32 * warp + 16 * m + 8 * h + g;
                                                    if ((j == 0 || planes == 1) && i < nt && r < latent)
                                                        y[(i64)sorted[T.a0 + t0 + i] * latent + r] =
                                                            mxf_result(acc[m][q], planes, j, h);
                                                }
                                });
}

// Persistent grid as the up kernel, 256 threads: few_tokens_down with act from actx
// (mxfp4_experts_few_tokens_ld_up_f32).
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_ld_down_f32(const u16* __restrict__ actx, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                   const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y, int latent,
                   int inter, int experts, int ntiles, int planes) {
    few_tokens_down<false>(actx, nullptr, w2p, w2s, offsets, sorted, y, latent, inter, experts, ntiles, planes);
}

// ---------------------------------------------------------------------------------------------
// MXFP8 mode (CudaOptions::dtype Mxfp8): the routed experts take their activations as MXFP8 (E4M3
// values, one E8M0 scale per 32), the format K3 ships them in, on FP8 tensor cores.

// The up kernel of the MXFP8 pair: as mxfp4_experts_few_tokens_ld_up_f32 with z from mxfp8_quantize_f32
// (zq, zf), writing act [assignments, inter] = SiTU-GLU(W1 z, W3 z) in f32 for mxfp8_quantize_f32.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_ld_up_e4m3(const u8* __restrict__ zq, const float* __restrict__ zf, const u8* __restrict__ w1p,
                                 const u8* __restrict__ w1s, const u8* __restrict__ w3p, const u8* __restrict__ w3s,
                                 const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ act,
                                 int top_k, int latent, int inter, float beta, float beta_lin, int has_lin, int experts,
                                 int ntiles) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    few_tokens_walk<true, true>(zq, zf, top_k, w1p, w1s, w3p, w3s, inter, latent, offsets, sorted, experts,
                                max(1, min(ntiles, MXF_MAXNT)), 1,
                                [&](const MxfTile& T, int t0, int nt, const float(&acc)[2][MXF_MAXNT][4]) {
#pragma unroll
                                    for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                                        for (int j = 0; j < 2; ++j)
#pragma unroll
                                            for (int h = 0; h < 2; ++h) {
                                                const int i = mxf_token(1, q, j, t), r = T.r0 + 16 * warp + 8 * h + g;
                                                if (i < nt && r < inter)
                                                    act[(i64)sorted[T.a0 + t0 + i] * inter + r] =
                                                        situ_glu_one(acc[0][q][2 * h + j], acc[1][q][2 * h + j], beta,
                                                                     beta_lin, has_lin);
                                            }
                                });
}

// The down kernel of the MXFP8 pair: few_tokens_down with act from mxfp8_quantize_f32 (aq, af) of the up
// kernel's output.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_ld_down_e4m3(const u8* __restrict__ aq, const float* __restrict__ af, const u8* __restrict__ w2p,
                                   const u8* __restrict__ w2s, const int* __restrict__ offsets,
                                   const int* __restrict__ sorted, float* __restrict__ y, int latent, int inter,
                                   int experts, int ntiles) {
    few_tokens_down<true>(aq, af, w2p, w2s, offsets, sorted, y, latent, inter, experts, ntiles, 1);
}
