// Absorbed MLA decode over the paged latent cache (docs/k3-model.md §4, absorbed decode):
//   mla_append_rows_f32   new rows [RMSNorm(c_kv) ; k_r] into their pages
//   mla_absorb_q_f32      q~_h = [W_UK,h^T q_nope,h ; q_r,h]  (row = kv_lora + rope, 576 in K3)
//   mla_attend_tf32_f32    MQA over rows 0..len-1 with online softmax on tensor cores (TF32
//                         mma.sync), 16 heads per KV tile, split over positions
//   mla_merge_f32         merge the splits (log-sum-exp) into the normalised latent o~_h
//   mla_out_proj_f32      o_h = W_UV,h o~_h, each head's W_UV read once for up to 64 items
//   mla_absorb_q_bf16,    the two kv_b products above on the stored bf16 kv_b, tensor cores, each
//   mla_out_proj_bf16     weight byte read once for all items (what decode runs for a bf16 kv_b;
//                         the f32 pair stays for f32 checkpoints and odd shapes)
// Queries are independent items with their own page table and length, so a prefill chunk can
// run as T queries with causal lengths start+1 .. start+T (exact; the expanded form is faster).
//
// Page addressing: row j of query item n is at float offset page_start[pt_base[n] + j / page_tokens]
// + (j % page_tokens) * row, where page_start already includes the layer's offset in the page.
#include "tensor_core.cuh"

#define MLA_MAX_ROW 576

__device__ __forceinline__ i64 mla_row_off(const i64* page_start, int base, int j, int page_tokens, int row) {
    return page_start[base + j / page_tokens] + (i64)(j % page_tokens) * row;
}

// One block per new token: dst[tok] = float offset of its row.
extern "C" __global__ void mla_append_rows_f32(const float* __restrict__ kv_a, const float* __restrict__ norm_w,
                                               float* __restrict__ arena, const i64* __restrict__ dst, int tokens,
                                               int kv_lora, int rope, float eps) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const int row = kv_lora + rope;
    const float* x = kv_a + (i64)t * row;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) ss += x[c] * x[c];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)kv_lora + eps);
    float* o = arena + dst[t];
    for (int c = threadIdx.x; c < row; c += blockDim.x) o[c] = c < kv_lora ? x[c] * inv * norm_w[c] : x[c];
}

// Grid (items, heads), blockDim 128. q [items, H*(nope+rope)], kv_b [H*(nope+v_dim), kv_lora].
// Output qt [items, H, row]. A GEMV per (item, head): fine for decode batches; prefill should
// use the expanded form instead.
extern "C" __global__ void mla_absorb_q_f32(const float* __restrict__ q, const float* __restrict__ kv_b,
                                            float* __restrict__ qt, int items, int heads, int nope, int rope,
                                            int v_dim, int kv_lora) {
    __shared__ float qn[256];
    const int n = blockIdx.x, h = blockIdx.y;
    if (n >= items || h >= heads || nope > 256) return;
    const int qk = nope + rope, row = kv_lora + rope;
    const float* qh = q + ((i64)n * heads + h) * qk;
    for (int p = threadIdx.x; p < nope; p += blockDim.x) qn[p] = qh[p];
    __syncthreads();
    const float* wuk = kv_b + (i64)h * (nope + v_dim) * kv_lora;
    float* out = qt + ((i64)n * heads + h) * row;
    for (int l = threadIdx.x; l < kv_lora; l += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < nope; ++p) acc += qn[p] * wuk[(i64)p * kv_lora + l];
        out[l] = acc;
    }
    for (int r = threadIdx.x; r < rope; r += blockDim.x) out[kv_lora + r] = qh[nope + r];
}

