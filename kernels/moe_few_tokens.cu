// Routed experts in MXFP4 on tensor cores, for decode steps of 2 tokens and more (1-token steps
// take the single-token pair of moe_single_token.cu; dispatch.rs chooses). Each 16x16 weight tile is
// expanded to bf16 in registers (exact: an E2M1 value times a power of two fits bf16) and
// multiplied by mma.sync m16n8k16 against the step's tokens, each fed as one bf16 column
// (`planes` = 1: the backend's bfloat16 mode) or as two, hi = bf16(x) and lo = bf16(x - hi)
// (common.cuh split_bf16), whose products the f32 accumulator sums: ~16 mantissa bits of x, as
// moe_gemm.cu (`planes` = 2: float32 mode).
//
// Why this shape. At decode sizes the pair must stream every touched expert's weights at close to
// the HBM rate with few instructions per weight byte: the decode (mxfp4_mma.cuh mx_raw4: 11
// integer ops per word of four bf16x2, then one fma each with the block scale) is most of a
// stage's instructions, and a stage issues the mma and B loads of its pass's n-tiles only (the
// body is a template on the n-tile count: issued and predicated off, the other n-tiles cost a
// third of the instructions).
// Blocks are persistent (two per SM): each walks a fixed list of (expert, row block) tiles and
// its cp.async ring runs on across tile boundaries, so no block pays a launch, a ring fill or a
// drain per tile. The ring is paced by per-slot mbarriers, not a block barrier: a warp waits for
// its stage's data, and refills a slot after its own stage, so warps drift apart instead of
// meeting every stage (12-15 % faster at 4-16 tokens than the barrier form). The ring has as many
// stages as the launch's dynamic shared memory holds (at most MXF_MAX_STAGES, so probes need no
// rebuild); moe/mod.rs gives 3: with bf16 activations 4 run no faster and 5-6 slower, and 3 fit
// 99 KB parts. Probes in performance-history.md.
//
// Fragment mapping (PTX m16n8k16 .row.col): lane = 4 g + t holds A rows g and g + 8 at k = 2t,
// 2t + 1 (+8), B column g at the same k. The dot over k does not care which physical column a
// k slot stands for as long as A and B agree, so lane t takes one whole 16-byte MX block per
// row and super-step of 128 columns (block 4 ss + t: one uint4 and one scale per row). Word w of
// the block (8 columns, nibble i = column 8 w + i) feeds k-steps s = 2 w + h: mx_raw4's pair of
// nibbles 3 - 2h and 7 - 2h goes into the register for k 2t, 2t + 1 and nibbles 2 - 2h, 6 - 2h
// into the one for k 2t + 8, 2t + 9. The staged activations follow that order (mx_pos), so B is
// one 8-byte LDS per k-step and column. The scale is folded into the bf16 weights, so blocks can
// mix within an mma. With two planes, column n of an n-tile q is token 4 q + n / 2, hi (n even)
// or lo (n odd): lane t's accumulators c0 + c1 (row g) and c2 + c3 (row g + 8) are token
// 4 q + t's whole result.
// With one plane, column n is token 8 q + n: c0 / c2 are token 8 q + 2 t's rows, c1 / c3 token
// 8 q + 2 t + 1's (mxf_token, mxf_result).
#include "mxfp4_mma.cuh"

extern __shared__ __align__(16) u32 mxt_smem[];

// ---------------------------------------------------------------------------------------------
// Tiles: (busy expert, block of A-rows), ordered expert-major so that neighbouring blocks read the
// same tokens; block b takes tiles b, b + grid, ... Each stage is one super-step (128 columns =
// 4 MX blocks) of the tile's 256 A-rows, with an L2 256-byte prefetch hint so DRAM sees 256-byte
// runs of each row. Every token of the expert goes through each decoded weight fragment: a pass
// takes up to 32 / planes tokens (4 n-tiles of 8 columns), so the weights are read once per expert
// (experts with more tokens take another pass).
// Row-major staged tiles: A-row ar of a stage (64 bytes) sits at ar * 64, its 4 scale bytes at
// MXF_W_BYTES + 4 ar; the warp's 16-byte reads (8 rows x 4 lanes) cover all 32 banks 4 times.
// B row v = planes i + p (token i of the pass, plane p: 0 hi, 1 lo) at MXF_BRS-byte stride
// (conflict-free 8-byte fragment loads: the 32-byte pad spreads the 8 rows of a phase over all
// banks). xs layout (z and the intermediate): [row][ceil(cols / 128)][planes][128] bf16, column
// 128 ss + c at index mx_pos(c) of its super-step, columns past `cols` zero.
#define MXF_KC 128
#define MXF_MAX_STAGES 6

