// Routed experts in MXFP4 (docs/model-format.md) for decode steps: weight-only W4A32 on CUDA cores.
//   moe_sort_assignments   group the T*k (token, slot) assignments by expert (counting sort)
//   mxfp4_up_gemv_f32      act[a] = SiTU-GLU(W1_e z_t, W3_e z_t) for each assignment a of e
//   mxfp4_down_gemv_f32    y[a] = W2_e act[a]
//   mxfp4_up_stream_f32    the same two products for 1-token steps (the default there), one
//   mxfp4_down_stream_f32  assignment at a time straight from the router's ids (no sort)
//   mxfp4_up_stream2_f32   the stream split with the products on tensor cores (candidate,
//   mxfp4_down_stream2_f32 K3_MX_EXPERTS=stream2): partial sums per part of the row,
//   moe_combine_parts_f32  summed by the down kernel's staging / this combine
//   moe_combine_f32        out[t] = sum_j w[t,j] y[t*k + j]   (fixed slot order: deterministic)
// Experts of a layer are stored back to back: packed [E, rows, cols/2], scales [E, rows, cols/32].
// Large steps expand the experts to bf16 for tensor-core GEMMs instead (moe_gemm.cu); steps of 2
// tokens and more take the tensor-core pair in mxfp4_tc.cu, 1-token steps the stream pair here
// (ops.rs mx_experts_choice). The gemv pair (H200, K3 sizes, top-16, T = 1: 183 us with sort and
// combine, 36% of the weight-traffic floor) stays for A/B and forced multi-token runs.
#include "common.cuh"


// Single block (1024 threads). idx [n_assign] expert ids; offsets [E+1] (out), sorted [n_assign]
// (out) = assignment ids grouped by expert. Order inside an expert is arbitrary: each
// assignment's output has its own row, so results do not depend on it.
extern "C" __global__ void moe_sort_assignments(const int* __restrict__ idx, int n_assign, int experts,
                                                int* __restrict__ offsets, int* __restrict__ sorted) {
    __shared__ int count[1025];
    __shared__ int cursor[1025];
    if (experts > 1024) return;
    for (int e = threadIdx.x; e <= experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const int e = idx[a];
        if (e >= 0 && e < experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < experts; ++e) {
            offsets[e] = run;
            cursor[e] = run;
            run += count[e];
        }
        offsets[experts] = run;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n_assign; a += blockDim.x) {
        const int e = idx[a];
        if (e >= 0 && e < experts) sorted[atomicAdd(&cursor[e], 1)] = a;
    }
}

// mx_active_expert (common.cuh) maps block x of the expert kernels to the x-th busy expert.

// ---------------------------------------------------------------------------------------------
// Decode-step expert kernels (few tokens per expert). At T = 1
// the step is one pass over 16 experts' weights (281 MB at K3 sizes), so what counts is shared /
// L1 wavefronts and instructions per weight byte. Two lanes share a row (lane 2r + h takes the
// 16-byte MX blocks h, h + 2, ...: each lane pair reads whole 32-byte sectors) and sum the halves
// with one shuffle at the end: no block reduction. The step's tokens for expert e are staged in
// shared memory (up to `stage` per pass), so all 16 rows of a warp read the same activations
// (broadcast) and each weight byte is loaded once per pass and applied to every staged token.
// A nibble decodes through a 16-entry shared table (index = code * 4 built with one AND per 4
// codes, one byte extract, one LDS): 16 distinct words in 16 banks, so never a conflict, and the
// values are exact (no subnormal tricks that -ftz could flush). The block's scale is applied once
// per 32-value dot. Extra tokens beyond `stage` take further passes (weights re-read).
#define MXG_ROWS 64 // rows per 128-thread block: 16 per warp, two lanes per row
#define MXG_T 4     // accumulators per lane and matrix: the most tokens one pass applies

__shared__ float mxg_tab[16];  // E2M1 code -> value
// Staged activations, [stage][cols / 4] float4; float4 g of a row sits at g ^ ((g >> 1) & 4): the
// odd 32-value chunks (the h = 1 lanes') have their halves swapped, so a warp's two distinct
// addresses per load land in different banks.
extern __shared__ float4 mxg_xs[];

__device__ __forceinline__ void mxg_stage(const float* __restrict__ src, int cols4, float4* dst) {
    const float4* s4 = reinterpret_cast<const float4*>(src);
    for (int g = threadIdx.x; g < cols4; g += blockDim.x) dst[g ^ ((g >> 1) & 4)] = s4[g];
}

// One packed word (elements 8 wi .. 8 wi + 7: byte k = element 2k low nibble, 2k + 1 high).
__device__ __forceinline__ void mxg_decode_word(u32 w, float* v) {
    const u32 lo = (w << 2) & 0x3c3c3c3cu, hi = (w >> 2) & 0x3c3c3c3cu;  // code * 4 in each byte
    const char* t = reinterpret_cast<const char*>(mxg_tab);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = *reinterpret_cast<const float*>(t + __byte_perm(lo, 0, 0x4440 + k));
        v[2 * k + 1] = *reinterpret_cast<const float*>(t + __byte_perm(hi, 0, 0x4440 + k));
    }
}

