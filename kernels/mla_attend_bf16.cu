// Absorbed MLA decode attend in bf16 precision (ops.rs MlaDecodeMode::Bf16): the same contract as
// mla_attend_tc2_f32 (kernels/mla.cu) — qt [items, H, row] from mla_absorb_q_f32, the paged f32
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
// - 256 threads, one block per SM (~128 KB shared, ~230 registers): warp w owns o~ columns
//   [64w, 64w + 64) of all 48 heads (96 f32 per lane).
// - Tiles of 32 positions. The next tile's f32 rows are loaded into registers (18 float4 per
//   thread, 74 KB per SM in flight) at the start of a tile and converted to bf16 at its end:
//   the HBM latency hides behind a whole tile of math with no f32 staging in shared memory.
// - Scores: warp (kq, np) = (w >> 1, w & 1) computes heads 0..47 x positions [16np, 16np + 16)
//   over the feature quarter kq (9 k-steps): per k-step 3 A + 1 B ldmatrix.x4 for 6 MMAs. The four
//   partial sums meet in shared memory; warp w then runs the online softmax of heads 6w..6w+5
//   with lane = position.
// - Shared rows are 584 bf16 (1168 B = 73 x 16 B): the 8 row addresses of an ldmatrix fall in
//   distinct banks.
#include "common.cuh"

#define MLB_HEADS 48   // heads per block: 3 m-tiles of 16
#define MLB_MT 3
#define MLB_POS 32     // positions per tile (= lanes: the softmax maps lane to position)
#define MLB_ROW 576    // largest latent row (kv_lora + rope)
#define MLB_STR 584    // bf16 per Q / K row in shared memory
#define MLB_SSTR 40    // f32 per score-partial row: conflict-free float2 stores of the C tiles
#define MLB_PSTR 40    // bf16 per P row (80 B): conflict-free ldmatrix
#define MLB_THREADS 256
#define MLB_WARPS 8
#define MLB_KQ 4       // feature quarters of the score MMAs
#define MLB_KSTEPS 9   // k-steps of 16 per quarter: 4 x 9 x 16 = 576
#define MLB_CHUNKS 18  // float4 of a row per thread per tile: 144 float4 over 8 lanes
#define MLB_HPW 6      // softmax heads per warp

// Dynamic shared memory layout (bytes); ops.rs / geometry.rs MLA_BF16_SHARED must match.
#define MLB_OFF_K (MLB_HEADS * MLB_STR * 2)                        // Q  [48][584] bf16
#define MLB_OFF_S (MLB_OFF_K + MLB_POS * MLB_STR * 2)              // K  [32][584] bf16
#define MLB_OFF_P (MLB_OFF_S + MLB_KQ * MLB_HEADS * MLB_SSTR * 4)  // S  [4][48][40] f32
#define MLB_OFF_C (MLB_OFF_P + MLB_HEADS * MLB_PSTR * 2)           // P  [48][40] bf16
#define MLB_SHARED (MLB_OFF_C + MLB_HEADS * 4)                     // corr [48] f32: 128192 B

static_assert(MLB_POS == 32, "the softmax maps lane to position");
static_assert(MLB_WARPS * MLB_HPW == MLB_HEADS, "softmax heads per warp");
static_assert(MLB_KQ * MLB_KSTEPS * 16 == MLB_ROW, "score k-steps cover the row");
static_assert(MLB_WARPS == 2 * MLB_KQ, "warp = (feature quarter, position half)");
static_assert(MLB_SHARED == 128192, "keep geometry.rs MLA_BF16_SHARED in step");