// ---------------------------------------------------------------------------------------------
// Tensor-core attend (mma.sync m16n8k8 TF32): each loaded KV tile feeds 16 heads at once, and the
// products run on tensor cores: the absorbed form does ~90 flop per KV byte at 96 heads, far past
// what f32 CUDA cores can keep up with at HBM speed (a CUDA-core version, 4 heads per tile, ran at
// 3-4 % of HBM on the H200 and was removed). Precise mode splits every operand into a TF32 hi + lo
// pair and sums hi*hi + hi*lo + lo*hi (3 MMAs, ~f32 accuracy); fast mode is one TF32 MMA (~1e-3).
//
// Grid (ceil(H / 16), items, splits): the head groups of one (item, split) are adjacent so their
// repeated KV reads hit L2. 256 threads = 8 warps. Per tile of 8 positions (double-buffered with
// cp.async): warp w computes partial scores over its eighth of the row (9 k-steps of 8; Q
// fragments live in registers), the partials meet in shared memory for the online softmax, then
// warp w accumulates P V for latent columns [64w, 64w + 64) (8 n-tiles, 32 f32 per lane).
#define MLA_TC_HEADS 16
#define MLA_TC_POS 8
#define MLA_TC_WARPS 8
#define MLA_TC_THREADS (MLA_TC_WARPS * 32)
#define MLA_TC_KSTEPS (MLA_MAX_ROW / 8 / MLA_TC_WARPS)  // 9 k-steps of the row per warp
#define MLA_TC_NT (512 / 8 / MLA_TC_WARPS)             // 8 n-tiles of o~ per warp
#define MLA_TC_STRIDE (MLA_MAX_ROW + 4)      // 580 floats: 4g + t banks, conflict-free B loads
#define MLA_TC_PSTRIDE 12                    // P rows: 12g + t banks, conflict-free A loads

__device__ __forceinline__ u32 tf32_of(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a * b for raw f32 fragments: 1 TF32 MMA, or 3 (hi*hi + hi*lo + lo*hi) when precise.
__device__ __forceinline__ void mma_f32x(float* d, const float* a, float b0, float b1, bool precise) {
    u32 ah[4], bh0 = tf32_of(b0), bh1 = tf32_of(b1);
#pragma unroll
    for (int i = 0; i < 4; ++i) ah[i] = tf32_of(a[i]);
    if (precise) {
        u32 al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) al[i] = tf32_of(a[i] - __uint_as_float(ah[i]));
        mma_tf32(d, al, bh0, bh1);
        mma_tf32(d, ah, tf32_of(b0 - __uint_as_float(bh0)), tf32_of(b1 - __uint_as_float(bh1)));
    }
    mma_tf32(d, ah, bh0, bh1);
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src));
}