// acc[m][i] = this lane's half of row m (NM matrices) . staged token i, for i < nt. U chunk steps
// of loads are issued before any is decoded (bytes in flight); DC independent FMA chains per dot.
template <int NM, int U>
__device__ __forceinline__ void mxg_rows(const u8* const (&pk)[NM], const u8* const (&ps)[NM], int nchunks, int h,
                                         int nt, int cols4, float (&acc)[NM][MXG_T]) {
    constexpr int DC = NM == 1 ? 2 : 1;
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int i = 0; i < MXG_T; ++i) acc[m][i] = 0.0f;
    for (int j0 = 0; j0 < nchunks; j0 += 2 * U) {
        uint4 raw[NM][U];
        u32 sb[NM][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = min(j0 + 2 * u + h, nchunks - 1);  // past the end: loaded, not used
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                raw[m][u] = __ldg(reinterpret_cast<const uint4*>(pk[m] + c * 16));
                sb[m][u] = ps[m][c];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = j0 + 2 * u + h;
            if (c < nchunks) {
                const float4* xlo = mxg_xs + c * 8 + 4 * h;  // logical float4s 0..3 of chunk c
                const float4* xhi = mxg_xs + c * 8 - 4 * h;  // 4..7
                float d[NM][MXG_T][DC];
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int i = 0; i < MXG_T; ++i)
#pragma unroll
                        for (int q = 0; q < DC; ++q) d[m][i][q] = 0.0f;
#pragma unroll
                for (int wi = 0; wi < 4; ++wi) {
                    float v[NM][8];
#pragma unroll
                    for (int m = 0; m < NM; ++m) {
                        const uint4 r4 = raw[m][u];
                        mxg_decode_word(wi == 0 ? r4.x : wi == 1 ? r4.y : wi == 2 ? r4.z : r4.w, v[m]);
                    }
                    const float4* xp = wi < 2 ? xlo : xhi;
#pragma unroll
                    for (int i = 0; i < MXG_T; ++i) {
                        if (i < nt) {
                            const float4 a = xp[i * cols4 + 2 * wi], b = xp[i * cols4 + 2 * wi + 1];
#pragma unroll
                            for (int m = 0; m < NM; ++m) {
                                float s = d[m][i][wi % DC];
                                s = fmaf(v[m][0], a.x, s);
                                s = fmaf(v[m][1], a.y, s);
                                s = fmaf(v[m][2], a.z, s);
                                s = fmaf(v[m][3], a.w, s);
                                s = fmaf(v[m][4], b.x, s);
                                s = fmaf(v[m][5], b.y, s);
                                s = fmaf(v[m][6], b.z, s);
                                s = fmaf(v[m][7], b.w, s);
                                d[m][i][wi % DC] = s;
                            }
                        }
                    }
                }
#pragma unroll
                for (int m = 0; m < NM; ++m) {
                    const float sc = e8m0_to_f32((u8)sb[m][u]);
#pragma unroll
                    for (int i = 0; i < MXG_T; ++i) {
                        float s = d[m][i][0];
#pragma unroll
                        for (int q = 1; q < DC; ++q) s += d[m][i][q];
                        acc[m][i] = fmaf(s, sc, acc[m][i]);
                    }
                }
            }
        }
    }
}

// Grid (min(E, assignments), ceil(inter / 64)), 128 threads, dynamic shared memory stage * latent
// * 4 bytes: block x takes the x-th busy expert e (mx_active_expert), lane pair r of the block
// computes row blockIdx.y*64 + r of W1 and W3 for every assignment of e, `stage` (1..4) tokens
// per pass. `experts` = E; `stage` as ops.rs mx_gemv_stage.
extern "C" __global__ void __launch_bounds__(128)
mxfp4_up_gemv_f32(const float* __restrict__ z, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                  const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                  const int* __restrict__ sorted, float* __restrict__ act, int top_k, int latent, int inter,
                  float beta, float beta_lin, int has_lin, int experts, int stage) {
    const int e = mx_active_expert(offsets, experts, blockIdx.x);
    if (threadIdx.x < 16) mxg_tab[threadIdx.x] = fp4_e2m1_to_f32(threadIdx.x);
    if (e < 0) return;  // block-uniform
    const int h = threadIdx.x & 1, r = blockIdx.y * MXG_ROWS + (threadIdx.x >> 1);
    const int nb = latent / 32, cols4 = latent / 4;
    const i64 mrow = (i64)e * inter + min(r, inter - 1);  // tail lanes load a valid row, store nothing
    const u8* pk[2] = {w1p + mrow * (latent / 2), w3p + mrow * (latent / 2)};
    const u8* ps[2] = {w1s + mrow * nb, w3s + mrow * nb};
    const int a0 = offsets[e], a1 = offsets[e + 1], per = max(1, min(stage, MXG_T));
    for (int t0 = a0; t0 < a1; t0 += per) {
        const int nt = min(per, a1 - t0);
        __syncthreads();  // the previous pass is done with the stage (first pass: mxg_tab written)
        for (int i = 0; i < nt; ++i)
            mxg_stage(z + (i64)(sorted[t0 + i] / top_k) * latent, cols4, mxg_xs + i * cols4);
        __syncthreads();
        float acc[2][MXG_T];
        mxg_rows<2, 2>(pk, ps, nb, h, nt, cols4, acc);
#pragma unroll
        for (int i = 0; i < MXG_T; ++i) {
            const float g = acc[0][i] + __shfl_xor_sync(K3_FULL_MASK, acc[0][i], 1);
            const float u = acc[1][i] + __shfl_xor_sync(K3_FULL_MASK, acc[1][i], 1);
            if (h == 0 && i < nt && r < inter)
                act[(i64)sorted[t0 + i] * inter + r] = situ_glu_one(g, u, beta, beta_lin, has_lin);
        }
    }
}

