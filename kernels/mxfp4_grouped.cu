// Routed experts in MXFP4 as a grouped GEMM, for steps with many tokens per expert (prefill
// chunks, large decode batches; moe_grouped.rs, K3_MOE_PREFILL=grouped). Same math as the tc2 pair
// (mxfp4_tc.cu): weights decoded in registers to bf16 (exact), activations as hi / lo bf16 columns
// (common.cuh split_bf16) summed in the f32 accumulator, so results track f32 to ~1e-5. What
// differs is the tiling: the cuBLAS path (moe_gemm.rs) expands every touched expert to bf16 in a
// 2 GiB scratch first (~8.7 ms per K3 layer of pure traffic); tc2 sees at most 16 tokens per pass.
// Here one CTA owns 256 weight rows x 64 tokens (128 hi/lo columns) of one expert, and every
// weight fragment it decodes feeds 8 n-tiles of each warp.
//
// Work split. Tiles = each expert's sorted assignments cut into pieces of 64, expert by expert;
// block (x, y) takes row block x of tile y (x fastest: the row blocks of a tile run together, so
// its activation tile, the bigger operand, is read from L2; the tiles of one expert follow each
// other, so its weights are too). grid.y is an upper bound (assignments / 64 + busy experts):
// blocks past the last tile exit, and nothing needs the counts on the host.
//
// CTA: 512 threads = 16 warps, 8 along the weight rows (32 rows = 2 m-tiles each) x 2 along the
// tokens (32 tokens = 8 n-tiles of 4 tokens x hi / lo each). Per stage (128 columns = 4 MX blocks
// of every row) a 3-deep cp.async ring brings 256 rows x 64 packed bytes, their 4 scale bytes, and
// the 128 B rows x 256 bytes of the tile's activations. Fragment mapping, decode table and the
// activation layout ([row][ceil(cols / 128)][hi / lo][128] bf16, columns in mx_pos order) are
// tc2's (mxfp4_tc.cu header): the up kernel takes z from mxfp4_tc2_split_f32 and writes its
// SiTU-GLU output in that layout, indexed by sorted position, for the down kernel.
//   mxfp4_up_grouped_f32     actx[p] = split(SiTU-GLU(W1_e z, W3_e z)) for each sorted position p
//   mxfp4_down_grouped_f32   y[sorted[p]] = W2_e act[p]
//   moe_combine_ids_f32      out[t] = sum over valid slots j of w[t,j] y[t*k + j] (fixed order)
#include "mxfp4_mma.cuh"

#define MXG_TOK 64        // tokens per tile (128 hi / lo B columns)
#define MXG_AROWS 256     // weight rows per CTA: up 128 of W1 + the same 128 of W3, down 256 of W2
#define MXG_UP_ROWS 128   // intermediate rows per up CTA (one 128-column super-step of actx)
#define MXG_KC 128        // columns per stage
#define MXG_STAGES 3
#define MXG_BRS 288       // bytes per staged B row: 256 + 32 (8-word bank shift: conflict-free LDS.64)
#define MXG_TAB_WORDS 8192  // 256 byte values x 32 lanes
#define MXG_A_BYTES (MXG_AROWS * 64)
#define MXG_S_BYTES (MXG_AROWS * 4)
#define MXG_B_BYTES (2 * MXG_TOK * MXG_BRS)
#define MXG_STAGE_BYTES (MXG_A_BYTES + MXG_S_BYTES + MXG_B_BYTES)
// Dynamic shared memory of both GEMM kernels (moe_grouped.rs GROUPED_SHARED): 195,584 B, one CTA
// per SM.
#define MXG_SHARED_BYTES (MXG_TAB_WORDS * 4 + MXG_STAGES * MXG_STAGE_BYTES)

extern __shared__ __align__(16) u32 mxg_smem[];

static_assert(MXG_STAGES == 3, "mx_wait_all_but_one waits for all but MXG_STAGES - 2 groups");

