// Absorbed MLA decode attend in bf16 precision (ops.rs MlaDecodeMode::Bf16, the default): the
// same contract as mla_attend_tf32_f32 (kernels/mla.cu) — qt [items, H, row] from the absorb kernel, the paged f32
// latent cache, per-item splits (chunk <= 0), partials [items, H, splits, kv_lora + 2] for
// mla_merge_f32 — with single bf16 mma.sync m16n8k16 (f32 accumulate) in place of 3xTF32.
// Rounding: q~ * scale and the cache rows are rounded to bf16 (RNE) when staged in shared memory,
// scores and the online softmax stay f32, P is rounded to bf16 for P V (the row sums l use the
// rounded P, so the weights the merge normalises are the ones that were applied).
//
// Why this shape. At 60 % of HBM the H200 must finish a 2304-byte row every ~0.9 ns, i.e. ~230
// TFLOP/s of absorbed-MLA math at 96 heads: far past 3xTF32, fine for one bf16 MMA, but then the
// limits are shared-memory bandwidth (ldmatrix), registers for o~ and keeping ~20-40 KB of HBM
// reads in flight per SM.
// - 48 heads (3 m-tiles) per block, the two head groups of one (item, split) adjacent in the grid
//   so the second block's row reads hit L2. 96 heads in one block would need all of o~ (96 x 512
//   f32 = 192 KB) in registers, leaving nothing for the loads in flight.
// - 256 threads, one block per SM (~230 registers): warp w owns o~ columns [64w, 64w + 64) of
//   all 48 heads (96 f32 per lane).
// - Tiles of 32 positions. The next tile's f32 rows are loaded into registers (18 float4 per
//   thread, 74 KB per SM in flight) at the start of a tile and converted to bf16 at its end:
//   the HBM latency hides behind a whole tile of math with no f32 staging in shared memory.
// - Scores: warp (kq, np) = (w >> 1, w & 1) computes heads 0..47 x positions [16np, 16np + 16)
//   over the feature quarter kq (9 k-steps): per k-step 3 A + 1 B ldmatrix.x4 for 6 MMAs. The four
//   partial sums meet in shared memory; warp w then runs the online softmax of heads 6w..6w+5
//   with lane = position.
// - Shared rows are 584 bf16 (1168 B = 73 x 16 B): the 8 row addresses of an ldmatrix fall in
//   distinct banks.
// Latency, not HBM or the tensor cores, limits this shape; what a simpler version of it (deleted,
// slower) lost time to:
// - its softmax ran a warp's 6 heads one after another, each a chain of 4 LDS, two 5-step shuffle
//   reductions and two MUFU: ~6 x 400 clocks per tile with 8 warps doing nothing else. Here the 6
//   heads go through each step together (6 independent chains), and the row sum l is kept per lane
//   (lane = position, rescaled by the head's uniform corr) and reduced once at the end, so only
//   the max needs a shuffle reduction per tile;
// - its k-loops had a branch per k-step (k0 < row, c0 < kv_lora), so ptxas issued each k-step's
//   ldmatrix only after the previous k-step's MMAs. Q and K are zero past the row in shared memory
//   (and V columns past kv_lora are computed but never stored), so the loops are branch-free and
//   ldmatrix of k-step k + 1 overlaps the MMAs of k-step k;
// - the bf16 K tile is double-buffered (~162 KB shared): one barrier per tile fewer, the next
//   tile's rows go into the other buffer right after P V, with no wait for the other warps' P V.
// No L2 prefetch of the tiles ahead (prefetch.global.L2): it is slower than none.
#include "tensor_core.cuh"

#define MLC_HEADS 48   // heads per block: 3 m-tiles of 16
#define MLC_MT 3
#define MLC_POS 32     // positions per tile (= lanes: the softmax maps lane to position)
#define MLC_ROW 576    // largest latent row (kv_lora + rope); Q / K are zero-padded to it
#define MLC_STR 584    // bf16 per Q / K row in shared memory (ldmatrix conflict-free)
#define MLC_SSTR 40    // f32 per score-partial row
#define MLC_PSTR 40    // bf16 per P row
#define MLC_THREADS 256
#define MLC_WARPS 8
#define MLC_KQ 4       // feature quarters of the score MMAs
#define MLC_KSTEPS 9   // k-steps of 16 per quarter
#define MLC_CHUNKS 18  // float4 of a row per thread per tile
#define MLC_HPW 6      // softmax heads per warp