// Grid (min(E, assignments), ceil(latent / 64)), 128 threads, dynamic shared memory stage * inter
// * 4 bytes: y[a, r] = W2_e[r, :] . act[a, :], experts, rows and passes as above.
extern "C" __global__ void __launch_bounds__(128)
mxfp4_down_gemv_f32(const float* __restrict__ act, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                    const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y,
                    int latent, int inter, int experts, int stage) {
    const int e = mx_active_expert(offsets, experts, blockIdx.x);
    if (threadIdx.x < 16) mxg_tab[threadIdx.x] = fp4_e2m1_to_f32(threadIdx.x);
    if (e < 0) return;
    const int h = threadIdx.x & 1, r = blockIdx.y * MXG_ROWS + (threadIdx.x >> 1);
    const int nb = inter / 32, cols4 = inter / 4;
    const i64 mrow = (i64)e * latent + min(r, latent - 1);
    const u8* pk[1] = {w2p + mrow * (inter / 2)};
    const u8* ps[1] = {w2s + mrow * nb};
    const int a0 = offsets[e], a1 = offsets[e + 1], per = max(1, min(stage, MXG_T));
    for (int t0 = a0; t0 < a1; t0 += per) {
        const int nt = min(per, a1 - t0);
        __syncthreads();
        for (int i = 0; i < nt; ++i) mxg_stage(act + (i64)sorted[t0 + i] * inter, cols4, mxg_xs + i * cols4);
        __syncthreads();
        float acc[1][MXG_T];
        mxg_rows<1, 4>(pk, ps, nb, h, nt, cols4, acc);
#pragma unroll
        for (int i = 0; i < MXG_T; ++i) {
            const float v = acc[0][i] + __shfl_xor_sync(K3_FULL_MASK, acc[0][i], 1);
            if (h == 0 && i < nt && r < latent) y[(i64)sorted[t0 + i] * latent + r] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Stream kernels: the default for 1-token steps (ops.rs mx_experts_choice). The gemv pair above
// reads 64 bytes per row per loop trip and then decodes them with nothing else in flight, at one
// table load per weight (the shared-memory pipe, not HBM, sets its pace). Here:
// - Work: the (assignment, row) pairs, flattened, split evenly over every warp of a grid of two
//   256-thread blocks per SM (ops.rs mx_stream_launch): at most one row of imbalance, no tail
//   wave. Assignment a = (token a / top_k, expert idx[a]) straight from the router: no sort.
// - Loads: a warp takes a batch of up to 2 * RH consecutive rows (half-warp h the rows 2 j + h);
//   lane l of a half loads 16-byte chunk l & 15, +16, +32, ... of its rows, so each load
//   instruction reads two whole aligned 256-byte runs. NM * RH = 8 loads per lane per step
//   (128 B; 64 KB per SM), and each row's next chunk is requested as soon as its current one is
//   decoded (rolling prefetch: the HBM stream never waits on the decode of a step).
// - Decode: one shared load per byte (two weights) from a 256-entry bf16x2 table replicated per
//   lane (entry b of lane l at word 64 b + l: the address is one PRMT of the byte and 4 l, and
//   every lane hits its own bank), then two shifts/masks to f32 (exact: an E2M1 value fits bf16).
//   That is half the shared wavefronts of the 16-entry table and about 3 issue slots per weight.
// - Activations: the upper 128 bytes of each 256-byte table row hold one 32-value chunk of x
//   (two staged rows, chunks 0..127 each, float4 j of chunk c at j ^ (c & 7): the 16 chunks of a
//   load instruction spread over all banks). A lane keeps its chunk's 32 values in registers and
//   applies them to all NM * RH rows of the batch.
// Sums: per lane over its chunks (f32 FMA, block scale applied per 32-value dot as above), then
// a 16-lane xor tree. Exact f32 products; only the summation order differs from the gemv pair.
#define MXS_WARPS 8                    // warps per block
#define MXS_TAB_ROW 256                // bytes per table row: 32 lanes x bf16x2, then one x chunk
#define MXS_SHARED (256 * MXS_TAB_ROW) // dynamic shared memory: 64 KB (ops.rs MX_STREAM_SHARED)
#define MXS_MAX_CHUNKS 128             // chunks per staged row: cols / 32 + 1 zero chunk (cols <= 4064)

extern __shared__ __align__(16) u32 mxs_smem[];

// 16 weight bytes, streamed past L1 (read once).
__device__ __forceinline__ uint4 mxs_ld(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ void mxs_fill_table() {
    for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
        const u32 b = (u32)i >> 5;
        const u32 lo = __float_as_uint(fp4_e2m1_to_f32(b & 15u)) >> 16, hi = __float_as_uint(fp4_e2m1_to_f32(b >> 4)) >> 16;
        mxs_smem[(b << 6) | ((u32)i & 31u)] = lo | (hi << 16);
    }
}

// Stage one f32 row of `cols` values as x slot `slot` (layout in the header).
__device__ __forceinline__ void mxs_stage(const float* __restrict__ src, int cols, int slot) {
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* xs = reinterpret_cast<float4*>(mxs_smem) + 16 * MXS_MAX_CHUNKS * slot + 8;
    for (int g = threadIdx.x; g < cols / 4 + 8; g += blockDim.x) {  // + chunk nb = 0 (mxs_batch)
        const int c = g >> 3;
        xs[16 * c + ((g & 7) ^ (c & 7))] = g < cols / 4 ? s4[g] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// First row of the flattened (assignment, row) space owned by warp `part` of `parts`.
__device__ __forceinline__ i64 mxs_split(i64 n, i64 part, i64 parts) { return n * part / parts; }

// One batch: rows r0 + 2 j + h (j < RH, 2 j + h < nr) of NM matrices (pk / ps: the expert's
// packed bytes / scales at row 0, nb 32-value chunks per row) against x slot `slot`.
// acc[m][j]: this lane's partial dot of its row; the caller reduces over the half-warp. Lanes
// past the batch load its last row (sums not stored); lanes past the row (nb % 16 != 0) load its
// last chunk against the zero chunk staged at index nb (E2M1 values are finite: the dot is 0).
template <int NM, int RH>
__device__ __forceinline__ void mxs_batch(const u8* const (&pk)[NM], const u8* const (&ps)[NM], int r0, int nr,
                                          int nb, int slot, float (&acc)[NM][RH]) {
    const int lane = threadIdx.x & 31, h = lane >> 4, cl = lane & 15;
    const u32 lane4 = (u32)lane << 2;
    const char* tab = reinterpret_cast<const char*>(mxs_smem);
    const float4* xs = reinterpret_cast<const float4*>(mxs_smem) + 16 * MXS_MAX_CHUNKS * slot + 8;
    const u32 rowb = (u32)nb * 16u;  // an expert's matrix is < 2^31 bytes (ops.rs)
    const u8* wrow[NM];
    const u8* srow[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        wrow[m] = pk[m] + (i64)r0 * rowb;
        srow[m] = ps[m] + (i64)r0 * nb;
    }
    uint4 raw[NM][RH];
    u32 sc[NM][RH];
    // Chunk min(cl + 16 i, nb - 1) of row slot j.
    auto load = [&](int m, int j, int i) {
        const u32 rr = (u32)min(2 * j + h, nr - 1), cc = (u32)min(cl + 16 * i, nb - 1);
        raw[m][j] = mxs_ld(wrow[m] + (rr * rowb + cc * 16u));
        sc[m][j] = __ldg(srow[m] + (rr * (u32)nb + cc));
    };
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < RH; ++j) {
            acc[m][j] = 0.0f;
            load(m, j, 0);
        }
    const int nsteps = (nb + 15) >> 4;
    for (int i = 0; i < nsteps; ++i) {
        const int c = min(cl + 16 * i, nb);  // nb: the zero chunk
        const bool more = i + 1 < nsteps;
        float xv[32];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const float4 v = xs[16 * c + (q ^ (c & 7))];
            xv[4 * q] = v.x;
            xv[4 * q + 1] = v.y;
            xv[4 * q + 2] = v.z;
            xv[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int j = 0; j < RH; ++j) {
                if (2 * j >= nr) continue;  // warp-uniform: no row of this slot in either half
                const uint4 w = raw[m][j];
                float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const u32 wd = q == 0 ? w.x : q == 1 ? w.y : q == 2 ? w.z : w.w;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        // (byte k << 8) | 4 lane: entry (byte, lane) of the table.
                        const u32 off = __byte_perm(wd, lane4, 0x5504u + 16u * k);
                        const u32 p = *reinterpret_cast<const u32*>(tab + off);
                        d0 = fmaf(__uint_as_float(p << 16), xv[8 * q + 2 * k], d0);
                        d1 = fmaf(__uint_as_float(p & 0xffff0000u), xv[8 * q + 2 * k + 1], d1);
                    }
                }
                acc[m][j] = fmaf(d0 + d1, e8m0_to_f32((u8)sc[m][j]), acc[m][j]);
                if (more) load(m, j, i + 1);
            }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < RH; ++j)
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) acc[m][j] += __shfl_xor_sync(K3_FULL_MASK, acc[m][j], o);
}

// The block's part of the flattened (assignment, row) space, n_assign x rows: stage the x rows
// of up to two assignments at a time, then each warp runs its own rows of them in batches.
// x_of(j) = the f32 input row of assignment j; emit(j, e, r0, nr, acc) stores a batch (lanes
// with lane & 15 == 0 hold the sums).
template <int NM, int RH, typename XOf, typename Batch>
__device__ __forceinline__ void mxs_drive(const int* __restrict__ idx, int experts, int n_assign, int rows,
                                          int cols, XOf x_of, Batch batch) {
    __shared__ int slot_e[2];
    const int warp = threadIdx.x >> 5;
    const i64 n = (i64)n_assign * rows, parts = (i64)gridDim.x * MXS_WARPS, w0 = (i64)blockIdx.x * MXS_WARPS;
    const i64 b0 = mxs_split(n, w0, parts), b1 = mxs_split(n, w0 + MXS_WARPS, parts);
    if (b1 <= b0) return;  // block-uniform
    const i64 q0 = mxs_split(n, w0 + warp, parts), q1 = mxs_split(n, w0 + warp + 1, parts);
    mxs_fill_table();
    const int jlo = (int)(b0 / rows), jhi = (int)((b1 - 1) / rows);
    for (int jr = jlo; jr <= jhi; jr += 2) {
        __syncthreads();  // table written (first round); the previous round is done with the x slots
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int j = jr + s;
            const int e = j <= jhi ? idx[j] : -1;
            const bool ok = e >= 0 && e < experts;
            if (threadIdx.x == 0) slot_e[s] = ok ? e : -1;
            if (ok) mxs_stage(x_of(j), cols, s);
        }
        __syncthreads();
        const i64 lo = max(q0, (i64)jr * rows), hi = min(q1, (i64)(jr + 2) * rows);
        for (i64 q = lo; q < hi;) {
            const int j = (int)(q / rows), r0 = (int)(q - (i64)j * rows);
            const int nr = (int)min((i64)(2 * RH), min(hi - q, (i64)(rows - r0)));
            const int e = slot_e[j - jr];
            if (e >= 0) batch(j, e, r0, nr, j - jr);  // warp-uniform
            q += nr;
        }
    }
}