// ---------------------------------------------------------------------------------------------
// Why this shape. A simpler tensor-core attend (deleted, slower at every shape) reached ~5% of HBM,
// ~4x below what its MMA count and bytes allow: one 184-register block per SM runs three barrier-separated phases
// per tile (split-K scores, softmax on half the warps, P V) with nothing to overlap their latency,
// and every thread redoes two integer divisions and a page-table load per 16-byte chunk.
// mla_attend_tf32_f32 is the same math and partial layout with (a) __launch_bounds__(256, 2): two
// blocks per SM, so one block's barriers/softmax overlap the other's MMAs and copies; (b) warp w
// copies row w of the tile (8 rows = 8 warps): one page lookup per row; (c) L2 prefetch of the
// rows pf tiles ahead. The six head-group blocks of one (item, split) read the same rows, so
// only ~1/6 of the bytes in flight are HBM misses: ~1 MB over the GPU, a ~1 TB/s cap at
// HBM latency. mode = precision | pf << 2, precision 1 = 3xTF32, 0 = 1xTF32, 3 = 3xTF32 scores and
// 1xTF32 P V (scores need the precision: an error d in s scales the weight by e^d), 2 = copies
// only, no math (a benchmark probe of the load pipeline; its output is garbage).
// The W_UV step moves to mla_out_proj_f32, which reads each head's W_UV once for up to 64 items
// (a combine inside the attend would re-read all 25 MB of W_UV per item: 1.6 GB of L2 traffic at N = 64).
static_assert(MLA_TC_POS == MLA_TC_WARPS, "mla_attend_tf32_f32: warp w copies tile row w");
extern "C" __global__ void __launch_bounds__(MLA_TC_THREADS, 2)
mla_attend_tf32_f32(const float* __restrict__ qt, const float* __restrict__ arena, const i64* __restrict__ page_start,
                   const int* __restrict__ pt_base, const int* __restrict__ lens, float* __restrict__ part, int items,
                   int heads, int kv_lora, int rope, int page_tokens, int splits, int chunk, float scale, int mode) {
    __shared__ __align__(16) float kv[2][MLA_TC_POS][MLA_TC_STRIDE];
    __shared__ float sp[MLA_TC_WARPS][MLA_TC_HEADS][MLA_TC_POS];
    __shared__ float ps[MLA_TC_HEADS][MLA_TC_PSTRIDE];
    __shared__ float cs[MLA_TC_HEADS];
    const int h0 = blockIdx.x * MLA_TC_HEADS, n = blockIdx.y, spl = blockIdx.z;
    const int row = kv_lora + rope;
    if (n >= items || row > MLA_MAX_ROW || kv_lora > 512) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int len = lens[n], base = pt_base[n];
    // chunk <= 0: each item splits its own length evenly (the host's split count then depends
    // only on a length bucket, so decode steps replay as one CUDA graph while contexts grow).
    const int ch = chunk > 0 ? chunk : (len + splits - 1) / splits;
    const int j0 = spl * ch, j1 = min(len, j0 + ch);
    const bool prec = (mode & 3) == 1, prec_qk = prec || (mode & 3) == 3;
    const int probe = (mode & 3) == 2, pf = mode >> 2;

    for (int i = tid; i < 2 * MLA_TC_POS * (MLA_MAX_ROW - row); i += MLA_TC_THREADS) {
        const int b = i / (MLA_TC_POS * (MLA_MAX_ROW - row)), rest = i % (MLA_TC_POS * (MLA_MAX_ROW - row));
        kv[b][rest / (MLA_MAX_ROW - row)][row + rest % (MLA_MAX_ROW - row)] = 0.0f;
    }
    float qa[MLA_TC_KSTEPS][4];
#pragma unroll
    for (int i = 0; i < MLA_TC_KSTEPS; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int hh = h0 + g + 8 * (r & 1), c = (warp + MLA_TC_WARPS * i) * 8 + t + 4 * (r >> 1);
            qa[i][r] = (hh < heads && c < row) ? qt[((i64)n * heads + hh) * row + c] * scale : 0.0f;
        }
    float acc[MLA_TC_NT][4];
#pragma unroll
    for (int i = 0; i < MLA_TC_NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const int sh = tid >> 3, sj = tid & 7;
    float m_run = K3_NEG_INF, l_run = 0.0f;

    // Warp w copies position p0 + w (MLA_TC_POS == MLA_TC_WARPS); rows past j1 are zero-filled.
    auto load_tile = [&](int b, int p0) {
        const int j = p0 + warp;
        float* dst = kv[b][warp];
        if (j < j1) {
            const i64 off = mla_row_off(page_start, base, j, page_tokens, row);
            const float* src = arena + off;
            if ((off & 3) == 0 && (row & 3) == 0) {
                for (int c4 = lane; c4 < (row >> 2); c4 += 32) cp_async16(dst + 4 * c4, src + 4 * c4);
            } else {
                for (int c = lane; c < row; c += 32) cp_async4(dst + c, src + c);
            }
        } else {
            for (int c = lane; c < row; c += 32) dst[c] = 0.0f;
        }
        asm volatile("cp.async.commit_group;");
    };

    // Warp w asks L2 for row w of tile `tile` (one prefetch per 32-byte sector, no registers or
    // shared memory held): keeps pf more tiles of HBM reads in flight than the double buffer.
    auto prefetch_tile = [&](int tile) {
        const int j = j0 + tile * MLA_TC_POS + warp;
        if (j >= j1) return;
        const float* src = arena + mla_row_off(page_start, base, j, page_tokens, row);
        for (int c = lane * 8; c < row; c += 256) asm volatile("prefetch.global.L2 [%0];" ::"l"(src + c));
    };

    const int tiles = j1 > j0 ? (j1 - j0 + MLA_TC_POS - 1) / MLA_TC_POS : 0;
    if (tiles > 0) load_tile(0, j0);
    for (int d = 1; d <= pf && d < tiles; ++d) prefetch_tile(d);
    for (int it = 0; it < tiles; ++it) {
        const int b = it & 1;
        asm volatile("cp.async.wait_group 0;");
        __syncthreads();
        if (it + 1 < tiles) load_tile(b ^ 1, j0 + (it + 1) * MLA_TC_POS);
        if (pf > 0 && it + 1 + pf < tiles) prefetch_tile(it + 1 + pf);
        if (probe) continue;  // uniform: every thread skips the same barriers
        // Opaque to the compiler: it would otherwise hoist the TF32 hi/lo splits of Q out of the
        // loop (72 live registers instead of 36: spills under the 128 cap).
#pragma unroll
        for (int i = 0; i < MLA_TC_KSTEPS; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(qa[i][r]));
        // Four accumulators, and the 3xTF32 terms of one k-step go to three different ones: the
        // score MMAs form 4 independent chains (rather than 2 chains of up to 15 dependent
        // MMAs, which would be the longest latency path of the tile).
        float sa[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a) sa[a][0] = sa[a][1] = sa[a][2] = sa[a][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_TC_KSTEPS; ++i) {
            const int c0 = (warp + MLA_TC_WARPS * i) * 8;
            if (c0 < row) {
                const float b0 = kv[b][g][c0 + t], b1 = kv[b][g][c0 + t + 4];
                u32 ah[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) ah[r] = tf32_of(qa[i][r]);
                const u32 bh0 = tf32_of(b0), bh1 = tf32_of(b1);
                if (prec_qk) {
                    u32 al[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) al[r] = tf32_of(qa[i][r] - __uint_as_float(ah[r]));
                    mma_tf32(sa[(i + 1) & 3], al, bh0, bh1);
                    mma_tf32(sa[(i + 2) & 3], ah, tf32_of(b0 - __uint_as_float(bh0)),
                             tf32_of(b1 - __uint_as_float(bh1)));
                }
                mma_tf32(sa[i & 3], ah, bh0, bh1);
            }
        }
        float s4[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) s4[r] = (sa[0][r] + sa[1][r]) + (sa[2][r] + sa[3][r]);
        sp[warp][g][2 * t] = s4[0];
        sp[warp][g][2 * t + 1] = s4[1];
        sp[warp][g + 8][2 * t] = s4[2];
        sp[warp][g + 8][2 * t + 1] = s4[3];
        __syncthreads();
        if (tid < MLA_TC_HEADS * MLA_TC_POS) {
            const int j = j0 + it * MLA_TC_POS + sj;
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < MLA_TC_WARPS; ++w) s += sp[w][sh][sj];
            if (j >= j1) s = K3_NEG_INF;
            float mt = s;
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) mt = fmaxf(mt, __shfl_xor_sync(K3_FULL_MASK, mt, o));
            const float mn = fmaxf(m_run, mt);
            const float corr = m_run == K3_NEG_INF ? 0.0f : __expf(m_run - mn);
            const float p = s == K3_NEG_INF ? 0.0f : __expf(s - mn);
            float pl = p;
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) pl += __shfl_xor_sync(K3_FULL_MASK, pl, o);
            l_run = l_run * corr + pl;
            m_run = mn;
            ps[sh][sj] = p;
            if (sj == 0) cs[sh] = corr;
        }
        __syncthreads();
        const float ca = cs[g], cb = cs[g + 8];
        const float pa[4] = {ps[g][t], ps[g + 8][t], ps[g][t + 4], ps[g + 8][t + 4]};