// Two f32 -> packed bf16x2, round to nearest even (lo in the low half: the lower address).
__device__ __forceinline__ u32 mlb_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// volatile: the addresses repeat every tile while the contents change (barriers in between), so
// the compiler must not merge or hoist them.
__device__ __forceinline__ void mlb_ldsm4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mlb_ldsm4_t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mlb_mma(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Streaming loads of cache rows (read once per block: no L1 allocation). volatile keeps them at
// the top of the tile, ahead of the math they hide behind.
__device__ __forceinline__ float4 mlb_ldg4(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ float mlb_ldg1(const float* p) {
    float v;
    asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// Grid (ceil(H / 48), items, splits), 256 threads, MLB_SHARED bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(MLB_THREADS, 1)
mla_attend_bf16_f32(const float* __restrict__ qt, const float* __restrict__ arena, const i64* __restrict__ page_start,
                    const int* __restrict__ pt_base, const int* __restrict__ lens, float* __restrict__ part, int items,
                    int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk, float scale) {
    extern __shared__ __align__(16) unsigned char mlb_smem[];
    u16* qs = reinterpret_cast<u16*>(mlb_smem);
    u16* ks = reinterpret_cast<u16*>(mlb_smem + MLB_OFF_K);
    float* sp = reinterpret_cast<float*>(mlb_smem + MLB_OFF_S);
    u16* ps = reinterpret_cast<u16*>(mlb_smem + MLB_OFF_P);
    float* cs = reinterpret_cast<float*>(mlb_smem + MLB_OFF_C);
    const int h0 = blockIdx.x * MLB_HEADS, n = blockIdx.y, spl = blockIdx.z;
    const int row = kv_lora + rope;
    if (n >= items || row > MLB_ROW || kv_lora > 512 || page_tokens <= 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int len = lens[n], base = pt_base[n];
    // chunk <= 0: each item splits its own length evenly (as mla_attend_tc2_f32).
    const int ch = chunk > 0 ? chunk : (len + splits - 1) / splits;
    const int j0 = spl * ch, j1 = min(len, j0 + ch);

    // Q: bf16(q~ * scale), zeros past the row and past the last head (those rows score 0 and are
    // never written out).
    for (int i = tid; i < MLB_HEADS * (MLB_ROW / 2); i += MLB_THREADS) {
        const int hl = i / (MLB_ROW / 2), c = 2 * (i % (MLB_ROW / 2)), h = h0 + hl;
        const float* src = qt + ((i64)n * heads + min(h, heads - 1)) * row;
        const float a = (h < heads && c < row) ? src[c] * scale : 0.0f;
        const float b = (h < heads && c + 1 < row) ? src[c + 1] * scale : 0.0f;
        *reinterpret_cast<u32*>(qs + hl * MLB_STR + c) = mlb_pack(a, b);
    }

    // Staging: thread -> tile position pm, float4 chunks c8 + 8k of its row. A half-warp covers
    // rows 4 apart (offset 16 banks), so the 8-byte bf16 stores are conflict-free; a warp reads 4
    // rows x 128 contiguous bytes per load.
    const int pm = (warp & 3) + 4 * (lane >> 3) + 16 * (warp >> 2), c8 = lane & 7;
    float4 st[MLB_CHUNKS];
    auto load_tile = [&](int p0) {
        const int j = p0 + pm;
        const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (j < j1) {
            const i64 off = page_start[base + j / page_tokens] + (i64)(j % page_tokens) * row;
            const float* src = arena + off;
            if (((off | (i64)row) & 3) == 0) {
#pragma unroll
                for (int k = 0; k < MLB_CHUNKS; ++k) {
                    const int c = 4 * (c8 + 8 * k);
                    st[k] = c < row ? mlb_ldg4(src + c) : z;
                }
            } else {  // rows only 4-byte aligned (or a row width not a multiple of 4)
#pragma unroll
                for (int k = 0; k < MLB_CHUNKS; ++k) {
                    const int c = 4 * (c8 + 8 * k);
                    st[k].x = c < row ? mlb_ldg1(src + c) : 0.0f;
                    st[k].y = c + 1 < row ? mlb_ldg1(src + c + 1) : 0.0f;
                    st[k].z = c + 2 < row ? mlb_ldg1(src + c + 2) : 0.0f;
                    st[k].w = c + 3 < row ? mlb_ldg1(src + c + 3) : 0.0f;
                }
            }
        } else {  // past the split: zero rows (K scores masked, V must not be garbage: 0 * NaN)
#pragma unroll
            for (int k = 0; k < MLB_CHUNKS; ++k) st[k] = z;
        }
    };
    auto store_tile = [&]() {
        u16* dst = ks + pm * MLB_STR;
#pragma unroll
        for (int k = 0; k < MLB_CHUNKS; ++k) {
            const uint2 v = make_uint2(mlb_pack(st[k].x, st[k].y), mlb_pack(st[k].z, st[k].w));
            *reinterpret_cast<uint2*>(dst + 4 * (c8 + 8 * k)) = v;
        }
    };

    const int tiles = j1 > j0 ? (j1 - j0 + MLB_POS - 1) / MLB_POS : 0;
    if (tiles > 0) {
        load_tile(j0);
        store_tile();
    }
    __syncthreads();

    // Per-lane ldmatrix offsets (bytes). A (Q or P, x4 = m16 x k16): row lane & 15, column
    // 8 (lane >> 4). B of the scores (K rows, x4 = 2 n-tiles x k16): row (lane & 7) + 8 (lane >> 4),
    // column 8 ((lane >> 3) & 1). B of P V (V rows, x4.trans = k16 x 2 n-tiles): row (lane & 7) +
    // 8 ((lane >> 3) & 1), column 8 (lane >> 4).
    const u32 qs_a = (u32)__cvta_generic_to_shared(qs), ks_a = (u32)__cvta_generic_to_shared(ks);
    const u32 ps_a = (u32)__cvta_generic_to_shared(ps);
    const u32 a_q = qs_a + 2u * ((lane & 15) * MLB_STR + 8 * (lane >> 4));
    const u32 a_p = ps_a + 2u * ((lane & 15) * MLB_PSTR + 8 * (lane >> 4));
    const u32 b_k = ks_a + 2u * (((lane & 7) + 8 * (lane >> 4)) * MLB_STR + 8 * ((lane >> 3) & 1));
    const u32 b_v = ks_a + 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * MLB_STR + 8 * (lane >> 4));
    const int kq = warp >> 1, np = warp & 1;

    float acc[MLB_MT][8][4];
#pragma unroll
    for (int m = 0; m < MLB_MT; ++m)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.0f;
    float m_run[MLB_HPW], l_run[MLB_HPW];
#pragma unroll
    for (int i = 0; i < MLB_HPW; ++i) {
        m_run[i] = K3_NEG_INF;
        l_run[i] = 0.0f;
    }

    for (int it = 0; it < tiles; ++it) {
        const int p0 = j0 + it * MLB_POS;
        const bool more = it + 1 < tiles;
        if (more) load_tile(p0 + MLB_POS);  // consumed at the end of this tile

        // Score partials of feature quarter kq, positions [16np, 16np + 16), all 48 heads.
        {
            float s[MLB_MT][2][4];
#pragma unroll
            for (int m = 0; m < MLB_MT; ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) s[m][i][0] = s[m][i][1] = s[m][i][2] = s[m][i][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < MLB_KSTEPS; ++kk) {
                const int k0 = (kq * MLB_KSTEPS + kk) * 16;
                if (k0 < row) {
                    u32 b[4];
                    mlb_ldsm4(b, b_k + 2u * (16 * np * MLB_STR + k0));
#pragma unroll
                    for (int m = 0; m < MLB_MT; ++m) {
                        u32 a[4];
                        mlb_ldsm4(a, a_q + 2u * (16 * m * MLB_STR + k0));
                        mlb_mma(s[m][0], a, b[0], b[1]);
                        mlb_mma(s[m][1], a, b[2], b[3]);
                    }
                }
            }
            float* dst = sp + kq * MLB_HEADS * MLB_SSTR;
#pragma unroll
            for (int m = 0; m < MLB_MT; ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int c = 16 * np + 8 * i + 2 * t;
                    *reinterpret_cast<float2*>(dst + (16 * m + g) * MLB_SSTR + c) = make_float2(s[m][i][0], s[m][i][1]);
                    *reinterpret_cast<float2*>(dst + (16 * m + g + 8) * MLB_SSTR + c) =
                        make_float2(s[m][i][2], s[m][i][3]);
                }
        }
        __syncthreads();

        // Online softmax: warp w, heads 6w..6w+5, lane = position p0 + lane.
        {
            const bool valid = p0 + lane < j1;
#pragma unroll
            for (int i = 0; i < MLB_HPW; ++i) {
                const int hl = MLB_HPW * warp + i;
                float s = 0.0f;
#pragma unroll
                for (int q = 0; q < MLB_KQ; ++q) s += sp[(q * MLB_HEADS + hl) * MLB_SSTR + lane];
                s = valid ? s : K3_NEG_INF;
                const float mn = fmaxf(m_run[i], warp_max(s));
                const float corr = m_run[i] == K3_NEG_INF ? 0.0f : __expf(m_run[i] - mn);
                const u16 pb = f32_to_bf16_bits(valid ? __expf(s - mn) : 0.0f);
                ps[hl * MLB_PSTR + lane] = pb;
                l_run[i] = l_run[i] * corr + warp_sum(bf16_bits_to_f32(pb));
                m_run[i] = mn;
                if (lane == 0) cs[hl] = corr;
            }
        }
        __syncthreads();

        // o~ = corr o~ + P V for columns [64w, 64w + 64): 2 k-steps of 16 positions.
        {
#pragma unroll
            for (int m = 0; m < MLB_MT; ++m) {
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
            for (int kk = 0; kk < MLB_POS / 16; ++kk) {
                u32 a[MLB_MT][4];
#pragma unroll
                for (int m = 0; m < MLB_MT; ++m) mlb_ldsm4(a[m], a_p + 2u * (16 * m * MLB_PSTR + 16 * kk));
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c0 = 64 * warp + 16 * j;
                    if (c0 < kv_lora) {
                        u32 b[4];
                        mlb_ldsm4_t(b, b_v + 2u * (16 * kk * MLB_STR + c0));
#pragma unroll
                        for (int m = 0; m < MLB_MT; ++m) {
                            mlb_mma(acc[m][2 * j], a[m], b[0], b[1]);
                            mlb_mma(acc[m][2 * j + 1], a[m], b[2], b[3]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // K / P / corr are free
        if (more) store_tile();
        __syncthreads();
    }

    float* out = part + ((i64)n * heads * splits + spl) * (kv_lora + 2);
    const i64 hstride = (i64)splits * (kv_lora + 2);
#pragma unroll
    for (int m = 0; m < MLB_MT; ++m)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int c = 64 * warp + 8 * i + 2 * t;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int hh = h0 + 16 * m + g + 8 * (r >> 1), cc = c + (r & 1);
                if (hh < heads && cc < kv_lora) out[hh * hstride + cc] = acc[m][i][r];
            }
        }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < MLB_HPW; ++i) {
            const int hh = h0 + MLB_HPW * warp + i;
            if (hh < heads) {
                out[hh * hstride + kv_lora] = m_run[i];
                out[hh * hstride + kv_lora + 1] = l_run[i];
            }
        }
    }
}
