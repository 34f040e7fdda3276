// Routed experts in MXFP4 (docs/model-format.md) for 1-token decode steps.
//   moe_sort_assignments   group the T*k (token, slot) assignments by expert (counting sort; the
//                          tc2 pair of mxfp4_tc.cu and the many-assignment paths use it)
//   mxfp4_up_stream2_f32   act = SiTU-GLU(W1_e z_t, W3_e z_t) and y = W2_e act for each assignment,
//   mxfp4_down_stream2_f32 straight from the router's ids (no sort), on tensor cores: partial sums
//   moe_combine_parts_f32  per part of the row, summed by the down kernel's staging / this combine
//   moe_combine_f32        out[t] = sum_j w[t,j] y[t*k + j]   (fixed slot order: deterministic)
// Experts of a layer are stored back to back: packed [E, rows, cols/2], scales [E, rows, cols/32].
// Steps of 2 tokens and more take the tc2 pair in mxfp4_tc.cu, steps with many assignments the
// grouped GEMMs (mxfp4_grouped.cu) or the bf16 expansion for cuBLAS (moe_gemm.cu); ops.rs
// mx_experts_choice picks. H200, K3 sizes, top-16, T = 1 (with combine): stream2 141.1 us (47% of
// the weight-traffic floor); the CUDA-core pairs it replaced, a no-sort stream pair (163.7 us) and
// a staged gemv pair (182.1 us), and tc2 at one token (200.4 us) all lost; the two were deleted.
// The default one-token path is now stream2 v2 (kernels/mxfp4_stream.cu: per-warp cp.async rings,
// combine folded into the down kernel; 121.4 us, 54 %); this v1 pair runs widths that are not
// multiples of 128 and `K3_MX_STREAM2=v1`.
#include "mxfp4_mma.cuh"


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

// ---------------------------------------------------------------------------------------------
// Shared pieces of the stream2 kernels below: a 64 KB table in dynamic shared memory (opt-in),
// 256 entries of bf16x2 (the E2M1 values of a byte's two nibbles) replicated per lane (entry b of
// lane l at word 64 b + l: the address is one PRMT of the byte and 4 l, and every lane hits its own
// bank; exact: an E2M1 value fits bf16), the upper 128 bytes of each 256-byte row free for staged
// inputs; weights streamed past L1 in 16-byte loads; the work split evenly over all warps.

#define MXS_WARPS 8                    // warps per block
#define MXS_TAB_ROW 256                // bytes per table row: 32 lanes x bf16x2, then staged inputs
#define MXS_SHARED (256 * MXS_TAB_ROW) // dynamic shared memory: 64 KB (ops.rs MX_STREAM_SHARED)

extern __shared__ __align__(16) u32 mxs_smem[];

__device__ __forceinline__ void mxs_fill_table() {
    for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
        const u32 b = (u32)i >> 5;
        const u32 lo = __float_as_uint(fp4_e2m1_to_f32(b & 15u)) >> 16, hi = __float_as_uint(fp4_e2m1_to_f32(b >> 4)) >> 16;
        mxs_smem[(b << 6) | ((u32)i & 31u)] = lo | (hi << 16);
    }
}

// First unit of the flattened work space of n units owned by warp `part` of `parts`.
__device__ __forceinline__ i64 mxs_split(i64 n, i64 part, i64 parts) { return n * part / parts; }

// ---------------------------------------------------------------------------------------------
// Stream2 kernels (1-token steps; moe_stream.rs mx_stream2_plan): a no-sort work split and the
// 64 KB table above, with the multiply-adds on tensor cores. Why: a CUDA-core version (the deleted
// stream pair) spent ~3.6 issue slots per weight (per byte: PRMT + table LDS + 2 unpacks + 2
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

// bf16x2 (E2M1 of the low, high nibble) of byte `by` of `word`: entry (byte, lane) of the table.
// (On sm_90 the shared window base carries the CTA id, so each lookup is PRMT + IADD + LDS.)
__device__ __forceinline__ u32 mxq_pair(u32 word, u32 lane4, int by) {
    const u32 off = __byte_perm(word, lane4, 0x5504u + 16u * by);
    return *reinterpret_cast<const u32*>(reinterpret_cast<const char*>(mxs_smem) + off);
}


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
        split8_bf16(v, hi, lo);
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
                rw[k][m][h] = ld_stream_u4(lw[m][h] + c * 16u);
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
                const u32 x0 = mx_word(rw[k][m][0], j >> 1), x1 = mx_word(rw[k][m][1], j >> 1);
                const int by = 2 * (j & 1);
                tc_mma_bf16(c4, mxq_pair(x0, lane4, by), mxq_pair(x1, lane4, by), mxq_pair(x0, lane4, by + 1),
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
            mx_glu_parts8(base, parts_up, inter, col, beta, beta_lin, has_lin, v);
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