// acc[m][q][k] of this warp for one tile: nt (1..64) tokens whose B rows are xs rows brow(i)
// (UP: sorted[p0 + i] / div, else p0 + i), A rows of the CTA (UP: A-row ar = 32 w + 16 m + rr is
// row r0 + 16 w + rr of W1 (m = 0) or W3 (m = 1); else row r0 + ar of W2), cols of K.
template <bool UP>
__device__ __forceinline__ void mxg_tile(const u16* __restrict__ xs, int div, const int* __restrict__ sorted, int p0,
                                         int nt, const u8* const (&pk)[2], const u8* const (&ps)[2], int rows,
                                         int cols, int r0, float (&acc)[2][8][4]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp & 7, wn = warp >> 3;
    const int nb = cols >> 5, nch = (cols + MXG_KC - 1) / MXG_KC;
    const u8* stages = reinterpret_cast<const u8*>(mxg_smem + MXG_TAB_WORDS);
    const u32 stages_s = (u32)__cvta_generic_to_shared(mxg_smem + MXG_TAB_WORDS);
    const u32* tab_lane = mxg_smem + lane;

    // Copy duty. A: 16-byte piece (tid & 3) of A-rows (tid >> 2) + 128 i; scales: A-row tid
    // (tid < 256); B: piece (lane & 15) of half (lane >> 4) of tokens (tid >> 5) + 16 k. Rows past
    // the matrix are clamped (loaded, never stored); tokens past nt are zero-filled.
    auto src_row = [&](int ar, int& m) {
        m = UP ? (ar >> 4) & 1 : 0;
        return min(UP ? r0 + 16 * (ar >> 5) + (ar & 15) : r0 + ar, rows - 1);
    };
    const u8* wsrc[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int m;
        const int r = src_row((tid >> 2) + 128 * i, m);
        wsrc[i] = (m ? pk[1] : pk[0]) + (i64)r * (cols / 2) + 16 * (tid & 3);
    }
    int sm;
    const int sr = src_row(tid & (MXG_AROWS - 1), sm);
    const u8* ssrc = (sm ? ps[1] : ps[0]) + (i64)sr * nb;
    const u16* bsrc[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int i = warp + 16 * k;
        const i64 row = i < nt ? (UP ? sorted[p0 + i] / div : p0 + i) : 0;
        bsrc[k] = xs + row * nch * 256 + 128 * (lane >> 4) + 8 * (lane & 15);
    }

    auto issue = [&](int c) {
        const u32 bs = stages_s + (c % MXG_STAGES) * MXG_STAGE_BYTES;
        const bool in = 4 * c + (tid & 3) < nb;  // past the row's end: zeros (table entry 0 = +0)
#pragma unroll
        for (int i = 0; i < 2; ++i)
            mx_cp16_fill(bs + ((tid >> 2) + 128 * i) * 64 + 16 * (tid & 3), wsrc[i] + (in ? 64 * c : 0), in ? 16u : 0u);
        if (tid < MXG_AROWS) {
            if ((nb & 3) == 0) {
                mx_cp4(bs + MXG_A_BYTES + 4 * tid, ssrc + 4 * c);
            } else {  // scale rows not 4-byte aligned (test shapes only): a plain load and store
                u32 v = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (4 * c + k < nb) v |= (u32)ssrc[4 * c + k] << (8 * k);
                *reinterpret_cast<u32*>(mxg_smem + MXG_TAB_WORDS +
                                        ((c % MXG_STAGES) * MXG_STAGE_BYTES + MXG_A_BYTES) / 4 + tid) = v;
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = warp + 16 * k;
            mx_cp16_fill(bs + MXG_A_BYTES + MXG_S_BYTES + (2 * i + (lane >> 4)) * MXG_BRS + 16 * (lane & 15),
                     i < nt ? (const void*)(bsrc[k] + (i64)c * 256) : (const void*)xs, i < nt ? 16u : 0u);
        }
    };

#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int q = 0; q < 8; ++q)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[m][q][k] = 0.0f;
    // n-tiles of this warp holding any token (warp-uniform): partial tiles skip the rest.
    const int ntl = max(0, min(8, (nt - 32 * wn + 3) >> 2));
#pragma unroll
    for (int j = 0; j < MXG_STAGES - 1; ++j) {
        if (j < nch) issue(j);
        mx_commit();
    }
    for (int c = 0; c < nch; ++c) {
        mx_wait_all_but_one();  // stage c's copies (this thread's) are done
        __syncthreads();         // everyone's are, and everyone is done with stage c - 1's buffer
        if (c + MXG_STAGES - 1 < nch) issue(c + MXG_STAGES - 1);
        mx_commit();  // (possibly empty: keeps the group count per step fixed)
        if (ntl == 0) continue;
        const u8* buf = stages + (c % MXG_STAGES) * MXG_STAGE_BYTES;
        uint4 wv[2][2];
        u32 sc[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ar = 32 * wm + 16 * m + 8 * h + g;
                wv[m][h] = *reinterpret_cast<const uint4*>(buf + ar * 64 + 16 * t);
                sc[m][h] = mx_scale2(buf[MXG_A_BYTES + 4 * ar + t]);
            }
        const u8* bb = buf + MXG_A_BYTES + MXG_S_BYTES + (64 * wn + g) * MXG_BRS + 8 * t;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            u32 a[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const u32 w0 = mx_word(wv[m][0], s >> 1), w1 = mx_word(wv[m][1], s >> 1);
                const int by = 2 * (s & 1);
                a[m][0] = mx_pair(tab_lane, w0, by, sc[m][0]);
                a[m][1] = mx_pair(tab_lane, w1, by, sc[m][1]);
                a[m][2] = mx_pair(tab_lane, w0, by + 1, sc[m][0]);
                a[m][3] = mx_pair(tab_lane, w1, by + 1, sc[m][1]);
            }
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (q < ntl) {  // warp-uniform
                    const uint2 v = *reinterpret_cast<const uint2*>(bb + q * 8 * MXG_BRS + 32 * s);
                    tc_mma_bf16(acc[0][q], a[0], v.x, v.y);
                    tc_mma_bf16(acc[1][q], a[1], v.x, v.y);
                }
        }
    }
}