#pragma unroll
        for (int nt = 0; nt < MLA_TC_NT; ++nt) {
            const int c0 = warp * 64 + nt * 8;
            if (c0 < kv_lora) {
                acc[nt][0] *= ca;
                acc[nt][1] *= ca;
                acc[nt][2] *= cb;
                acc[nt][3] *= cb;
                mma_f32x(acc[nt], pa, kv[b][t][c0 + g], kv[b][t + 4][c0 + g], prec);
            }
        }
    }

    float* out = part + ((i64)n * heads * splits + spl) * (kv_lora + 2);
    const i64 hstride = (i64)splits * (kv_lora + 2);
#pragma unroll
    for (int nt = 0; nt < MLA_TC_NT; ++nt) {
        const int c = warp * 64 + nt * 8 + 2 * t;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int hh = h0 + g + 8 * (r >> 1), cc = c + (r & 1);
            if (hh < heads && cc < kv_lora) out[hh * hstride + cc] = acc[nt][r];
        }
    }
    if (tid < MLA_TC_HEADS * MLA_TC_POS && sj == 0 && h0 + sh < heads) {
        out[(h0 + sh) * hstride + kv_lora] = m_run;
        out[(h0 + sh) * hstride + kv_lora + 1] = l_run;
    }
}

// Grid (items, heads, ceil(kv_lora / 128)), 128 threads, thread = one latent column: merge the
// splits of part [items, H, splits, kv_lora + 2] into the normalised latent lat [items, H,
// kv_lora]. Each block recomputes the split weights (<= 256 values), then sums its column over
// the splits with 4 independent accumulators so that several L2 loads are in flight per thread
// (one block per (item, head) walking all splits in one dependent chain is latency-bound).
#define MLA_MERGE_COLS 128
// Tried and dropped, both slower: a barrier-free few-splits path issuing every load at once; a
// per-warp shuffle version of the weights.
// With one split the wg attends write the final rows themselves (final_rows) and skip this kernel.
extern "C" __global__ void __launch_bounds__(MLA_MERGE_COLS)
mla_merge_f32(const float* __restrict__ part, float* __restrict__ lat, int items, int heads, int kv_lora,
              int splits) {
    __shared__ float wsplit[256];
    __shared__ float scratch[32];
    const int n = blockIdx.x, h = blockIdx.y, c = blockIdx.z * MLA_MERGE_COLS + threadIdx.x;
    if (n >= items || h >= heads || splits > 256) return;
    const int w = kv_lora + 2;
    const float* p = part + ((i64)n * heads + h) * splits * w;
    float mloc = K3_NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) mloc = fmaxf(mloc, p[s * w + kv_lora]);
    const float mm = block_max(mloc, scratch);
    float lloc = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float ms = p[s * w + kv_lora];
        wsplit[s] = ms == K3_NEG_INF ? 0.0f : expf(ms - mm);
        lloc += wsplit[s] * p[s * w + kv_lora + 1];
    }
    const float ll = block_sum(lloc, scratch);  // its barriers also publish wsplit
    const float inv_l = ll > 0.0f ? 1.0f / ll : 0.0f;
    if (c >= kv_lora) return;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    int s = 0;
    for (; s + 4 <= splits; s += 4) {
        a0 += wsplit[s] * p[s * w + c];
        a1 += wsplit[s + 1] * p[(s + 1) * w + c];
        a2 += wsplit[s + 2] * p[(s + 2) * w + c];
        a3 += wsplit[s + 3] * p[(s + 3) * w + c];
    }
    for (; s < splits; ++s) a0 += wsplit[s] * p[s * w + c];
    lat[((i64)n * heads + h) * kv_lora + c] = ((a0 + a1) + (a2 + a3)) * inv_l;
}