// Harness-only timing probes (benchmarks_moe.py bench_moe_few_tokens_diag, never built by the host): 1 = no
// weight decode (the raw words go to the mma), 2 = no mma (the decoded words are folded into the
// accumulators with one xor), 4 = no weight or scale copies from global memory (the stages keep
// stale bytes), 8 = no wait for a stage's copies (warps race the ring), 16 = no wait for the other
// warps before a slot is refilled (each warp's producer runs on uncoupled). Results are garbage on
// purpose. 0 in every real build.
#ifndef MXF_DIAG
#define MXF_DIAG 0
#endif
#define MXF_MAXNT 4
#define MXF_AROWS 256
#define MXF_BRS 272
#define MXF_W_BYTES (MXF_AROWS * 64)
#define MXF_S_BYTES (MXF_AROWS * 4)
#define MXF_BNT_BYTES (8 * MXF_BRS)
// The busy-expert list each block keeps in shared memory (moe/mod.rs checks the expert count).
#define MXF_MAX_EXPERTS 1024
// One ring stage for nt n-tiles per pass; the ring has dynamic shared memory / this many stages
// (moe/mod.rs few_token_shared).
#define MXF_STAGE_BYTES(nt) (MXF_W_BYTES + MXF_S_BYTES + (nt) * MXF_BNT_BYTES)
// MXFP8 mode: a staged token row is the super-step's 128 e4m3 bytes and its 4 block factors (f32),
// padded to 160 bytes (40 words: the 8-byte fragment loads of 4 rows x 4 lanes hit 32 banks).
#define MXF8_BRS 160
#define MXF8_STAGE_BYTES(nt) (MXF_W_BYTES + MXF_S_BYTES + (nt) * 8 * MXF8_BRS)

// Pass token (0-based) held in slot j (0, 1) of lane t's n-tile q: one per n-tile with two planes.
__device__ __forceinline__ int mxf_token(int planes, int q, int j, int t) {
    return planes == 2 ? 4 * q + t : 8 * q + 2 * t + j;
}
// That token's result for row g + 8 h from the n-tile's accumulators c.
__device__ __forceinline__ float mxf_result(const float (&c)[4], int planes, int j, int h) {
    return planes == 2 ? c[2 * h] + c[2 * h + 1] : c[2 * h + j];
}

// Grid (rows, ceil(cols / 128)), 32 threads: x [rows, cols] f32 -> xs, bf16 (planes 1) or hi / lo
// (planes 2), layout above.
extern "C" __global__ void mxfp4_experts_few_tokens_split_f32(const float* __restrict__ x, u16* __restrict__ xs, int rows, int cols,
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
        dst[mx_pos(cc + j)] = h;
        if (planes == 2) dst[128 + mx_pos(cc + j)] = l;
    }
}