// Grid (ops.rs mx_stream_launch: up to 2 per SM), 256 threads, MXS_SHARED dynamic shared memory
// (opt-in). act[a, r] = SiTU-GLU(W1_e[r] . z_t, W3_e[r] . z_t) for every assignment a < n_assign
// with e = idx[a] in [0, experts) and t = a / top_k (other assignments: rows left as they are).
// latent <= 4064 (ops.rs MX_STREAM_MAX_COLS), a multiple of 32.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_up_stream_f32(const float* __restrict__ z, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                    const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ idx,
                    float* __restrict__ act, int top_k, int latent, int inter, float beta, float beta_lin, int has_lin,
                    int experts, int n_assign) {
    const int nb = latent / 32;
    auto x_of = [&](int j) { return z + (i64)(j / top_k) * latent; };
    auto batch = [&](int j, int e, int r0, int nr, int slot) {
        const i64 m0 = (i64)e * inter;
        const u8* pk[2] = {w1p + m0 * (latent / 2), w3p + m0 * (latent / 2)};
        const u8* ps[2] = {w1s + m0 * nb, w3s + m0 * nb};
        float acc[2][4];
        mxs_batch<2, 4>(pk, ps, r0, nr, nb, slot, acc);
        const int h = (threadIdx.x >> 4) & 1;
        if ((threadIdx.x & 15) == 0) {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (2 * k + h < nr)
                    act[(i64)j * inter + r0 + 2 * k + h] = situ_glu_one(acc[0][k], acc[1][k], beta, beta_lin, has_lin);
        }
    };
    mxs_drive<2, 4>(idx, experts, n_assign, inter, latent, x_of, batch);
}