// Dynamic shared memory layout (bytes); geometry.rs MLA_BF16_SHARED must match.
#define MLC_KBUF (MLC_POS * MLC_STR * 2)                           // one bf16 K tile: 37376 B
#define MLC_OFF_K (MLC_HEADS * MLC_STR * 2)                        // Q  [48][584] bf16
#define MLC_OFF_S (MLC_OFF_K + 2 * MLC_KBUF)                       // K  [2][32][584] bf16
#define MLC_OFF_P (MLC_OFF_S + MLC_KQ * MLC_HEADS * MLC_SSTR * 4)  // S  [4][48][40] f32
#define MLC_OFF_C (MLC_OFF_P + MLC_HEADS * MLC_PSTR * 2)           // P  [48][40] bf16
#define MLC_SHARED (MLC_OFF_C + MLC_HEADS * 4)                     // corr [48] f32: 165568 B

static_assert(MLC_POS == 32, "the softmax maps lane to position");
static_assert(MLC_WARPS * MLC_HPW == MLC_HEADS, "softmax heads per warp");
static_assert(MLC_KQ * MLC_KSTEPS * 16 == MLC_ROW, "score k-steps cover the padded row");
static_assert(MLC_WARPS == 2 * MLC_KQ, "warp = (feature quarter, position half)");
static_assert(4 * 8 * MLC_CHUNKS == MLC_ROW, "staging covers the padded row");
static_assert(MLC_SHARED == 165568, "keep geometry.rs MLA_BF16_SHARED in step");

