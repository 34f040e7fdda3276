// Routed experts in MXFP4 on tensor cores, for decode steps of 2 tokens and more (1-token steps
// take the single-token pair of moe_single_token.cu; dispatch.rs chooses). Each 16x16 weight tile is
// expanded to bf16 in registers (exact: an E2M1 value times a power of two fits bf16) and
// multiplied by mma.sync m16n8k16 against the step's tokens, each fed as two bf16 columns
// hi = bf16(x), lo = bf16(x - hi) (common.cuh split_bf16) whose products the f32 accumulator
// sums: ~16 mantissa bits of x, as moe_gemm.cu.
//
// Why: CUDA-core kernels spend ~11 shared / L1 wavefronts per 4 weight bytes per warp (8
// nibble-table loads, 2 activation loads, the weight load) against ~7 SM cycles that 4.25 TB/s
// allows, and every extra token costs 8 more FMAs per word. Here a byte (two nibbles) decodes in
// registers (mxfp4_mma.cuh mx_pair_alu: the nibbles placed as bf16 bits, E2M1 x 2^-126, then two
// exact bf16x2 fmas: x 2^126 and x the block scale), and one mma covers up to 4 tokens (8 hi/lo
// columns) for 16 rows x 16 columns, so more tokens per pass are nearly free. The register decode
// gives the same bits as a 256-entry bf16x2 table replicated per lane in shared memory (mx_pair)
// without its 32 KB and one LDS per byte, and is the faster of the two; a 4- or 5-stage ring is
// slower than MXF_STAGES with either decode.
// What bounds the up kernel (the MXF_DIAG probes below take parts away): the decode is the largest
// single part, and the per-block fixed costs of the many short blocks (block start, token copies,
// one barrier per stage, the epilogue) are the next: fewer, longer-lived blocks (several row
// blocks or experts per block) would amortise them.
//
// Fragment mapping (PTX m16n8k16 .row.col): lane = 4 g + t holds A rows g and g + 8 at k = 2t,
// 2t + 1 (+8), B column g at the same k. The dot over k does not care which physical column a
// k slot stands for as long as A and B agree, so lane t takes one whole 16-byte MX block per
// row and super-step of 128 columns (block 4 ss + t: one uint4 and one scale per row), and k-step
// s (0..7) of the super-step uses bytes 2s (k 2t, 2t+1) and 2s + 1 (k 2t+8, 2t+9): columns
// 32 (4 ss + t) + 4 s + 0..3. The staged activations are laid out in that order, so B is one
// 8-byte LDS per k-step and column. The scale is folded into the bf16 weights, so blocks can mix
// within an mma. Column n of an n-tile q is token 4 q + n / 2, hi (n even) or lo (n odd): lane t's
// accumulators c0 + c1 (row g) and c2 + c3 (row g + 8) are token 4 q + t's whole result.
#include "mxfp4_mma.cuh"

extern __shared__ __align__(16) u32 mxt_smem[];

// ---------------------------------------------------------------------------------------------
// The few-token pair (moe/mod.rs, from 2 tokens): the decode (scale folded in) and mma
// fragments above, and
// - every token of the expert goes through each decoded weight fragment: a pass takes up to 16
//   tokens (4 n-tiles of 4 tokens x hi/lo), so the weights are read once per expert (experts with
//   more than 16 tokens take another pass). A first tensor-core pair (deleted) staged 8 tokens
//   per pass from f32 rows and re-read the weights every 8 tokens;
// - weights stream through a 3-stage cp.async ring in shared memory (no registers held by loads
//   in flight: two 17 KB stages per block, two blocks per SM), each stage one super-step (128
//   columns = 4 MX blocks) of 256 weight rows, with an L2 256-byte prefetch hint so DRAM sees
//   256-byte runs of each row. One barrier per stage;
// - the activations are split into hi / lo bf16 once (mxfp4_experts_few_tokens_split_f32 for z; the up kernel's
//   epilogue for the intermediate), already in the fragment column order of the header, so a
//   stage's B tile is a plain 512-byte copy per token.
// Row-major staged tiles: A-row ar of a stage (64 bytes) sits at ar * 64, its 4 scale bytes at
// MXF_W_BYTES + 4 ar; the warp's 16-byte reads (8 rows x 4 lanes) cover all 32 banks 4 times.
// B row v = 2 i + p (token i of the pass, p = 0 hi / 1 lo) at MXF_BRS-byte stride (conflict-free
// 8-byte fragment loads: the 32-byte pad spreads the 8 rows of a phase over all banks).
// xs layout (both split forms): [row][ceil(cols / 128)][p][128] bf16, column 128 ss + c at index
// mx_pos(c) of its super-step (c = 32 t + 4 s + j -> 16 s + 4 t + j: lane t's k-step s reads 4
// consecutive values), columns past `cols` zero.
#define MXF_KC 128
#define MXF_STAGES 3
// Harness-only timing probes (benchmarks.py bench_moe_few_tokens_diag, never built by the host): 1 = no
// weight decode (the raw words go to the mma), 2 = no mma (the decoded words are folded into the
// accumulators with one xor), 4 = no weight or scale copies from global memory (the stages keep
// stale bytes). Results are garbage on purpose. 0 in every real build.
#ifndef MXF_DIAG
#define MXF_DIAG 0
#endif
#define MXF_MAXNT 4
#define MXF_AROWS 256
#define MXF_BRS 272
#define MXF_W_BYTES (MXF_AROWS * 64)
#define MXF_S_BYTES (MXF_AROWS * 4)
#define MXF_BNT_BYTES (8 * MXF_BRS)
// Dynamic shared memory for nt n-tiles per pass: 3 stages (moe/mod.rs few_token_shared; 78,336 B at
// nt = 4: two blocks per SM).
#define MXF_STAGE_BYTES(nt) (MXF_W_BYTES + MXF_S_BYTES + (nt) * MXF_BNT_BYTES)