// Grid, block and shared memory as mxfp4_up_stream_f32: y[a, r] = W2_e[r] . act[a] for every
// assignment a < n_assign with e = idx[a] in [0, experts). inter <= 4064, a multiple of 32.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_down_stream_f32(const float* __restrict__ act, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                      const int* __restrict__ idx, float* __restrict__ y, int latent, int inter, int experts,
                      int n_assign) {
    const int nb = inter / 32;
    auto x_of = [&](int j) { return act + (i64)j * inter; };
    auto batch = [&](int j, int e, int r0, int nr, int slot) {
        const i64 m0 = (i64)e * latent;
        const u8* pk[1] = {w2p + m0 * (inter / 2)};
        const u8* ps[1] = {w2s + m0 * nb};
        float acc[1][8];
        mxs_batch<1, 8>(pk, ps, r0, nr, nb, slot, acc);
        const int h = (threadIdx.x >> 4) & 1;
        if ((threadIdx.x & 15) == 0) {
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (2 * k + h < nr) y[(i64)j * latent + r0 + 2 * k + h] = acc[0][k];
        }
    };
    mxs_drive<1, 8>(idx, experts, n_assign, latent, inter, x_of, batch);
}

// ---------------------------------------------------------------------------------------------
// Stream2 kernels (K3_MX_EXPERTS=stream2, 1-token steps; moe_stream.rs mx_stream2_plan): the stream
// pair's no-sort work split and 64 KB table, with the multiply-adds on tensor cores. Why: the
// stream pair spends ~3.6 issue slots per weight (per byte: PRMT + table LDS + 2 unpacks + 2
// FFMA, plus per-row overheads); here a byte is one PRMT + one conflict-free LDS of a bf16x2 pair
// that goes straight into mma.sync m16n8k16 (the table entry is the A register): SASS per step of
// the up kernel (32 weights of each of 4 rows per lane) is ~265 instructions (64 PRMT, 64 IADD,
// 64 LDS, 16 HMMA, 4 LDS.128, loads, scales), ~2 slots per weight and no FFMA per weight.
// - One token per assignment leaves 7 of the mma's 8 B columns free, so they carry the block
//   scales instead of tokens: lane 4g + t holds the weights of MX block 4s + t (step s: 128
//   columns) of rows g and g + 8, and B column n is x's block 4s + n/2 (hi = bf16(x) for n even,
//   lo = bf16(x - hi) for n odd) on the k slots of lane t = n/2 and zero elsewhere. So C[r][2t],
//   C[r][2t+1] (lane t's own accumulators) are exactly block 4s + t's hi / lo dots of its rows:
//   the lane scales them by its own E8M0 byte in f32 (exact) and adds to its row sums. A step is
//   8 mma per 16-row tile from a zero C; only the 8 lanes g/2 == t read x (4 LDS.128 of the
//   staged block, the others a zero block).
// - Work: units (assignment, 16-row tile, part of the steps) flattened, split evenly over all warps
//   (two 256-thread blocks per SM); `parts` (host-chosen, 1..8) cuts each row into that many
//   step ranges so the units spread evenly (K3: 2 for up, 4 for down: <= 3% over the mean).
//   Each unit writes its own partial row sums ([assignment, part, ...]); the consumer (the down
//   kernel's staging, moe_combine_parts_f32) adds them in part order: deterministic.
// - Loads: per step a lane reads one 16-byte block of each of its 2 NM rows (a quad covers 64
//   contiguous bytes of a row; the next step the next 64) and its scale bytes, D steps ahead in a
//   register ring that runs across unit boundaries (NM * 2 * D = 8 loads, 128 B per lane in
//   flight, 64 KB per SM, as the stream pair). The first loads are issued before the table fill.
// - Staged x: block c of slot s in the upper half of table row 128 s + c: 32 hi bf16, then 32
//   lo bf16, 16-byte piece q at q ^ (c & 3) (the 4 blocks of a step in different banks); blocks
//   nb .. 4 ns - 1 zero (rows whose block count is not a multiple of 4: lanes past the row read
//   its last block against them); row 127 is the zero block of the idle lanes.
// Precision as the tc pairs: exact bf16 weights times ~16 bits of x (hi + lo), f32 accumulation.
#define MXQ_MAX_CHUNKS 124  // 32-value blocks per staged row (cols <= 3968), padded to 4 below row 127
#define MXQ_ZERO_ROW 127