// o[n, h*v_dim + v] = W_UV,h[v] . lat[n, h] for a tile of MLA_OP_ROWS rows of one head's W_UV,
// staged once in shared memory and applied to up to MLA_OP_ITEMS items (a batched GEMV: W_UV is
// read from HBM once per call, not once per item). Grid (heads, ceil(v_dim / 16),
// ceil(items / 64)), 256 threads: warp w owns rows 2w, 2w + 1; items go 4 at a time so 4
// independent lat loads per lane are in flight.
#define MLA_OP_ROWS 16
#define MLA_OP_ITEMS 64
extern "C" __global__ void __launch_bounds__(256)
mla_out_proj_f32(const float* __restrict__ lat, const float* __restrict__ kv_b, float* __restrict__ o, int items,
                 int heads, int nope, int v_dim, int kv_lora) {
    __shared__ __align__(16) float w[MLA_OP_ROWS * 512];
    const int h = blockIdx.x, v0 = blockIdx.y * MLA_OP_ROWS, n0 = blockIdx.z * MLA_OP_ITEMS;
    if (h >= heads || v0 >= v_dim || n0 >= items || kv_lora > 512) return;
    const int rows = min(MLA_OP_ROWS, v_dim - v0);
    const float* src = kv_b + ((i64)h * (nope + v_dim) + nope + v0) * kv_lora;  // rows are contiguous
    if ((kv_lora & 3) == 0) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* w4 = reinterpret_cast<float4*>(w);
#pragma unroll 8
        for (int i = threadIdx.x; i < (rows * kv_lora) >> 2; i += blockDim.x) w4[i] = s4[i];
    } else {
        for (int i = threadIdx.x; i < rows * kv_lora; i += blockDim.x) w[i] = src[i];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, r0 = 2 * (threadIdx.x >> 5);
    const int n1 = min(items, n0 + MLA_OP_ITEMS);
    const float* w0 = w + r0 * kv_lora;
    const float* w1 = w0 + kv_lora;
    for (int n = n0; n < n1; n += 4) {
        const float* x[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = lat + ((i64)min(n + k, n1 - 1) * heads + h) * kv_lora;
        float a[4][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll 4
        for (int c = lane; c < kv_lora; c += 32) {
            const float wa = w0[c], wb = w1[c];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float xv = x[k][c];
                a[k][0] += wa * xv;
                a[k][1] += wb * xv;
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float s0 = warp_sum(a[k][0]), s1 = warp_sum(a[k][1]);
            if (lane == 0 && n + k < n1) {
                float* dst = o + ((i64)(n + k) * heads + h) * v_dim + v0 + r0;
                if (r0 < rows) dst[0] = s0;
                if (r0 + 1 < rows) dst[1] = s1;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The two per-head weight products of decode on bf16 kv_b (the checkpoint's own storage: half the
// bytes of the f32 copy the kernels above read, and no f32 copy on the device for decode):
//   mla_absorb_q_bf16     qt[n, h] = [W_UK,h^T q_nope[n, h] ; q_r[n, h]]   per head [N, nope] x [nope, L]
//   mla_out_proj_bf16     o[n, h]  = W_UV,h lat[n, h]                       per head [N, L] x [L, v]^T
// Both on tensor cores (mma m16n8k16 bf16, f32 accumulate) with the weight as the A operand (16
// output rows per tile) and the items as B (n8 tiles): every weight byte is read once per call
// for all N items. As in bf16.cu gemv_bf16_tc_f32, each activation enters as three bf16 pieces
// (hi + mid + lo = all 24 mantissa bits) and bf16 x bf16 products are exact in f32, so the
// results track the f32 kernels (~1e-6). A sum over k ignores the order of k: a lane's fragment
// slots may hold any k's, as long as A and B agree, which lets the loads be wide and contiguous.

// c += A (two m16 tiles) x the three pieces of B, small pieces first.
__device__ __forceinline__ void mla_mma3(float (*c)[4], const u32 (*a)[4], const u32* b0, const u32* b1) {
#pragma unroll
    for (int p = 2; p >= 0; --p)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) tc_mma_bf16(c[mt], a[mt], b0[p], b1[p]);
}

// W_UK,h is stored [nope, L] (L contiguous) but the MMA wants output rows (L) by reduction (p):
// lane (g, t) loads 4 consecutive columns l = 4g.. of rows p = 16 ks + 4t + j (j < 4), one 8-byte
// load per row, and byte-permutes row pairs into its A fragments: m16 tile mt row g <-> column
// l + 2 mt, row g + 8 <-> l + 2 mt + 1; k slots (2t, 2t+1) <-> rows p, p + 1 and (2t+8, 2t+9) <->
// p + 2, p + 3. Its q fragment is then one float4 at q_nope[16 ks + 4t], and its four outputs per
// item are the contiguous columns l..l+3 (one float4 store).
// Grid (ceil(L / 128), heads), 128 threads: warp w owns columns [32 w, 32 w + 32) of the block's
// 128, with all of its W_UK slice in registers (64 per lane: all loads in flight at once), then
// loops over the items 16 at a time. nope in passes of 128 (K3: one); later passes add.
// Needs nope % 16 == 0, (nope + rope) % 4 == 0, L % 4 == 0 (16-byte q rows, 8-byte weight loads).
#define MLA_BQ_KSTEPS 8  // k16 steps per pass: 128 nope rows
extern "C" __global__ void __launch_bounds__(128)
mla_absorb_q_bf16(const float* __restrict__ q, const u16* __restrict__ kv_b, float* __restrict__ qt, int items,
                  int heads, int nope, int rope, int v_dim, int kv_lora) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, qk = nope + rope, row = kv_lora + rope;
    if (h >= heads) return;
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < items * rope; i += blockDim.x) {
            const i64 nh = (i64)(i / rope) * heads + h;
            qt[nh * row + kv_lora + i % rope] = q[nh * qk + nope + i % rope];
        }
    const int l = blockIdx.x * 128 + warp * 32 + 4 * g;
    const bool lok = l < kv_lora;
    const u16* wuk = kv_b + (i64)h * (nope + v_dim) * kv_lora + (lok ? l : 0);
    for (int p0 = 0; p0 < nope; p0 += 16 * MLA_BQ_KSTEPS) {
        const int ks_n = min(MLA_BQ_KSTEPS, (nope - p0) / 16);
        uint2 w[MLA_BQ_KSTEPS][4];
#pragma unroll
        for (int ks = 0; ks < MLA_BQ_KSTEPS; ++ks)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                w[ks][j] = (lok && ks < ks_n) ? ld_stream_u2(wuk + (i64)(p0 + 16 * ks + 4 * t + j) * kv_lora)
                                              : make_uint2(0, 0);
        u32 a[MLA_BQ_KSTEPS][2][4];
#pragma unroll
        for (int ks = 0; ks < MLA_BQ_KSTEPS; ++ks) {
            a[ks][0][0] = __byte_perm(w[ks][0].x, w[ks][1].x, 0x5410);
            a[ks][0][1] = __byte_perm(w[ks][0].x, w[ks][1].x, 0x7632);
            a[ks][0][2] = __byte_perm(w[ks][2].x, w[ks][3].x, 0x5410);
            a[ks][0][3] = __byte_perm(w[ks][2].x, w[ks][3].x, 0x7632);
            a[ks][1][0] = __byte_perm(w[ks][0].y, w[ks][1].y, 0x5410);
            a[ks][1][1] = __byte_perm(w[ks][0].y, w[ks][1].y, 0x7632);
            a[ks][1][2] = __byte_perm(w[ks][2].y, w[ks][3].y, 0x5410);
            a[ks][1][3] = __byte_perm(w[ks][2].y, w[ks][3].y, 0x7632);
        }
        // Items 16 at a time (two n8 tiles: four independent accumulator chains).
        for (int n0 = 0; n0 < items; n0 += 16) {
            const bool two = n0 + 8 < items;  // uniform
            const float* xr[2];
            bool xok[2];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int n = n0 + 8 * nt + g;
                xok[nt] = n < items;
                xr[nt] = q + ((i64)min(n, items - 1) * heads + h) * qk + p0 + 4 * t;
            }
            float c[2][2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) c[nt][mt][0] = c[nt][mt][1] = c[nt][mt][2] = c[nt][mt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < MLA_BQ_KSTEPS; ++ks) {
                if (ks >= ks_n) break;  // uniform
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    if (nt == 1 && !two) break;
                    const float4 x = xok[nt] ? __ldg(reinterpret_cast<const float4*>(xr[nt] + 16 * ks))
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
                    u32 b0[3], b1[3];
                    tc_split3(x.x, x.y, b0);
                    tc_split3(x.z, x.w, b1);
                    mla_mma3(c[nt], a[ks], b0, b1);
                }
            }
            // D: c[nt][mt][i] is row g + 8 (i >> 1) of tile mt (column l + 2 mt + (i >> 1)) for
            // item n0 + 8 nt + 2t + (i & 1).
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int n = n0 + 8 * nt + 2 * t + e;
                    if (!lok || n >= items) continue;
                    float4* dst = reinterpret_cast<float4*>(qt + ((i64)n * heads + h) * row + l);
                    float4 v = make_float4(c[nt][0][e], c[nt][0][2 + e], c[nt][1][e], c[nt][1][2 + e]);
                    if (p0 > 0) {
                        const float4 u = *dst;
                        v = make_float4(u.x + v.x, u.y + v.y, u.z + v.z, u.w + v.w);
                    }
                    *dst = v;
                }
        }
    }
}

// W_UV,h is stored [v, L] (L contiguous) = the MMA's A layout: lane (g, t) loads 16 bytes (8 columns
// 8t..8t+7 of a 32-column chunk) of rows g and g + 8 of each m16 tile; with the matching 8 lat
// values they fill two k16 MMAs (the gemv_bf16_tc_f32 layout). Grid (ceil(v / 32), heads), 128
// threads: the 4 warps share the block's 32 rows and split L (chunks w, w + 4, ..: at most 4 each
// for L <= 512, all in registers: 64 per lane), then the 4 partial sums meet in shared memory and
// are added in warp order (deterministic). Items in passes of MLA_BO_NT n8 tiles. L % 8 == 0.
#define MLA_BO_WARPS 4
#define MLA_BO_CHUNKS 4  // 32-column chunks per warp: L <= 512
#define MLA_BO_NT 8      // n8 item tiles per reduction pass (64 items)
extern "C" __global__ void __launch_bounds__(128)
mla_out_proj_bf16(const float* __restrict__ lat, const u16* __restrict__ kv_b, float* __restrict__ o, int items,
                  int heads, int nope, int v_dim, int kv_lora) {
    __shared__ float red[MLA_BO_WARPS][MLA_BO_NT * 8][32];  // [warp][(nt, mt, i)][lane]: 32 KB
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, v0 = blockIdx.x * 32;
    if (h >= heads || v0 >= v_dim || kv_lora > 32 * MLA_BO_WARPS * MLA_BO_CHUNKS) return;
    uint4 w[MLA_BO_CHUNKS][2][2];  // [chunk][mt][row g | g + 8]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int v = v0 + 16 * mt + 8 * r + g;
            const u16* src = kv_b + ((i64)h * (nope + v_dim) + nope + min(v, v_dim - 1)) * kv_lora;
#pragma unroll
            for (int i = 0; i < MLA_BO_CHUNKS; ++i) {
                const int col = (warp + MLA_BO_WARPS * i) * 32 + 8 * t;
                w[i][mt][r] = (v < v_dim && col < kv_lora) ? ld_stream_u4(src + col) : make_uint4(0, 0, 0, 0);
            }
        }
    for (int n0 = 0; n0 < items; n0 += 8 * MLA_BO_NT) {
        // Two n8 tiles at a time: four independent accumulator chains.
        for (int nt0 = 0; nt0 < MLA_BO_NT && n0 + 8 * nt0 < items; nt0 += 2) {
            const bool two = n0 + 8 * nt0 + 8 < items;  // uniform
            const float* xr[2];
            bool xok[2];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int n = n0 + 8 * (nt0 + k) + g;
                xok[k] = n < items;
                xr[k] = lat + ((i64)min(n, items - 1) * heads + h) * kv_lora;
            }
            float c[2][2][4];
#pragma unroll
            for (int k = 0; k < 2; ++k)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) c[k][mt][0] = c[k][mt][1] = c[k][mt][2] = c[k][mt][3] = 0.0f;
#pragma unroll
            for (int i = 0; i < MLA_BO_CHUNKS; ++i) {
                const int col = (warp + MLA_BO_WARPS * i) * 32 + 8 * t;
                if ((warp + MLA_BO_WARPS * i) * 32 >= kv_lora) break;  // uniform
                u32 a0[2][4], a1[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const uint4 r = w[i][mt][0], r8 = w[i][mt][1];
                    a0[mt][0] = r.x, a0[mt][1] = r8.x, a0[mt][2] = r.y, a0[mt][3] = r8.y;
                    a1[mt][0] = r.z, a1[mt][1] = r8.z, a1[mt][2] = r.w, a1[mt][3] = r8.w;
                }
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    if (k == 1 && !two) break;
                    float4 lo4 = make_float4(0.f, 0.f, 0.f, 0.f), hi4 = lo4;
                    if (xok[k] && col < kv_lora) {
                        const float4* p = reinterpret_cast<const float4*>(xr[k] + col);
                        lo4 = __ldg(p);
                        hi4 = __ldg(p + 1);
                    }
                    u32 b[4][3];
                    tc_split3(lo4.x, lo4.y, b[0]);
                    tc_split3(lo4.z, lo4.w, b[1]);
                    tc_split3(hi4.x, hi4.y, b[2]);
                    tc_split3(hi4.z, hi4.w, b[3]);
                    mla_mma3(c[k], a0, b[0], b[1]);
                    mla_mma3(c[k], a1, b[2], b[3]);
                }
            }
#pragma unroll
            for (int k = 0; k < 2; ++k)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) red[warp][((nt0 + k) * 2 + mt) * 4 + i][lane] = c[k][mt][i];
        }
        __syncthreads();
        // Slot ((nt, mt), i) of lane (g', t'): row v0 + 16 mt + g' + 8 (i >> 1), item n0 + 8 nt + 2t' + (i & 1).
        for (int s = threadIdx.x; s < MLA_BO_NT * 8 * 32; s += blockDim.x) {
            const int slot = s >> 5, ln = s & 31, i = slot & 3, mt = (slot >> 2) & 1, nt = slot >> 3;
            const int n = n0 + 8 * nt + 2 * (ln & 3) + (i & 1), v = v0 + 16 * mt + (ln >> 2) + 8 * (i >> 1);
            if (n < items && v < v_dim)
                o[((i64)n * heads + h) * v_dim + v] =
                    ((red[0][slot][ln] + red[1][slot][ln]) + red[2][slot][ln]) + red[3][slot][ln];
        }
        __syncthreads();
    }
}
