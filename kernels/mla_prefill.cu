// Expanded ("compute-friendly") MLA prefill, docs/k3-model.md §4 (prefill) (host side: mla_prefill.rs).
// For one sequence with T new tokens at start_pos (keys 0..len, len = start_pos + T), after the new
// rows were appended to the pages by mla_append_rows_f32:
//   mla_prefill_gather_f32   cached rows 0..len out of the pages: c -> lat [len, kv_lora], k_r ->
//                            the rope columns of K [heads, len, qk] (shared by all heads, NoPE: unrotated)
//   (cuBLAS)                 K_nope,h = lat W_UK,h^T into K's first nope columns, V_h = lat W_UV,h^T,
//                            S_h = Q_h K_h^T * scale for a chunk of queries
//   mla_prefill_softmax_f32  causal row softmax of S in place (masked keys become exact zeros)
//   (cuBLAS)                 O_h = P_h V_h, written straight into o [T, H * v_dim]
// Every key is expanded once per call (heads * (nope + v_dim) values per key), so the long
// qk-576 / v-512 dot products of the absorbed form become qk-192 / v-128 GEMMs.
#include "common.cuh"

// One block per key row j (any block size). page_start[p] = float offset of this layer's first row
// in page p; k's head stride is len * qk (the rope part sits at columns nope .. qk of each row).
extern "C" __global__ void mla_prefill_gather_f32(const float* __restrict__ arena, const i64* __restrict__ page_start,
                                                  float* __restrict__ lat, float* __restrict__ k, int len, int heads,
                                                  int kv_lora, int rope, int qk, int page_tokens) {
    const int j = blockIdx.x;
    if (j >= len) return;
    const int row = kv_lora + rope, nope = qk - rope;
    const float* src = arena + page_start[j / page_tokens] + (i64)(j % page_tokens) * row;
    float* dst = lat + (i64)j * kv_lora;
    for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) dst[c] = src[c];
    for (int e = threadIdx.x; e < heads * rope; e += blockDim.x) {
        const int h = e / rope, r = e - h * rope;
        k[((i64)h * len + j) * qk + nope + r] = src[kv_lora + r];
    }
}

#define MLA_SM_THREADS 256
#define MLA_SM_CACHE 32  // values per thread kept in registers: rows of up to 8192 keys are read once

// One block of MLA_SM_THREADS per score row; rows = heads_in_group * tq, row r is query r % tq of
// the chunk (S_h is [tq, lk] row-major, head after head), at position q0 + r % tq, so it sees keys
// 0 .. q0 + r % tq. The scale is already in S (the GEMM's alpha). Softmax over the visible keys,
// zeros after them (the P V GEMM runs over all lk keys).
extern "C" __global__ void __launch_bounds__(MLA_SM_THREADS)
mla_prefill_softmax_f32(float* __restrict__ s, int rows, int tq, int lk, int q0) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int lim = min(lk, q0 + r % tq + 1);
    float* x = s + (i64)r * lk;
    if (lim <= MLA_SM_THREADS * MLA_SM_CACHE) {
        float v[MLA_SM_CACHE];
        float m = K3_NEG_INF;
#pragma unroll
        for (int i = 0; i < MLA_SM_CACHE; ++i) {
            const int j = threadIdx.x + i * MLA_SM_THREADS;
            v[i] = j < lim ? x[j] : K3_NEG_INF;
            m = fmaxf(m, v[i]);
        }
        m = block_max(m, scratch);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_SM_CACHE; ++i) {
            const int j = threadIdx.x + i * MLA_SM_THREADS;
            v[i] = j < lim ? expf(v[i] - m) : 0.0f;
            sum += v[i];
        }
        const float inv = 1.0f / block_sum(sum, scratch);