__device__ __forceinline__ void mxq_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// bf16x2 (E2M1 of the low, high nibble) of byte `by` of `word`: entry (byte, lane) of the table.
// (On sm_90 the shared window base carries the CTA id, so each lookup is PRMT + IADD + LDS.)
__device__ __forceinline__ u32 mxq_pair(u32 word, u32 lane4, int by) {
    const u32 off = __byte_perm(word, lane4, 0x5504u + 16u * by);
    return *reinterpret_cast<const u32*>(reinterpret_cast<const char*>(mxs_smem) + off);
}

__device__ __forceinline__ u32 mxq_word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// Stage one input row (cols values; val8(col, v) gives columns col .. col + 7 in f32) as hi / lo
// bf16 into x slot `slot` (layout in the header).
template <typename Val8>
__device__ __forceinline__ void mxq_stage(int cols, int slot, Val8 val8) {
    const int nb = cols / 32, npad = (nb + 3) & ~3;
    char* base = reinterpret_cast<char*>(mxs_smem);
    for (int i = threadIdx.x; i < 4 * npad; i += blockDim.x) {
        const int c = i >> 2, q = i & 3;
        float v[8];
        if (c < nb) {
            val8(8 * i, v);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
        }
        u32 hi[4], lo[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u16 h0, l0, h1, l1;
            split_bf16(v[2 * k], h0, l0);
            split_bf16(v[2 * k + 1], h1, l1);
            hi[k] = h0 | ((u32)h1 << 16);
            lo[k] = l0 | ((u32)l1 << 16);
        }
        char* p = base + ((128 * slot + c) << 8) + 128 + 16 * (q ^ (c & 3));
        *reinterpret_cast<uint4*>(p) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        *reinterpret_cast<uint4*>(p + 64) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
}

// The block's part of the units (assignment a < n_assign, tile of 16 rows, part p < parts) of NM
// matrices [experts, rows, cols] (packed wp[m], scales ws[m]): stage the inputs of up to two
// assignments at a time (stage(j, slot)), then each warp runs its own units. emit(a, p, m, r, v)
// stores row r's partial sum of part p (called once per valid row, by one lane).
template <int NM, int D, typename Stage, typename Emit>
__device__ __forceinline__ void mxq_drive(const u8* const (&wp)[NM], const u8* const (&ws)[NM],
                                          const int* __restrict__ idx, int experts, int n_assign, int rows, int cols,
                                          int parts, Stage stage, Emit emit) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 lane4 = (u32)lane << 2;
    const int nb = cols / 32, ns = (nb + 3) >> 2, tiles = (rows + 15) >> 4;
    if (parts < 1 || parts > ns || 4 * ns > MXQ_MAX_CHUNKS) return;  // host-checked (an empty part would spin)
    const i64 per_a = (i64)tiles * parts, n = (i64)n_assign * per_a;
    const i64 nw = (i64)gridDim.x * MXS_WARPS, w0 = (i64)blockIdx.x * MXS_WARPS;
    const i64 b0 = mxs_split(n, w0, nw), b1 = mxs_split(n, w0 + MXS_WARPS, nw);
    if (b1 <= b0) return;  // block-uniform
    const i64 q0 = mxs_split(n, w0 + warp, nw), q1 = mxs_split(n, w0 + warp + 1, nw);
    const int jlo = (int)(b0 / per_a), jhi = (int)((b1 - 1) / per_a);
    const u32 rowb = (u32)nb * 16u;

    // Load cursor (runs D steps ahead of the compute cursor over the warp's units of a round).
    i64 lu = 0, lend = 0;
    int ls = 0, lse = 0;
    const u8* lw[NM][2];
    const u8* lsc[NM][2];
    uint4 rw[D][NM][2];
    u32 rs[D][NM][2];
    auto l_enter = [&]() {
        const int a = (int)(lu / per_a);
        const int rem = (int)(lu - (i64)a * per_a), tile = rem / parts, p = rem - tile * parts;
        int e = __ldg(idx + a);
        if (e < 0 || e >= experts) e = 0;  // skipped assignment: loads stay in bounds, nothing stored
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 row = (i64)e * rows + min(16 * tile + g + 8 * h, rows - 1);
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                lw[m][h] = wp[m] + row * rowb;
                lsc[m][h] = ws[m] + row * nb;
            }
        }
        ls = p * ns / parts;
        lse = (p + 1) * ns / parts;
    };
    auto l_issue = [&](int k) {  // k: a constant after unrolling (register ring)
        if (lu >= lend) return;
        const u32 c = (u32)min(4 * ls + t, nb - 1);
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                rw[k][m][h] = mxs_ld(lw[m][h] + c * 16u);
                rs[k][m][h] = __ldg(lsc[m][h] + c);
            }
        if (++ls == lse && ++lu < lend) l_enter();
    };
    auto start = [&](i64 lo, i64 hi) {
        lu = lo;
        lend = hi;
        if (lu < lend) l_enter();
#pragma unroll
        for (int k = 0; k < D; ++k) l_issue(k);
    };

    // Compute cursor.
    int jr = jlo;
    i64 cu = 0, cend = 0;
    int cs = 0, cse = 0, ca = 0, cp = 0, ctile = 0;
    bool cok = false;
    float acc[NM][2];
    auto c_enter = [&]() {
        ca = (int)(cu / per_a);
        const int rem = (int)(cu - (i64)ca * per_a);
        ctile = rem / parts;
        cp = rem - ctile * parts;
        const int e = __ldg(idx + ca);
        cok = e >= 0 && e < experts;
        cs = cp * ns / parts;
        cse = (cp + 1) * ns / parts;
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = 0.0f;
    };
    const bool xlane = (g >> 1) == t;  // this lane's B column carries x (block t of the step)
    const u32 xpart = 128u + 64u * (u32)(g & 1), zoff = ((u32)MXQ_ZERO_ROW << 8) + xpart;
    const char* sm = reinterpret_cast<const char*>(mxs_smem);
    auto c_step = [&](int k) {
        const u32 xo = xlane ? ((u32)(128 * (ca - jr) + 4 * cs + t) << 8) + xpart : zoff;
        u32 b[16];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint4 v = *reinterpret_cast<const uint4*>(sm + xo + 16u * (u32)(q ^ t));
            b[4 * q] = v.x;
            b[4 * q + 1] = v.y;
            b[4 * q + 2] = v.z;
            b[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 x0 = mxq_word(rw[k][m][0], j >> 1), x1 = mxq_word(rw[k][m][1], j >> 1);
                const int by = 2 * (j & 1);
                mxq_mma(c4, mxq_pair(x0, lane4, by), mxq_pair(x1, lane4, by), mxq_pair(x0, lane4, by + 1),
                        mxq_pair(x1, lane4, by + 1), b[2 * j], b[2 * j + 1]);
            }
            acc[m][0] = fmaf(c4[0] + c4[1], e8m0_to_f32((u8)rs[k][m][0]), acc[m][0]);
            acc[m][1] = fmaf(c4[2] + c4[3], e8m0_to_f32((u8)rs[k][m][1]), acc[m][1]);
        }
        if (++cs == cse) {  // unit done: sum the quad's blocks, lane t stores value t
            float v = 0.0f;
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float s = acc[m][h];
                    s += __shfl_xor_sync(K3_FULL_MASK, s, 1);
                    s += __shfl_xor_sync(K3_FULL_MASK, s, 2);
                    if (t == 2 * m + h) v = s;
                }
            const int r = 16 * ctile + g + 8 * (t & 1);
            if (cok && t < 2 * NM && r < rows) emit(ca, cp, t >> 1, r, v);
            if (++cu < cend) c_enter();
        }
    };

    i64 lo = max(q0, (i64)jlo * per_a), hi = min(q1, (i64)(jlo + 2) * per_a);
    start(lo, hi);  // the first weights are in flight while the table is built
    mxs_fill_table();
    if (threadIdx.x < 8)
        reinterpret_cast<uint4*>(mxs_smem)[(MXQ_ZERO_ROW << 4) + 8 + threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
    for (; jr <= jhi; jr += 2) {
        if (jr != jlo) {
            lo = max(q0, (i64)jr * per_a);
            hi = min(q1, (i64)(jr + 2) * per_a);
            start(lo, hi);
        }
        __syncthreads();  // table written (first round); the previous round is done with the x slots
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int j = jr + s;
            const int e = j <= jhi ? __ldg(idx + j) : -1;
            if (e >= 0 && e < experts) stage(j, s);
        }
        __syncthreads();
        cu = lo;
        cend = hi;
        if (cu < cend) c_enter();
        while (cu < cend) {
#pragma unroll
            for (int k = 0; k < D; ++k) {
                if (cu >= cend) break;
                c_step(k);
                l_issue(k);
            }
        }
    }
}