// volatile: the addresses repeat every tile while the contents change (barriers in between).
__device__ __forceinline__ void mlc_ldsm4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mlc_ldsm4_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// Grid (ceil(H / 48), items, splits), 256 threads, MLC_SHARED bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(MLC_THREADS, 1)
mla_attend_bf16_f32(const float* __restrict__ qt, const float* __restrict__ arena, const i64* __restrict__ page_start,
                    const int* __restrict__ pt_base, const int* __restrict__ lens, float* __restrict__ part, int items,
                    int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk, float scale) {
    extern __shared__ __align__(16) unsigned char mlc_smem[];
    u16* qs = reinterpret_cast<u16*>(mlc_smem);
    u16* ks = reinterpret_cast<u16*>(mlc_smem + MLC_OFF_K);
    float* sp = reinterpret_cast<float*>(mlc_smem + MLC_OFF_S);
    u16* ps = reinterpret_cast<u16*>(mlc_smem + MLC_OFF_P);
    float* cs = reinterpret_cast<float*>(mlc_smem + MLC_OFF_C);
    const int h0 = blockIdx.x * MLC_HEADS, n = blockIdx.y, spl = blockIdx.z;
    const int row = kv_lora + rope;
    if (n >= items || row > MLC_ROW || kv_lora > 512 || page_tokens <= 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int len = lens[n], base = pt_base[n];
    const int ch = chunk > 0 ? chunk : (len + splits - 1) / splits;  // chunk <= 0: per item
    const int j0 = spl * ch, j1 = min(len, j0 + ch);

    // Q: bf16(q~ * scale), zeros past the row (the branch-free k-loops rely on it) and past the
    // last head.
    for (int i = tid; i < MLC_HEADS * (MLC_ROW / 2); i += MLC_THREADS) {
        const int hl = i / (MLC_ROW / 2), c = 2 * (i % (MLC_ROW / 2)), h = h0 + hl;
        const float* src = qt + ((i64)n * heads + min(h, heads - 1)) * row;
        const float a = (h < heads && c < row) ? src[c] * scale : 0.0f;
        const float b = (h < heads && c + 1 < row) ? src[c + 1] * scale : 0.0f;
        *reinterpret_cast<u32*>(qs + hl * MLC_STR + c) = tc_pack_bf16(a, b);
    }

    // Staging: thread -> tile position pm, float4 chunks c8 + 8k (zeros past the row).
    const int pm = (warp & 3) + 4 * (lane >> 3) + 16 * (warp >> 2), c8 = lane & 7;
    float4 st[MLC_CHUNKS];
    auto row_src = [&](int j) {
        return arena + page_start[base + j / page_tokens] + (i64)(j % page_tokens) * row;
    };
    auto load_tile = [&](int p0) {
        const int j = p0 + pm;
        const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (j < j1) {
            const float* src = row_src(j);
            if (((reinterpret_cast<size_t>(src) | ((size_t)row * 4)) & 15) == 0) {
#pragma unroll
                for (int k = 0; k < MLC_CHUNKS; ++k) {
                    const int c = 4 * (c8 + 8 * k);
                    st[k] = c < row ? ld_stream_f4(src + c) : z;
                }
            } else {  // rows only 4-byte aligned (or a row width not a multiple of 4)
#pragma unroll
                for (int k = 0; k < MLC_CHUNKS; ++k) {
                    const int c = 4 * (c8 + 8 * k);
                    st[k].x = c < row ? ld_stream_f1(src + c) : 0.0f;
                    st[k].y = c + 1 < row ? ld_stream_f1(src + c + 1) : 0.0f;
                    st[k].z = c + 2 < row ? ld_stream_f1(src + c + 2) : 0.0f;
                    st[k].w = c + 3 < row ? ld_stream_f1(src + c + 3) : 0.0f;
                }
            }
        } else {  // past the split: zero rows (K scores masked, V must not be garbage: 0 * NaN)
#pragma unroll
            for (int k = 0; k < MLC_CHUNKS; ++k) st[k] = z;
        }
    };
    auto store_tile = [&](int buf) {
        u16* dst = ks + buf * (MLC_KBUF / 2) + pm * MLC_STR;
#pragma unroll
        for (int k = 0; k < MLC_CHUNKS; ++k) {
            const uint2 v = make_uint2(tc_pack_bf16(st[k].x, st[k].y), tc_pack_bf16(st[k].z, st[k].w));
            *reinterpret_cast<uint2*>(dst + 4 * (c8 + 8 * k)) = v;
        }
    };
    const int tiles = j1 > j0 ? (j1 - j0 + MLC_POS - 1) / MLC_POS : 0;
    if (tiles > 0) {
        load_tile(j0);
        store_tile(0);
    }
    __syncthreads();

    // Per-lane ldmatrix offsets (bytes).
    const u32 qs_a = (u32)__cvta_generic_to_shared(qs), ks_a = (u32)__cvta_generic_to_shared(ks);
    const u32 ps_a = (u32)__cvta_generic_to_shared(ps);
    const u32 a_q = qs_a + 2u * ((lane & 15) * MLC_STR + 8 * (lane >> 4));
    const u32 a_p = ps_a + 2u * ((lane & 15) * MLC_PSTR + 8 * (lane >> 4));
    const u32 b_k = ks_a + 2u * (((lane & 7) + 8 * (lane >> 4)) * MLC_STR + 8 * ((lane >> 3) & 1));
    const u32 b_v = ks_a + 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * MLC_STR + 8 * (lane >> 4));
    const int kq = warp >> 1, np = warp & 1;

    float acc[MLC_MT][8][4];
#pragma unroll
    for (int m = 0; m < MLC_MT; ++m)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.0f;
    // m_run: the head's running max (uniform over the warp); l_lane: this lane's (position's) share
    // of the running row sum, in the same scale as m_run (summed over lanes at the end).
    float m_run[MLC_HPW], l_lane[MLC_HPW];
#pragma unroll
    for (int i = 0; i < MLC_HPW; ++i) {
        m_run[i] = K3_NEG_INF;
        l_lane[i] = 0.0f;
    }

    for (int it = 0; it < tiles; ++it) {
        const int p0 = j0 + it * MLC_POS;
        const bool more = it + 1 < tiles;
        const u32 kb = (u32)((it & 1) * MLC_KBUF);  // this tile's K buffer (bytes)
        if (more) load_tile(p0 + MLC_POS);          // stored into the other buffer after P V

        // Score partials of feature quarter kq, positions [16np, 16np + 16), all 48 heads. Branch-free:
        // Q and K are zero past the row.
        {
            float s[MLC_MT][2][4];
#pragma unroll
            for (int m = 0; m < MLC_MT; ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) s[m][i][0] = s[m][i][1] = s[m][i][2] = s[m][i][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < MLC_KSTEPS; ++kk) {
                const int k0 = (kq * MLC_KSTEPS + kk) * 16;
                u32 b[4];
                mlc_ldsm4(b, b_k + kb + 2u * (16 * np * MLC_STR + k0));
#pragma unroll
                for (int m = 0; m < MLC_MT; ++m) {
                    u32 a[4];
                    mlc_ldsm4(a, a_q + 2u * (16 * m * MLC_STR + k0));
                    tc_mma_bf16(s[m][0], a, b[0], b[1]);
                    tc_mma_bf16(s[m][1], a, b[2], b[3]);
                }
            }
            float* dst = sp + kq * MLC_HEADS * MLC_SSTR;
#pragma unroll
            for (int m = 0; m < MLC_MT; ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int c = 16 * np + 8 * i + 2 * t;
                    *reinterpret_cast<float2*>(dst + (16 * m + g) * MLC_SSTR + c) = make_float2(s[m][i][0], s[m][i][1]);
                    *reinterpret_cast<float2*>(dst + (16 * m + g + 8) * MLC_SSTR + c) =
                        make_float2(s[m][i][2], s[m][i][3]);
                }
        }
        __syncthreads();

        // Online softmax: warp w, heads 6w..6w+5 in lockstep, lane = position p0 + lane.
        {
            const bool valid = p0 + lane < j1;
            float s[MLC_HPW], mx[MLC_HPW];
#pragma unroll
            for (int i = 0; i < MLC_HPW; ++i) {
                const int hl = MLC_HPW * warp + i;
                float v = 0.0f;
#pragma unroll
                for (int q = 0; q < MLC_KQ; ++q) v += sp[(q * MLC_HEADS + hl) * MLC_SSTR + lane];
                s[i] = valid ? v : K3_NEG_INF;
                mx[i] = s[i];
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
#pragma unroll
                for (int i = 0; i < MLC_HPW; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], off));
#pragma unroll
            for (int i = 0; i < MLC_HPW; ++i) {
                const int hl = MLC_HPW * warp + i;
                const float mn = fmaxf(m_run[i], mx[i]);  // finite: every tile has a valid position
                const float corr = m_run[i] == K3_NEG_INF ? 0.0f : __expf(m_run[i] - mn);
                const u16 pb = f32_to_bf16_bits(valid ? __expf(s[i] - mn) : 0.0f);
                ps[hl * MLC_PSTR + lane] = pb;
                l_lane[i] = l_lane[i] * corr + bf16_bits_to_f32(pb);
                m_run[i] = mn;
                if (lane == 0) cs[hl] = corr;
            }
        }
        __syncthreads();

        // o~ = corr o~ + P V for columns [64w, 64w + 64) (columns past kv_lora are rope values:
        // computed, never stored).
        {
#pragma unroll
            for (int m = 0; m < MLC_MT; ++m) {
                const float ca = cs[16 * m + g], cb = cs[16 * m + g + 8];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[m][i][0] *= ca;
                    acc[m][i][1] *= ca;
                    acc[m][i][2] *= cb;
                    acc[m][i][3] *= cb;
                }
            }
#pragma unroll
            for (int kk = 0; kk < MLC_POS / 16; ++kk) {
                u32 a[MLC_MT][4];
#pragma unroll
                for (int m = 0; m < MLC_MT; ++m) mlc_ldsm4(a[m], a_p + 2u * (16 * m * MLC_PSTR + 16 * kk));
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 b[4];
                    mlc_ldsm4_t(b, b_v + kb + 2u * (16 * kk * MLC_STR + 64 * warp + 16 * j));
#pragma unroll
                    for (int m = 0; m < MLC_MT; ++m) {
                        tc_mma_bf16(acc[m][2 * j], a[m], b[0], b[1]);
                        tc_mma_bf16(acc[m][2 * j + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }
        // The other K buffer was last read in tile it - 1, which every warp finished before this
        // tile's first barrier; P / corr / S are next written after this barrier.
        if (more) store_tile((it + 1) & 1);
        __syncthreads();
    }

    float* out = part + ((i64)n * heads * splits + spl) * (kv_lora + 2);
    const i64 hstride = (i64)splits * (kv_lora + 2);
#pragma unroll
    for (int m = 0; m < MLC_MT; ++m)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int c = 64 * warp + 8 * i + 2 * t;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int hh = h0 + 16 * m + g + 8 * (r >> 1), cc = c + (r & 1);
                if (hh < heads && cc < kv_lora) out[hh * hstride + cc] = acc[m][i][r];
            }
        }
#pragma unroll
    for (int i = 0; i < MLC_HPW; ++i) {
        const float l = warp_sum(l_lane[i]);
        const int hh = h0 + MLC_HPW * warp + i;
        if (lane == 0 && hh < heads) {
            out[hh * hstride + kv_lora] = m_run[i];
            out[hh * hstride + kv_lora + 1] = l;
        }
    }
}