#pragma unroll
        for (int i = 0; i < MLA_SM_CACHE; ++i) {
            const int j = threadIdx.x + i * MLA_SM_THREADS;
            if (j < lim) x[j] = v[i] * inv;
        }
    } else {
        // Long rows: running (max, sum) per thread in one read, then one read + write.
        float m = K3_NEG_INF, sum = 0.0f;
        for (int j = threadIdx.x; j < lim; j += MLA_SM_THREADS) {
            const float xv = x[j];
            if (xv > m) {
                sum = sum * expf(m - xv) + 1.0f;
                m = xv;
            } else {
                sum += expf(xv - m);
            }
        }
        const float mb = block_max(m, scratch);
        sum = m == K3_NEG_INF ? 0.0f : sum * expf(m - mb);
        const float inv = 1.0f / block_sum(sum, scratch);
        for (int j = threadIdx.x; j < lim; j += MLA_SM_THREADS) x[j] = expf(x[j] - mb) * inv;
    }
    for (int j = lim + threadIdx.x; j < lk; j += MLA_SM_THREADS) x[j] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// bf16 mode (`--dtype bfloat16`): the QK^T, softmax and PV of one head group fused on tensor cores,
// flash-attention style, in place of the two SGEMMs and mla_prefill_softmax_f32 per query chunk:
// no score matrix in memory (it was 4 bytes per (head, query, key), written once and read three
// times), and bf16 mma.sync m16n8k16 with f32 accumulation instead of TF32 SGEMMs.
// Rounding: Q, K, V and P are rounded to bf16 (RNE) when staged; scores, the online softmax
// statistics and O stay f32; the row sums l use the rounded P, so the weights the output is
// normalised by are the ones that were applied.
//
// Block: MLA_FL_THREADS = 128 (4 warps), MLA_FL_Q = 64 queries of one head (16 per warp) against
// key blocks of MLA_FL_K = 64; grid (ceil(t / 64), heads in the group). Q's A fragments stay in
// registers for the whole key loop; each key block is staged as K and V rows [key][dim], padded
// by 8 bf16 per row so a quad's 32-bit K fragment loads and ldmatrix's eight 16-byte V rows hit
// distinct banks; V's B fragments come through ldmatrix .trans (rows are keys, P V needs pairs
// of keys per dim).
// Shapes: qk a multiple of 16 up to MLA_FL_QK_MAX, v_dim a multiple of 8 up to MLA_FL_V_MAX (K3:
// 192 and 128; k3-mini: 96 and 64); the host falls back to the SGEMM path otherwise.
//   q  [rows, heads * qk] f32 (queries row0 .. row0 + t, head h0 + blockIdx.y)
//   k  [hg, len, qk], v [hg, len, v_dim]: the expanded keys of the group as bf16 bits (rounded once
//      by bf16_split_rows_f32 with planes 1), staged with cp.async: the copies of a key block are
//      all in flight at once, instead of one global load latency per float4 a thread converts
//   o  [rows, heads * v_dim] f32
// Query i (position start + i) sees keys 0 ..= start + i.
#define MLA_FL_THREADS 128
#define MLA_FL_Q 64
#define MLA_FL_K 64
#define MLA_FL_QK_MAX 192
#define MLA_FL_V_MAX 128
#define MLA_FL_KS (MLA_FL_QK_MAX + 8)  // bf16 per staged K (and Q) row
#define MLA_FL_VS (MLA_FL_V_MAX + 8)   // bf16 per staged V row

__device__ __forceinline__ u32 mla_fl_pack(float lo, float hi) {
    return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}

__device__ __forceinline__ void mla_fl_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Issue the copies of rows [r0, r0 + 64) of a [*, cols] bf16 matrix into rows of `stride` (16-byte
// chunks; rows past `limit` zero-filled: src-size 0 reads nothing).
__device__ __forceinline__ void mla_fl_stage_rows(u16* __restrict__ dst, const u16* __restrict__ src, int r0,
                                                  int limit, int cols, int stride) {
    const int chunks = cols >> 3;
    for (int e = threadIdx.x; e < MLA_FL_K * chunks; e += MLA_FL_THREADS) {
        const int r = e / chunks, c = (e - r * chunks) << 3;
        const bool in = r0 + r < limit;
        const u16* s = src + (in ? (i64)(r0 + r) * cols + c : 0);
        const u32 d = (u32)__cvta_generic_to_shared(dst + r * stride + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(s), "r"(in ? 16 : 0) : "memory");
    }
}

// B fragments (k16 x n8) of P V for keys 16 st.. and value columns 8 n.. out of row-major V.
__device__ __forceinline__ void mla_fl_ldmatrix_trans(u32& b0, u32& b1, const u16* rows) {
    const u32 addr = (u32)__cvta_generic_to_shared(rows);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(addr));
}