// The busy experts (offsets[e + 1] > offsets[e]) in id order into `list`; returns their count.
// Block-uniform: every thread gets the count after the final barrier.
__device__ int mxf_busy_experts(const int* __restrict__ offsets, int experts, int* list) {
    __shared__ int warp_cnt[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int before = 0;
    for (int e0 = 0; e0 < experts; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x;
        const bool busy = e < experts && offsets[e + 1] > offsets[e];
        const u32 bal = __ballot_sync(K3_FULL_MASK, busy);
        if (lane == 0) warp_cnt[warp] = __popc(bal);
        __syncthreads();
        int rank = before + __popc(bal & ((1u << lane) - 1u)), total = 0;
        for (int w = 0; w < nwarps; ++w) {
            const int c = warp_cnt[w];
            rank += w < warp ? c : 0;
            total += c;
        }
        if (busy && rank < MXF_MAX_EXPERTS) list[rank] = e;
        before += total;
        __syncthreads();  // warp_cnt is rewritten by the next chunk; list is complete after the last
    }
    return min(before, MXF_MAX_EXPERTS);
}

// Compile-time arguments for the generic lambdas of few_tokens_walk (NVRTC has no <type_traits>).
template <bool B>
struct MxfBool {
    static constexpr bool value = B;
};
template <int N>
struct MxfInt {
    static constexpr int value = N;
};

// One tile: expert e, row block y (first row r0), its assignments sorted[a0 .. a0 + n), and its
// step count (passes x super-steps); nsteps == 0 past the last tile.
struct MxfTile {
    int e, y, r0, a0, n, nsteps;
};

// The whole persistent walk of one expert matrix pair. A-rows of a tile's stage are, for UP, rows
// r0 + 16 w + 0..15 of W1 (ar & 16 == 0) and of W3 (ar = 32 w + 16 m + rr) with r0 = 128 y, else
// rows r0 + ar of W2 with r0 = 256 y. Warp w's tiles m = 0, 1 are its A-rows 32 w + 16 m + 0..15.
// (wp0, ws0) / (wp1, ws1): all experts' packed rows and scales of W1 / W3 (UP) or W2 twice; rows
// and cols of one expert's matrix. emit(tile, t0, nt, acc[m][q]) stores pass results (the
// tokens and rows of mxf_token / mxf_result).
template <bool UP, bool FP8, typename Emit>
__device__ __forceinline__ void few_tokens_walk(const void* __restrict__ xs, const float* __restrict__ xf, int div,
                                                const u8* __restrict__ wp0,
                                                const u8* __restrict__ ws0, const u8* __restrict__ wp1,
                                                const u8* __restrict__ ws1, int rows, int cols,
                                                const int* __restrict__ offsets, const int* __restrict__ sorted,
                                                int experts, int ntiles, int planes, Emit emit) {
    __shared__ int busy_list[MXF_MAX_EXPERTS];
    __shared__ __align__(8) u64 ring_bars[2 * MXF_MAX_STAGES];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nb = cols >> 5;
    const int stage_bytes = FP8 ? MXF8_STAGE_BYTES(ntiles) : MXF_STAGE_BYTES(ntiles);
    u32 dyn_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    const int nstages = min(MXF_MAX_STAGES, (int)dyn_bytes / stage_bytes);  // at least 2 (moe/mod.rs: 3)
    // The ring's pacing: full[s] (at bars + 8 s) completes when all 256 threads' copies into slot
    // s have landed, empty[s] (at bars + 8 (MXF_MAX_STAGES + s)) when all 8 warps are done reading
    // it. Rows whose scales are not 4-byte aligned store them with plain stores, which arrive on
    // full[s] a second time.
    const u32 bars = (u32)__cvta_generic_to_shared(ring_bars);
    if (tid == 0) {
        for (int i = 0; i < nstages; ++i) {
            mbar_init(bars + 8 * i, (nb & 3) == 0 ? 256u : 512u);
            mbar_init(bars + 8 * (MXF_MAX_STAGES + i), 8u);
        }
    }
    // mxf_busy_experts' barriers (at least one: experts >= 1) also publish the initialised mbarriers.
    const int nbusy = mxf_busy_experts(offsets, experts, busy_list);
    const int tile_rows = UP ? 128 : MXF_AROWS, ny = (rows + tile_rows - 1) / tile_rows, ntile = nbusy * ny;
    const int nch = (cols + MXF_KC - 1) / MXF_KC, per = FP8 ? 8 * ntiles : 8 * ntiles / planes;
    const u8* stages = reinterpret_cast<const u8*>(mxt_smem);
    const u32 stages_s = (u32)__cvta_generic_to_shared(mxt_smem);

    // The stage row of this lane's A-fragment row g + 8 h of m-tile m (the consumers' rows).
    auto arow = [&](int m, int h) { return 32 * warp + 16 * m + 8 * h + g; };
    auto tile_at = [&](int k, MxfTile& T) {
        T.nsteps = 0;
        if (k >= ntile) return;
        const int x = k / ny;
        T.e = busy_list[x];
        T.y = k - x * ny;
        T.r0 = T.y * tile_rows;
        T.a0 = offsets[T.e];
        T.n = offsets[T.e + 1] - T.a0;
        T.nsteps = ((T.n + per - 1) / per) * nch;
    };

    // Copy duty: 16 bytes (tid & 3) of A-rows (tid >> 2) + 64 i, the scales of A-row tid, and
    // 16 bytes (tid & 15) of staged B rows (tid >> 4) + 16 k. Tail rows are clamped (loaded, never
    // stored).
    MxfTile it = {};
    int ik = blockIdx.x, ij = 0, ipass = 0, ic = 0, b_pass = -1, b_row = 0;
    const u16* b_src[2] = {nullptr, nullptr};
    const u8* wsrc[4];
    const u8* ssrc = ws0;
    auto aim = [&]() {  // the issue side's per-thread sources for tile `it`
        const i64 mat = (i64)it.e * rows;
#pragma unroll
        for (int i = 0; i < 5; ++i) {
            const int ar = i < 4 ? (tid >> 2) + 64 * i : tid;
            const int m = UP ? (ar >> 4) & 1 : 0;
            const int r = min(UP ? it.r0 + 16 * (ar >> 5) + (ar & 15) : it.r0 + ar, rows - 1);
            if (i < 4)
                wsrc[i] = (m ? wp1 : wp0) + (mat + r) * (cols / 2) + 16 * (tid & 3);  // select: no local array
            else
                ssrc = (m ? ws1 : ws0) + (mat + r) * nb;
        }
        b_pass = -1;
    };
    tile_at(ik, it);
    if (it.nsteps > 0) aim();

    auto issue = [&](u32 slot) {
        const int pass = ipass, c = ic;
        const u32 bs = stages_s + slot * stage_bytes;
        const bool in = 4 * c + (tid & 3) < nb;  // past the row's end: zeros (byte 0 decodes to +0)
        // MXFP8 reads word t of each block (one MX block per mma): block b of A-row ar is stored at
        // chunk b ^ ((ar >> 1) & 3), which spreads a warp's 32 four-byte reads over all banks.
        const int chunk = FP8 ? (tid & 3) ^ ((tid >> 3) & 3) : tid & 3;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if ((MXF_DIAG & 4) == 0)
                mx_cp16_l2(bs + ((tid >> 2) + 64 * i) * 64 + 16 * chunk, wsrc[i] + (in ? 64 * c : 0), in ? 16u : 0u);
        if ((MXF_DIAG & 4) != 0) {
        } else if ((nb & 3) == 0) {
            mx_cp4(bs + MXF_W_BYTES + 4 * tid, ssrc + 4 * c);
        } else {  // rows of nb % 4 != 0 blocks: scale rows not 4-byte aligned (test shapes only)
            u32 v = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (4 * c + k < nb) v |= (u32)ssrc[4 * c + k] << (8 * k);
            *reinterpret_cast<u32*>(mxt_smem + (slot * stage_bytes + MXF_W_BYTES) / 4 + tid) = v;
            mbar_arrive(bars + 8 * slot);  // release: the store is seen by whoever waits on full
        }
        const int t0 = pass * per, nt = min(per, it.n - t0);
        if constexpr (FP8) {  // token row v = tid / 8: 16-byte chunk tid % 8 of its e4m3, chunk 0 also its factors
            const int v = tid >> 3, c8 = tid & 7;
            if (pass != b_pass) {
                b_pass = pass;
                if (v < nt) b_row = sorted[it.a0 + t0 + v] / div;
            }
            if (v < nt) {
                const i64 at = (i64)b_row * nch + c;
                const u32 dst = bs + MXF_W_BYTES + MXF_S_BYTES + v * MXF8_BRS;
                mx_cp16(dst + 16 * c8, static_cast<const u8*>(xs) + at * 128 + 16 * c8);
                if (c8 == 0) mx_cp16(dst + 128, xf + at * 4);
            }
            mbar_arrive_copies(bars + 8 * slot);
            return;
        }
        // A pass's token rows are fixed, so their sources are set once per pass (null: no token) and
        // each stage only adds its super-step's offset.
        if (pass != b_pass) {
            b_pass = pass;
            const int sh = planes - 1;  // staged row v holds plane v & sh of pass token v >> sh
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int v = (tid >> 4) + 16 * k, i = v >> sh;
                b_src[k] = i < nt ? static_cast<const u16*>(xs) +
                                        ((i64)(sorted[it.a0 + t0 + i] / div) * nch * planes + (v & sh)) * 128 +
                                        8 * (tid & 15)
                                  : nullptr;
            }
        }
        const u32 b_dst = bs + MXF_W_BYTES + MXF_S_BYTES + (tid >> 4) * MXF_BRS + 16 * (tid & 15);
#pragma unroll
        for (int k = 0; k < 2; ++k)
            if (b_src[k] != nullptr) mx_cp16(b_dst + 16 * k * MXF_BRS, b_src[k] + c * planes * 128);
        mbar_arrive_copies(bars + 8 * slot);
    };
    // The producer's next slot and how many times the ring has wrapped under it.
    u32 islot = 0, iwraps = 0;
    auto issue_next = [&]() {
        if (it.nsteps > 0) {  // block-uniform
            if ((MXF_DIAG & 16) == 0 && iwraps > 0)
                mbar_wait(bars + 8 * (MXF_MAX_STAGES + islot), (iwraps - 1) & 1);  // slot read out
            issue(islot);
            if (++ic == nch) {
                ic = 0;
                ++ipass;
            }
            if (++ij == it.nsteps) {
                ik += gridDim.x;
                ij = ipass = 0;
                tile_at(ik, it);
                if (it.nsteps > 0) aim();
            }
        }
        if (++islot == (u32)nstages) {
            islot = 0;
            ++iwraps;
        }
    };

    for (int j = 0; j < nstages - 1; ++j) issue_next();
    float acc[2][MXF_MAXNT][4];
    // One stage (super-step) of NT n-tiles: decode each weight fragment once and multiply it with
    // the pass's first NT n-tiles. TWO: the two-multiply decode (mx_scaled). The n-tile count is a
    // template argument so that a pass of few tokens issues only its own mma and B loads.
    auto mma_stage = [&](const u8* buf, const u32 (&sb)[2][2], auto two_c, auto nt_c) {
        constexpr bool two = decltype(two_c)::value;
        constexpr int NT = decltype(nt_c)::value;
        uint4 wv[2][2];
        u32 sc[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ar = arow(m, h);
                wv[m][h] = *reinterpret_cast<const uint4*>(buf + ar * 64 + 16 * t);
                sc[m][h] = two ? mx_scale2(sb[m][h]) : mx_scale2_folded(sb[m][h]);
            }
        const u8* bb = buf + MXF_W_BYTES + MXF_S_BYTES + g * MXF_BRS + 8 * t;
        u32 raw[2][2][4];  // mx_raw4 of the word k-steps s and s + 1 share (rows g, g + 8 of each m-tile)
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            u32 a[2][4];
            const int p = (s & 1) ? 1 : 3;  // s even: nibble pairs (3, 7), (2, 6); odd: (1, 5), (0, 4)
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const u32 w0 = mx_word(wv[m][0], s >> 1), w1 = mx_word(wv[m][1], s >> 1);
                if ((MXF_DIAG & 1) != 0) {
                    const int sh = 8 * (s & 1);
                    a[m][0] = w0 << sh, a[m][1] = w1 << sh, a[m][2] = w0 << (sh + 4), a[m][3] = w1 << (sh + 4);
                    continue;
                }
                if ((s & 1) == 0) {
                    mx_raw4(w0, raw[m][0]);
                    mx_raw4(w1, raw[m][1]);
                }
                a[m][0] = mx_scaled(raw[m][0][p], sc[m][0], two);
                a[m][1] = mx_scaled(raw[m][1][p], sc[m][1], two);
                a[m][2] = mx_scaled(raw[m][0][p - 1], sc[m][0], two);
                a[m][3] = mx_scaled(raw[m][1][p - 1], sc[m][1], two);
            }
#pragma unroll
            for (int q = 0; q < NT; ++q) {
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
    };
    // MXFP8 stage: per MX block b of the super-step, each lane's word t of its four A-rows becomes
    // two e4m3 words (even / odd columns: k slots 4t..4t+3 and 16+4t..), one m16n8k32 per row tile and
    // n-tile into a fresh accumulator, then scaled by the weight block's 2^(s-127) times the token
    // block's factor (the activation scale x 2^6, undoing the decode's 2^-6) into the f32 sums.
    // The staged token row of n-tile q, token n is 8 q + n: fragment bytes 8t of block b at 32 b + 8 t.
    auto mma_stage8 = [&](const u8* buf, auto nt_c) {
        constexpr int NT = decltype(nt_c)::value;
        const u8* bb = buf + MXF_W_BYTES + MXF_S_BYTES;
        const int swz = (g >> 1) & 3;  // (ar >> 1) & 3 of this lane's A-rows
        u32 s4[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) s4[m][h] = *reinterpret_cast<const u32*>(buf + MXF_W_BYTES + 4 * arow(m, h));
#pragma unroll(NT <= 2 ? 4 : 1)
        for (int B = 0; B < 4; ++B) {
            u32 a[2][4];
            float fw[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 w = *reinterpret_cast<const u32*>(buf + arow(m, h) * 64 + 16 * (B ^ swz) + 4 * t);
                    a[m][h] = mx_e4m3_even(w);
                    a[m][2 + h] = mx_e4m3_odd(w);
                    fw[m][h] = mx_scale_f32(s4[m][h], B);
                }
#pragma unroll
            for (int q = 0; q < NT; ++q) {
                const uint2 v = *reinterpret_cast<const uint2*>(bb + (8 * q + g) * MXF8_BRS + 32 * B + 8 * t);
                const float f0 = *reinterpret_cast<const float*>(bb + (8 * q + 2 * t) * MXF8_BRS + 128 + 4 * B);
                const float f1 = *reinterpret_cast<const float*>(bb + (8 * q + 2 * t + 1) * MXF8_BRS + 128 + 4 * B);
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
    // The 2^126 of mx_raw4 folds into the scale unless a block's scale is too large for that
    // (never in trained weights): then the warp takes the two-multiply path for that stage.
    auto run_stage = [&](const u8* buf, auto nt_c) {
        if constexpr (FP8) {
            mma_stage8(buf, nt_c);
            return;
        }
        u32 sb[2][2];  // the scale bytes of this lane's four A-rows, read once for both uses
        bool big = false;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                sb[m][h] = buf[MXF_W_BYTES + 4 * arow(m, h) + t];
                big |= sb[m][h] > MX_DEC_MAX_FOLDED;
            }
        if (__any_sync(K3_FULL_MASK, big))
            mma_stage(buf, sb, MxfBool<true>{}, nt_c);
        else
            mma_stage(buf, sb, MxfBool<false>{}, nt_c);
    };
    // Tiles, then passes of up to `per` tokens, then the nch super-steps of a pass: the
    // accumulators are zeroed once per pass and the stage body is chosen once per pass.
    u32 cslot = 0, cparity = 0;  // the consumer's slot and its full barrier's phase parity
    MxfTile ct = {};
    for (int ck = blockIdx.x;; ck += gridDim.x) {
        tile_at(ck, ct);
        if (ct.nsteps == 0) break;  // block-uniform
        const int npass = ct.nsteps / nch;
        for (int pass = 0; pass < npass; ++pass) {
            const int t0 = pass * per, nt = min(per, ct.n - t0), ntl = (nt * (FP8 ? 1 : planes) + 7) >> 3;
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int q = 0; q < MXF_MAXNT; ++q)
#pragma unroll
                    for (int k = 0; k < 4; ++k) acc[m][q][k] = 0.0f;
            for (int c = 0; c < nch; ++c) {
                if ((MXF_DIAG & 8) == 0) mbar_wait(bars + 8 * cslot, cparity);
                const u8* buf = stages + cslot * stage_bytes;
                switch (ntl) {  // block-uniform
                    case 1: run_stage(buf, MxfInt<1>{}); break;
                    case 2: run_stage(buf, MxfInt<2>{}); break;
                    case 3: run_stage(buf, MxfInt<3>{}); break;
                    default: run_stage(buf, MxfInt<MXF_MAXNT>{}); break;
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(bars + 8 * (MXF_MAX_STAGES + cslot));
                // Then refill the slot the previous stage read: by now the other warps have almost
                // always finished it, so the wait for its empty barrier is short, and this warp
                // never waits for another warp before its own next stage's data.
                issue_next();
                if (++cslot == (u32)nstages) {
                    cslot = 0;
                    cparity ^= 1u;
                }
            }
            emit(ct, t0, nt, acc);
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives the block
}

// Persistent grid (moe/mod.rs few_token_launch: at most two blocks per SM), 256 threads, shared
// bytes for 2..MXF_MAX_STAGES stages of `ntiles` (1..4) n-tiles per pass: tile (x, y) writes
// super-step y of actx = SiTU-GLU(W1 z, W3 z) for every assignment of the x-th busy expert, in
// `planes` bf16 planes (xs layout, rows past inter zero): the down kernel's B. zx: mxfp4_experts_few_tokens_split_f32 of z; z's
// token of assignment a is a / top_k; `experts` = E; SiTU-GLU parameters beta, beta_lin, has_lin.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_up_f32(const u16* __restrict__ zx, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
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
                                              u16* dst = actx + (((i64)sorted[T.a0 + t0 + i] * nss + T.y) * planes) * 128 + mx_pos(rl);
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
// (mxfp4_experts_few_tokens_up_f32).
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_down_f32(const u16* __restrict__ actx, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                   const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y, int latent,
                   int inter, int experts, int ntiles, int planes) {
    few_tokens_down<false>(actx, nullptr, w2p, w2s, offsets, sorted, y, latent, inter, experts, ntiles, planes);
}

// ---------------------------------------------------------------------------------------------
// MXFP8 mode (CudaOptions::dtype Mxfp8): the routed experts take their activations as MXFP8 (E4M3
// values, one E8M0 scale per 32), the format K3 ships them in, on FP8 tensor cores.

// Grid (rows, ceil(cols / 128)), 32 threads: x [rows, cols] f32 -> xq [rows][super-steps][128] e4m3 in
// fragment order (block b's bytes at 32 b, lane t's 8 at 8 t: columns 8 t + 0, 2, 4, 6, then 1, 3, 5, 7)
// and xf [rows][super-steps][4]: each block's scale 2^e times 2^6 (the weight decode's 2^-6 undone).
// reference/k3ref/mxfp8.py defines the rule. The block's e is the least with max |x| / 2^e <= 448
// (E4M3's largest value; at least -127): the OCP MX rule floor(log2(max |x|)) - 8 would clip blocks
// whose largest value lies in (448, 512) x 2^e to 448, the whole of a 12.5 % error. x / 2^e rounds to
// nearest even. Columns past `cols` are zero.
extern "C" __global__ void mxfp8_quantize_f32(const float* __restrict__ x, u8* __restrict__ xq, float* __restrict__ xf,
                                              int rows, int cols) {
    const int row = blockIdx.x, ss = blockIdx.y, lane = threadIdx.x, col = MXF_KC * ss + 4 * lane;
    if (row >= rows) return;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < cols) {  // cols % 32 == 0: the whole float4 is in the row
        const float4 f = *reinterpret_cast<const float4*>(x + (i64)row * cols + col);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int d = 1; d < 8; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(K3_FULL_MASK, amax, d));  // 8 lanes per block
    const u32 ab = __float_as_uint(amax);
    const int e = max((int)((ab >> 23) & 0xffu) - 127 - 8 + ((ab & 0x7fffffu) > 0x600000u), -127);
    const float inv = __uint_as_float((u32)(127 - e) << 23);  // 2^-e: e in [-127, 119]
    u16 p01, p23;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p01) : "f"(v[1] * inv), "f"(v[0] * inv));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p23) : "f"(v[3] * inv), "f"(v[2] * inv));
    const u32 q = p01 | ((u32)p23 << 16);
    const i64 at = (i64)row * gridDim.y + ss;
    const int b = lane >> 3, word = (lane & 7) >> 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = 4 * (lane & 1) + j;  // nibble (column within the word)
        xq[at * 128 + 32 * b + 8 * word + (i & 1) * 4 + (i >> 1)] = (u8)(q >> (8 * j));
    }
    if ((lane & 7) == 0) xf[at * 4 + b] = __uint_as_float((u32)(e + 127 + 6) << 23);
}

// The up kernel of the MXFP8 pair: as mxfp4_experts_few_tokens_up_f32 with z from mxfp8_quantize_f32
// (zq, zf), writing act [assignments, inter] = SiTU-GLU(W1 z, W3 z) in f32 for mxfp8_quantize_f32.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_experts_few_tokens_up_e4m3(const u8* __restrict__ zq, const float* __restrict__ zf, const u8* __restrict__ w1p,
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
mxfp4_experts_few_tokens_down_e4m3(const u8* __restrict__ aq, const float* __restrict__ af, const u8* __restrict__ w2p,
                                   const u8* __restrict__ w2s, const int* __restrict__ offsets,
                                   const int* __restrict__ sorted, float* __restrict__ y, int latent, int inter,
                                   int experts, int ntiles) {
    few_tokens_down<true>(aq, af, w2p, w2s, offsets, sorted, y, latent, inter, experts, ntiles, 1);
}