static_assert(MXF_STAGES == 3, "mx_wait_all_but_one waits for all but MXF_STAGES - 2 groups");

// Grid (rows, ceil(cols / 128)), 32 threads: x [rows, cols] f32 -> xs hi / lo bf16 (layout above).
extern "C" __global__ void mxfp4_experts_few_tokens_split_f32(const float* __restrict__ x, u16* __restrict__ xs, int rows, int cols) {
    const int row = blockIdx.x, ss = blockIdx.y, cc = 4 * threadIdx.x, col = MXF_KC * ss + cc;
    if (row >= rows) return;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < cols) {  // cols % 32 == 0: the whole float4 is in the row
        const float4 f = *reinterpret_cast<const float4*>(x + (i64)row * cols + col);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
    u16 h[4], l[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) split_bf16(v[j], h[j], l[j]);
    u16* dst = xs + ((i64)row * gridDim.y + ss) * 256 + mx_pos(cc);
    *reinterpret_cast<uint2*>(dst) = make_uint2(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16));
    *reinterpret_cast<uint2*>(dst + 128) = make_uint2(l[0] | ((u32)l[1] << 16), l[2] | ((u32)l[3] << 16));
}

// One block's part of expert e: the n assignments sorted[a0 ..), B rows xs[sorted[.] / div]; the
// 256 A-rows of a stage are, for UP, rows r0 + 16 w + 0..15 of W1 (ar & 16 == 0) and of W3
// (ar = 32 w + 16 m + rr), else rows r0 + ar of W2. Warp w's tiles m = 0, 1 are its A-rows
// 32 w + 16 m + 0..15. emit(t0, nt, out[m][q][h]) stores pass results (token t0 + 4 q + t, row g + 8 h).
template <bool UP, typename Emit>
__device__ __forceinline__ void few_tokens_expert(const u16* __restrict__ xs, int div, const u8* const (&pk)[2],
                                           const u8* const (&ps)[2], int rows, int cols, int r0,
                                           const int* __restrict__ sorted, int a0, int n, int ntiles, Emit emit) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nb = cols >> 5, nch = (cols + MXF_KC - 1) / MXF_KC, per = 4 * ntiles;
    const int nsteps = ((n + per - 1) / per) * nch, stage_bytes = MXF_STAGE_BYTES(ntiles);
    const u8* stages = reinterpret_cast<const u8*>(mxt_smem);
    const u32 stages_s = (u32)__cvta_generic_to_shared(mxt_smem);

    // Copy duty: 16 bytes (tid & 3) of A-rows (tid >> 2) + 64 i, the scales of A-row tid, and
    // piece `lane` of tokens warp and warp + 8. Tail rows are clamped (loaded, never stored).
    auto src_row = [&](int ar, int& m) {
        m = UP ? (ar >> 4) & 1 : 0;
        return min(UP ? r0 + 16 * (ar >> 5) + (ar & 15) : r0 + ar, rows - 1);
    };
    const u8* wsrc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int m;
        const int r = src_row((tid >> 2) + 64 * i, m);
        wsrc[i] = (m ? pk[1] : pk[0]) + (i64)r * (cols / 2) + 16 * (tid & 3);  // select: no local array
    }
    int sm;
    const int sr = src_row(tid, sm);
    const u8* ssrc = (sm ? ps[1] : ps[0]) + (i64)sr * nb;
    int b_pass = -1, b_row[2] = {0, 0};

    auto issue = [&](int j) {
        const int pass = j / nch, c = j - pass * nch;
        const u32 bs = stages_s + (j % MXF_STAGES) * stage_bytes;
        const bool in = 4 * c + (tid & 3) < nb;  // past the row's end: zeros (byte 0 decodes to +0)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if ((MXF_DIAG & 4) == 0)
                mx_cp16_l2(bs + ((tid >> 2) + 64 * i) * 64 + 16 * (tid & 3), wsrc[i] + (in ? 64 * c : 0), in ? 16u : 0u);
        if ((MXF_DIAG & 4) != 0) {
        } else if ((nb & 3) == 0) {
            mx_cp4(bs + MXF_W_BYTES + 4 * tid, ssrc + 4 * c);
        } else {  // rows of nb % 4 != 0 blocks: scale rows not 4-byte aligned (test shapes only)
            u32 v = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (4 * c + k < nb) v |= (u32)ssrc[4 * c + k] << (8 * k);
            *reinterpret_cast<u32*>(mxt_smem + ((j % MXF_STAGES) * stage_bytes + MXF_W_BYTES) / 4 +
                                    tid) = v;
        }
        const int t0 = pass * per, nt = min(per, n - t0);
        if (pass != b_pass) {
            b_pass = pass;
#pragma unroll
            for (int k = 0; k < 2; ++k)
                if (warp + 8 * k < nt) b_row[k] = sorted[a0 + t0 + warp + 8 * k] / div;
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int i = warp + 8 * k;
            if (i < nt)
                mx_cp16(bs + MXF_W_BYTES + MXF_S_BYTES + (2 * i + (lane >> 4)) * MXF_BRS + 16 * (lane & 15),
                         xs + ((i64)b_row[k] * nch + c) * 256 + 8 * lane);
        }
    };

    float acc[2][MXF_MAXNT][4];