extern "C" __global__ void __launch_bounds__(MLA_FL_THREADS)
mla_prefill_flash_bf16(const float* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                       float* __restrict__ o, int t, int len, int start, int heads, int h0, int row0, int qk,
                       int vd, float scale) {
    __shared__ __align__(16) u16 ks[MLA_FL_K * MLA_FL_KS];
    __shared__ __align__(16) u16 vs[MLA_FL_K * MLA_FL_VS];
    const int hh = blockIdx.y, q0 = blockIdx.x * MLA_FL_Q;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    if (qk % 16 || qk > MLA_FL_QK_MAX || vd % 8 || vd > MLA_FL_V_MAX || q0 >= t) return;
    const int ldq = heads * qk, ldo = heads * vd;
    const u16* kh = k + (i64)hh * len * qk;
    const u16* vh = v + (i64)hh * len * vd;

    // Q tile through the K buffer, then into registers: A fragments of 16 rows x qk per warp.
    {
        const int quads = qk >> 2;
        for (int e = threadIdx.x; e < MLA_FL_Q * quads; e += MLA_FL_THREADS) {
            const int r = e / quads, c = (e - r * quads) << 2;
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (q0 + r < t)
                x = *reinterpret_cast<const float4*>(q + (i64)(row0 + q0 + r) * ldq + (i64)(h0 + hh) * qk + c);
            uint2 p;
            p.x = mla_fl_pack(x.x, x.y);
            p.y = mla_fl_pack(x.z, x.w);
            *reinterpret_cast<uint2*>(ks + r * MLA_FL_KS + c) = p;
        }
    }
    __syncthreads();
    u32 qa[MLA_FL_QK_MAX / 16][4];
    const int qr = warp * 16 + g;
#pragma unroll
    for (int s = 0; s < MLA_FL_QK_MAX / 16; ++s) {
        if (s < qk / 16) {
            const u16* base = ks + s * 16 + 2 * tq;
            qa[s][0] = *reinterpret_cast<const u32*>(base + qr * MLA_FL_KS);
            qa[s][1] = *reinterpret_cast<const u32*>(base + (qr + 8) * MLA_FL_KS);
            qa[s][2] = *reinterpret_cast<const u32*>(base + qr * MLA_FL_KS + 8);
            qa[s][3] = *reinterpret_cast<const u32*>(base + (qr + 8) * MLA_FL_KS + 8);
        }
    }

    const float sl2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x log2 e)
    const int pos_a = start + q0 + qr, pos_b = pos_a + 8;  // positions of this thread's two rows
    float m_a = K3_NEG_INF, m_b = K3_NEG_INF, l_a = 0.0f, l_b = 0.0f;
    float acc[MLA_FL_V_MAX / 8][4];