// Grid (moe_stream.rs mx_stream2_plan), 256 threads, MXS_SHARED dynamic shared memory (opt-in).
// gu[a, p, 0 | 1, r] = part p of W1_e[r] . z_t | W3_e[r] . z_t for every assignment a < n_assign
// with e = idx[a] in [0, experts), t = a / top_k (others: rows left as they are). latent <= 3968.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_up_stream2_f32(const float* __restrict__ z, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                     const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ idx,
                     float* __restrict__ gu, int top_k, int latent, int inter, int experts, int n_assign, int parts) {
    const u8* wp[2] = {w1p, w3p};
    const u8* ws[2] = {w1s, w3s};
    auto stage = [&](int j, int slot) {
        const float* x = z + (i64)(j / top_k) * latent;
        mxq_stage(latent, slot, [&](int col, float* v) {
            const float4 a = *reinterpret_cast<const float4*>(x + col), b = *reinterpret_cast<const float4*>(x + col + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        });
    };
    auto emit = [&](int a, int p, int m, int r, float v) { gu[(((i64)a * parts + p) * 2 + m) * inter + r] = v; };
    mxq_drive<2, 2>(wp, ws, idx, experts, n_assign, inter, latent, parts, stage, emit);
}

// Grid from mx_stream2_plan, 256 threads, MXS_SHARED: yp[a, p, r] = part p of W2_e[r] . act[a],
// act[a] = SiTU-GLU(sum over the up kernel's parts_up of gu[a]) (built while staging). inter <= 3968.
extern "C" __global__ void __launch_bounds__(256, 2)
mxfp4_down_stream2_f32(const float* __restrict__ gu, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                       const int* __restrict__ idx, float* __restrict__ yp, int latent, int inter, float beta,
                       float beta_lin, int has_lin, int experts, int n_assign, int parts_up, int parts) {
    const u8* wp[1] = {w2p};
    const u8* ws[1] = {w2s};
    auto stage = [&](int j, int slot) {
        const float* base = gu + (i64)j * parts_up * 2 * inter;
        mxq_stage(inter, slot, [&](int col, float* v) {
            float gs[8], us[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) gs[k] = us[k] = 0.0f;
            for (int p = 0; p < parts_up; ++p) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float4 a = *reinterpret_cast<const float4*>(base + (2 * p) * (i64)inter + col + 4 * h);
                    const float4 b = *reinterpret_cast<const float4*>(base + (2 * p + 1) * (i64)inter + col + 4 * h);
                    gs[4 * h] += a.x, gs[4 * h + 1] += a.y, gs[4 * h + 2] += a.z, gs[4 * h + 3] += a.w;
                    us[4 * h] += b.x, us[4 * h + 1] += b.y, us[4 * h + 2] += b.z, us[4 * h + 3] += b.w;
                }
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = situ_glu_one(gs[k], us[k], beta, beta_lin, has_lin);
        });
    };
    auto emit = [&](int a, int p, int, int r, float v) { yp[((i64)a * parts + p) * latent + r] = v; };
    mxq_drive<1, 4>(wp, ws, idx, experts, n_assign, latent, inter, parts, stage, emit);
}