// Grid (ceil(inter / 128), assignments / 64 + min(E, assignments) (an upper bound on the tiles)),
// 512 threads, MXG_SHARED_BYTES (opt-in). zx: mxfp4_tc2_split_f32 of z [T, latent]; actx [n_assign]
// rows of ceil(inter / 128) super-steps (tc2 layout), row p = sorted position p: the up CTA
// (x, tile) writes super-step x of its tokens' rows (rows past inter as zeros). Other arguments as
// mxfp4_up_tc2_f32.
extern "C" __global__ void __launch_bounds__(512, 1)
mxfp4_up_grouped_f32(const u16* __restrict__ zx, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                     const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                     const int* __restrict__ sorted, u16* __restrict__ actx, int top_k, int latent, int inter,
                     float beta, float beta_lin, int has_lin, int experts) {
    int e, t0;
    if (!mx_find_tile<MXG_TOK>(offsets, experts, blockIdx.y, e, t0)) return;  // block-uniform
    mx_fill_table(mxg_smem, MXG_TAB_WORDS);  // the first stage's barrier orders it before any lookup
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp & 7, wn = warp >> 3;
    const int r0 = blockIdx.x * MXG_UP_ROWS, p0 = offsets[e] + t0, nt = min(MXG_TOK, offsets[e + 1] - p0);
    const i64 mat = (i64)e * inter;
    const u8* const pk[2] = {w1p + mat * (latent / 2), w3p + mat * (latent / 2)};
    const u8* const ps[2] = {w1s + mat * (latent / 32), w3s + mat * (latent / 32)};
    float acc[2][8][4];
    mxg_tile<true>(zx, top_k, sorted, p0, nt, pk, ps, inter, latent, r0, acc);
#pragma unroll
    for (int q = 0; q < 8; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = 32 * wn + 4 * q + t, rl = 16 * wm + 8 * h + g;
            if (i < nt) {
                const float gate = acc[0][q][2 * h] + acc[0][q][2 * h + 1];
                const float up = acc[1][q][2 * h] + acc[1][q][2 * h + 1];
                const float v = r0 + rl < inter ? situ_glu_one(gate, up, beta, beta_lin, has_lin) : 0.0f;
                u16 hi, lo;
                split_bf16(v, hi, lo);
                u16* dst = actx + ((i64)(p0 + i) * gridDim.x + blockIdx.x) * 256 + mx_pos(rl);
                dst[0] = hi;
                dst[128] = lo;
            }
        }
}

// Grid (ceil(latent / 256), as the up kernel), 512 threads, MXG_SHARED_BYTES: y[sorted[p], r] =
// W2_e[r, :] . act[p, :] with act from actx (mxfp4_up_grouped_f32). Other arguments as
// mxfp4_down_tc2_f32.
extern "C" __global__ void __launch_bounds__(512, 1)
mxfp4_down_grouped_f32(const u16* __restrict__ actx, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                       const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y,
                       int latent, int inter, int experts) {
    int e, t0;
    if (!mx_find_tile<MXG_TOK>(offsets, experts, blockIdx.y, e, t0)) return;
    mx_fill_table(mxg_smem, MXG_TAB_WORDS);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp & 7, wn = warp >> 3;
    const int r0 = blockIdx.x * MXG_AROWS, p0 = offsets[e] + t0, nt = min(MXG_TOK, offsets[e + 1] - p0);
    const i64 mat = (i64)e * latent;
    const u8* const pk[2] = {w2p + mat * (inter / 2), w2p + mat * (inter / 2)};
    const u8* const ps[2] = {w2s + mat * (inter / 32), w2s + mat * (inter / 32)};
    float acc[2][8][4];
    mxg_tile<false>(actx, 1, sorted, p0, nt, pk, ps, latent, inter, r0, acc);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int i = 32 * wn + 4 * q + t;
        if (i >= nt) continue;
        float* row = y + (i64)sorted[p0 + i] * latent;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = r0 + 32 * wm + 16 * m + 8 * h + g;
                if (r < latent) row[r] = acc[m][q][2 * h] + acc[m][q][2 * h + 1];
            }
    }
}

// Grid-stride over T * latent (256-thread blocks): out[t, c] = sum over slots j in order of
// w[t, j] y[t * top_k + j, c], skipping slots whose expert id is out of range (the sort drops
// them, so their y rows are never written: y needs no zeroing). moe_combine_f32's order.
extern "C" __global__ void moe_combine_ids_f32(const float* __restrict__ y, const int* __restrict__ idx,
                                               const float* __restrict__ w, float* __restrict__ out, int tokens,
                                               int top_k, int latent, int experts) {
    const i64 n = (i64)tokens * latent;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / latent, c = i % latent;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const int e = idx[t * top_k + j];
            if (e >= 0 && e < experts) acc += w[t * top_k + j] * y[(t * top_k + j) * latent + c];
        }
        out[i] = acc;
    }
}