#pragma unroll
    for (int n = 0; n < MLA_FL_V_MAX / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    const int keys = min(len, start + q0 + MLA_FL_Q);  // keys any query of the tile sees
    for (int k0 = 0; k0 < keys; k0 += MLA_FL_K) {
        __syncthreads();  // the previous block's (or Q's) reads of ks / vs are done
        mla_fl_stage_rows(ks, kh, k0, len, qk, MLA_FL_KS);
        mla_fl_stage_rows(vs, vh, k0, len, vd, MLA_FL_VS);
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        // S = Q K^T for this warp's 16 rows x 64 keys.
        float s[MLA_FL_K / 8][4];
#pragma unroll
        for (int n = 0; n < MLA_FL_K / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const u16* kr = ks + (n * 8 + g) * MLA_FL_KS + 2 * tq;
#pragma unroll
            for (int st = 0; st < MLA_FL_QK_MAX / 16; ++st)
                if (st < qk / 16)
                    mla_fl_mma(s[n], qa[st], *reinterpret_cast<const u32*>(kr + st * 16),
                               *reinterpret_cast<const u32*>(kr + st * 16 + 8));
        }
        // Causal mask and the online softmax (rows a = g, b = g + 8 of the warp's 16).
        float mx_a = K3_NEG_INF, mx_b = K3_NEG_INF;
#pragma unroll
        for (int n = 0; n < MLA_FL_K / 8; ++n) {
            const int key = k0 + n * 8 + 2 * tq;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                s[n][j] = key + j <= pos_a ? s[n][j] * sl2 : K3_NEG_INF;
                s[n][2 + j] = key + j <= pos_b ? s[n][2 + j] * sl2 : K3_NEG_INF;
                mx_a = fmaxf(mx_a, s[n][j]);
                mx_b = fmaxf(mx_b, s[n][2 + j]);
            }
        }
#pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
        }
        const float nm_a = fmaxf(m_a, mx_a), nm_b = fmaxf(m_b, mx_b);
        // Key 0 is in every row's first block, so nm_* is finite from the first block on.
        const float c_a = exp2f(m_a - nm_a), c_b = exp2f(m_b - nm_b);
        m_a = nm_a;
        m_b = nm_b;
        u32 pa[MLA_FL_K / 16][4];
        float rs_a = 0.0f, rs_b = 0.0f;
#pragma unroll
        for (int n = 0; n < MLA_FL_K / 8; ++n) {
            const float p0 = exp2f(s[n][0] - nm_a), p1 = exp2f(s[n][1] - nm_a);
            const float p2 = exp2f(s[n][2] - nm_b), p3 = exp2f(s[n][3] - nm_b);
            const u32 lo = mla_fl_pack(p0, p1), hi = mla_fl_pack(p2, p3);
            // The sums of the rounded values (what P V multiplies).
            rs_a += bf16_bits_to_f32((u16)(lo & 0xffffu)) + bf16_bits_to_f32((u16)(lo >> 16));
            rs_b += bf16_bits_to_f32((u16)(hi & 0xffffu)) + bf16_bits_to_f32((u16)(hi >> 16));
            // C fragment of n-tile n -> A fragment of k-step n / 2 (keys 16 (n / 2) ..).
            pa[n >> 1][(n & 1) * 2 + 0] = lo;
            pa[n >> 1][(n & 1) * 2 + 1] = hi;
        }
        l_a = l_a * c_a + rs_a;
        l_b = l_b * c_b + rs_b;
#pragma unroll
        for (int n = 0; n < MLA_FL_V_MAX / 8; ++n) {
            acc[n][0] *= c_a;
            acc[n][1] *= c_a;
            acc[n][2] *= c_b;
            acc[n][3] *= c_b;
        }
        // O += P V: k-steps of 16 keys, n-tiles of 8 value columns.
#pragma unroll
        for (int n = 0; n < MLA_FL_V_MAX / 8; ++n) {
            if (n < vd / 8) {
                // Lanes 0..15 address keys 16 st + lane (ldmatrix ignores lanes 16..31's).
                const u16* vr = vs + (lane & 15) * MLA_FL_VS + n * 8;
#pragma unroll
                for (int st = 0; st < MLA_FL_K / 16; ++st) {
                    u32 b0, b1;
                    mla_fl_ldmatrix_trans(b0, b1, vr + st * 16 * MLA_FL_VS);
                    mla_fl_mma(acc[n], pa[st], b0, b1);
                }
            }
        }
    }
    // Row sums over the quad, then O / l into o.
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
    }
    const float ia = 1.0f / l_a, ib = 1.0f / l_b;
    const int ra = q0 + qr, rb = ra + 8;
#pragma unroll
    for (int n = 0; n < MLA_FL_V_MAX / 8; ++n) {
        if (n < vd / 8) {
            const int c = (h0 + hh) * vd + n * 8 + 2 * tq;
            if (ra < t)
                *reinterpret_cast<float2*>(o + (i64)(row0 + ra) * ldo + c) = make_float2(acc[n][0] * ia, acc[n][1] * ia);
            if (rb < t)
                *reinterpret_cast<float2*>(o + (i64)(row0 + rb) * ldo + c) = make_float2(acc[n][2] * ib, acc[n][3] * ib);
        }
    }
}