// out [T, latent] = sum over slots j (in order) with a valid id of w[t*k+j] * (sum over parts p
// in order of yp[t*k+j, p, :]) (the stream2 pair's partial rows; skipped slots add nothing).
extern "C" __global__ void moe_combine_parts_f32(const float* __restrict__ yp, const int* __restrict__ idx,
                                                 const float* __restrict__ w, float* __restrict__ out, int tokens,
                                                 int top_k, int latent, int experts, int parts) {
    const i64 n = (i64)tokens * latent;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / latent, c = i % latent;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const i64 a = t * top_k + j;
            const int e = idx[a];
            if (e < 0 || e >= experts) continue;
            float s = 0.0f;
            for (int p = 0; p < parts; ++p) s += yp[(a * parts + p) * latent + c];
            acc += w[a] * s;
        }
        out[i] = acc;
    }
}

// out [T, latent] = sum over slots j (in order) of w[t*k+j] * y[t*k+j, :].
extern "C" __global__ void moe_combine_f32(const float* __restrict__ y, const float* __restrict__ w,
                                           float* __restrict__ out, int tokens, int top_k, int latent) {
    const i64 n = (i64)tokens * latent;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / latent, c = i % latent;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) acc += w[t * top_k + j] * y[(t * top_k + j) * latent + c];
        out[i] = acc;
    }
}