#pragma unroll
    for (int j = 0; j < MXF_STAGES - 1; ++j) {
        if (j < nsteps) issue(j);
        mx_commit();
    }
    for (int j = 0; j < nsteps; ++j) {
        mx_wait_all_but_one();  // stage j's copies (this thread's) are done: MXF_STAGES - 2 = 1 younger group
        __syncthreads();         // everyone's are, and everyone is done with stage j - 1's buffer
        if (j + MXF_STAGES - 1 < nsteps) issue(j + MXF_STAGES - 1);
        mx_commit();  // (possibly empty: keeps the group count per step fixed)
        const int pass = j / nch, c = j - pass * nch;
        const int t0 = pass * per, nt = min(per, n - t0), ntl = (nt + 3) >> 2;
        if (c == 0) {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                    for (int k = 0; k < 4; ++k) acc[m][q][k] = 0.0f;
        }
        const u8* buf = stages + (j % MXF_STAGES) * stage_bytes;
        uint4 wv[2][2];
        u32 sc[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ar = 32 * warp + 16 * m + 8 * h + g;
                wv[m][h] = *reinterpret_cast<const uint4*>(buf + ar * 64 + 16 * t);
                sc[m][h] = mx_scale2(buf[MXF_W_BYTES + 4 * ar + t]);
            }
        const u8* bb = buf + MXF_W_BYTES + MXF_S_BYTES + g * MXF_BRS + 8 * t;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            u32 a[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const u32 w0 = mx_word(wv[m][0], s >> 1), w1 = mx_word(wv[m][1], s >> 1);
                const int by = 2 * (s & 1);
                if ((MXF_DIAG & 1) != 0) {
                    a[m][0] = w0, a[m][1] = w1, a[m][2] = w0 >> 8, a[m][3] = w1 >> 8;
                    continue;
                }
                a[m][0] = mx_pair_alu(w0, by, sc[m][0]);
                a[m][1] = mx_pair_alu(w1, by, sc[m][1]);
                a[m][2] = mx_pair_alu(w0, by + 1, sc[m][0]);
                a[m][3] = mx_pair_alu(w1, by + 1, sc[m][1]);
            }
#pragma unroll
            for (int q = 0; q < MXF_MAXNT; ++q)
                if (q < ntl) {  // block-uniform
                    const uint2 v = *reinterpret_cast<const uint2*>(bb + q * 8 * MXF_BRS + 32 * s);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        if ((MXF_DIAG & 2) != 0)
                            acc[m][q][0] += __uint_as_float(a[m][0] ^ a[m][1] ^ a[m][2] ^ a[m][3] ^ v.x ^ v.y);
                        else
                            tc_mma_bf16(acc[m][q], a[m][0], a[m][1], a[m][2], a[m][3], v.x, v.y);
                    }
                }
        }
        if (c == nch - 1) {
            float out[2][MXF_MAXNT][2];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int q = 0; q < MXF_MAXNT; ++q) {
                    out[m][q][0] = acc[m][q][0] + acc[m][q][1];
                    out[m][q][1] = acc[m][q][2] + acc[m][q][3];
                }
            emit(t0, nt, out);
        }
    }
}

// Grid (min(E, assignments), ceil(inter / 128)), 256 threads, MX2 shared bytes for `ntiles` (1..4)
// n-tiles per pass: block y writes super-step y of actx = SiTU-GLU(W1 z, W3 z) for every
// assignment of its expert, hi / lo split (xs layout, rows past inter zero): the down kernel's B.
// zx: mxfp4_experts_few_tokens_split_f32 of z; z's token of assignment a is a / top_k; `experts` = E (block x
// takes the x-th busy expert: mx_active_expert); SiTU-GLU parameters beta, beta_lin, has_lin.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_up_f32(const u16* __restrict__ zx, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                 const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                 const int* __restrict__ sorted, u16* __restrict__ actx, int top_k, int latent, int inter, float beta,
                 float beta_lin, int has_lin, int experts, int ntiles) {
    const int e = mx_active_expert(offsets, experts, blockIdx.x);
    if (e < 0) return;  // block-uniform
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * 128, a0 = offsets[e];
    const i64 mat = (i64)e * inter;
    const u8* const pk[2] = {w1p + mat * (latent / 2), w3p + mat * (latent / 2)};
    const u8* const ps[2] = {w1s + mat * (latent / 32), w3s + mat * (latent / 32)};
    few_tokens_expert<true>(zx, top_k, pk, ps, inter, latent, r0, sorted, a0, offsets[e + 1] - a0, max(1, min(ntiles, MXF_MAXNT)),
                     [&](int t0, int nt, const float(&o)[2][MXF_MAXNT][2]) {
#pragma unroll
                         for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                             for (int h = 0; h < 2; ++h) {
                                 const int i = 4 * q + t, rl = 16 * warp + 8 * h + g;
                                 if (i < nt) {
                                     const float v = r0 + rl < inter ? situ_glu_one(o[0][q][h], o[1][q][h], beta,
                                                                                    beta_lin, has_lin)
                                                                     : 0.0f;
                                     u16 hi, lo;
                                     split_bf16(v, hi, lo);
                                     u16* dst = actx + ((i64)sorted[a0 + t0 + i] * gridDim.y + blockIdx.y) * 256 +
                                                mx_pos(rl);
                                     dst[0] = hi;
                                     dst[128] = lo;
                                 }
                             }
                     });
}

// Grid (min(E, assignments), ceil(latent / 256)), 256 threads, MX2 shared bytes: y[a, r] =
// W2_e[r, :] . act[a, :] with act from actx (mxfp4_experts_few_tokens_up_f32), for every sorted assignment a
// of the block's expert.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_down_f32(const u16* __restrict__ actx, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                   const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y, int latent,
                   int inter, int experts, int ntiles) {
    const int e = mx_active_expert(offsets, experts, blockIdx.x);
    if (e < 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * MXF_AROWS, a0 = offsets[e];
    const i64 mat = (i64)e * latent;
    const u8* const pk[2] = {w2p + mat * (inter / 2), w2p + mat * (inter / 2)};
    const u8* const ps[2] = {w2s + mat * (inter / 32), w2s + mat * (inter / 32)};
    few_tokens_expert<false>(actx, 1, pk, ps, latent, inter, r0, sorted, a0, offsets[e + 1] - a0, max(1, min(ntiles, MXF_MAXNT)),
                      [&](int t0, int nt, const float(&o)[2][MXF_MAXNT][2]) {
#pragma unroll
                          for (int m = 0; m < 2; ++m)
#pragma unroll
                              for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                                  for (int h = 0; h < 2; ++h) {
                                      const int i = 4 * q + t, r = r0 + 32 * warp + 16 * m + 8 * h + g;
                                      if (i < nt && r < latent) y[(i64)sorted[a0 + t0 + i] * latent + r] = o[m][q][h];
                                  }
                      });
}
