// KDA decode: one new token for each of N sequences, everything fused in one launch
// (k3-architecture.md §1.2–1.4): short conv + SiLU (and the window update), L2 norms, safe gate,
// beta, the delta-rule step on the f32 state, o = S^T q. Sequences are addressed by state-slot
// offsets into the arena, so the engine batches any set of slots without copies.
//
// kda_decode_f32 (K3_KDA_DECODE=old; the default is kda_decode_split_f32 below, same math):
// grid (H, N), 512 threads. The state tile of one (sequence, head) is 128x128 f32 = 64 KiB,
// 32 values per thread as 8 float4 (16-byte loads): lane l holds columns warp*8 + (l&1)*4 .. +3
// of rows k = i*16 + (l>>1), i < 8, so a warp instruction moves 16 rows x 32 B (whole sectors) and
// K-reductions stay inside the warp (xor 2..16). The state loads are issued before the conv/gate
// phase so their latency overlaps it (the state does not depend on phase 1; alpha is applied
// after). One block per head rather than one per 32-column slice (fla's tiling) so the conv
// window of q and k is read and rewritten by exactly one block: no cross-block race on the window.
#include "kda.cuh"

#define KDA_DECODE_THREADS 512
#define KDA_DEC_ROWS 8  // float4 rows per thread

// Sum over the 16 row groups of a warp (lanes with the same l & 1).
__device__ __forceinline__ float kda_reduce_rows16(float v) {
#pragma unroll
    for (int o = 2; o < 32; o <<= 1) v += __shfl_xor_sync(K3_FULL_MASK, v, o);
    return v;
}

// One channel's short conv for one new token x: SiLU(sum_j w[j] window[j] + w[conv-1] x), and the
// window shifted by one (also into the checkpoint copy `ckwin` when set). Unrolled to the constant
// bound so the history stays in registers (no local-memory stack).
__device__ __forceinline__ float kda_conv_step(const float* wconv, float* win, float* ckwin, float x, int conv) {
    float y = wconv[conv - 1] * x;
    float hist[KDA_MAX_CONV];
#pragma unroll
    for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
        hist[j] = j < conv - 1 ? win[j] : 0.0f;
        if (j < conv - 1) y += wconv[j] * hist[j];
    }
#pragma unroll
    for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
        if (j < conv - 1) {
            const float nv = j + 1 < conv - 1 ? hist[j + 1] : x;
            win[j] = nv;
            if (ckwin) ckwin[j] = nv;
        }
    }
    return k3_silu(y);
}

// State accesses. CS: ld/st.global.cs (evict-first): every state value is read once and written
// once per step, so it should not push the reused conv weights, windows and inputs out of L2.
template <bool CS = false>
__device__ __forceinline__ float4 kda_ld4(const float* p, bool aligned) {
    if (CS) return aligned ? __ldcs(reinterpret_cast<const float4*>(p))
                           : make_float4(__ldcs(p), __ldcs(p + 1), __ldcs(p + 2), __ldcs(p + 3));
    return aligned ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
}
template <bool CS = false>
__device__ __forceinline__ void kda_st4(float* p, float4 v, bool aligned) {
    if (CS && aligned) {
        __stcs(reinterpret_cast<float4*>(p), v);
    } else if (CS) {
        __stcs(p, v.x); __stcs(p + 1, v.y); __stcs(p + 2, v.z); __stcs(p + 3, v.w);
    } else if (aligned) {
        *reinterpret_cast<float4*>(p) = v;
    } else {
        p[0] = v.x; p[1] = v.y; p[2] = v.z; p[3] = v.w;
    }
}

// Phase 2 of both decode kernels on one thread's KDA_DEC_ROWS float4 of the state (rows
// i * 16 + kr, 4 columns; S and Sc point at those columns of row 0): decay by alpha, delta rule
// with beta against v (this thread's 4 columns at vcol), store back (and into the checkpoint Sc when
// set), then o = S^T q for the 4 columns, reduced over the warp's rows and written by lanes 0-1.
// k and q are scaled by invk / invq on the fly (1 when the caller normalised them: exact).
template <bool CS = false>
__device__ __forceinline__ void kda_decode_rows(float4 (&s)[KDA_DEC_ROWS], const float* alpha, const float* ks,
                                                const float* qs, const float* vcol, float invk, float invq,
                                                float beta, int kr, int lane, float* S, bool s_al, float* Sc,
                                                bool c_al, float* out) {
    float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) {
        const int k = i * 16 + kr;
        const float a = alpha[k], kk = ks[k] * invk;
        s[i].x *= a; s[i].y *= a; s[i].z *= a; s[i].w *= a;
        kv[0] += s[i].x * kk; kv[1] += s[i].y * kk; kv[2] += s[i].z * kk; kv[3] += s[i].w * kk;
    }
    float u[4], o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j) u[j] = beta * (vcol[j] - kda_reduce_rows16(kv[j]));
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) {
        const int k = i * 16 + kr;
        const float kk = ks[k] * invk, qq = qs[k] * invq;
        s[i].x += kk * u[0]; s[i].y += kk * u[1]; s[i].z += kk * u[2]; s[i].w += kk * u[3];
        o[0] += s[i].x * qq; o[1] += s[i].y * qq; o[2] += s[i].z * qq; o[3] += s[i].w * qq;
        kda_st4<CS>(S + k * KDA_V, s[i], s_al);
    }
    if (Sc) {
#pragma unroll
        for (int i = 0; i < KDA_DEC_ROWS; ++i) kda_st4<CS>(Sc + (i * 16 + kr) * KDA_V, s[i], c_al);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = kda_reduce_rows16(o[j]);
    if (lane < 2) *reinterpret_cast<float4*>(out) = make_float4(o[0], o[1], o[2], o[3]);
}

extern "C" __global__ void __launch_bounds__(KDA_DECODE_THREADS)
kda_decode_f32(const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
               const float* __restrict__ f_in, const float* __restrict__ b_in,
               const float* __restrict__ conv_q, const float* __restrict__ conv_k, const float* __restrict__ conv_v,
               const float* __restrict__ a_log, const float* __restrict__ dt_bias,
               float* __restrict__ arena, const i64* __restrict__ state_off, const i64* __restrict__ ckpt_off,
               float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    __shared__ float qs[KDA_K], ks[KDA_K], vs[KDA_V], alpha[KDA_K];
    __shared__ float red[8];
    __shared__ float beta_s;
    const int h = blockIdx.x, n = blockIdx.y;
    if (h >= heads || n >= n_seqs || conv < 1 || conv > KDA_MAX_CONV) return;
    const int hk = heads * KDA_K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* region = arena + state_off[n];
    float* ckpt = ckpt_off[n] >= 0 ? arena + ckpt_off[n] : nullptr;
    const i64 wf = kda_window_floats(hk, conv);
    const int v0 = warp * 8 + (lane & 1) * 4, kr = lane >> 1;
    float* S = region + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    // Slots are 4-byte aligned at the API: take the 16-byte path when the offset allows (block-uniform).
    const bool s_al = (state_off[n] & 3) == 0, c_al = (ckpt_off[n] & 3) == 0;
    float4 s[KDA_DEC_ROWS];
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) s[i] = kda_ld4(S + (i * 16 + kr) * KDA_V + v0, s_al);

    // Phase 1: threads 0-383 own one channel of q, k or v (conv + window update); 384-511 the gate.
    const int role = tid >> 7, c = tid & 127, ch = h * KDA_K + c;
    if (role < 3) {
        const float* in = role == 0 ? q_in : role == 1 ? k_in : v_in;
        const float* wconv = (role == 0 ? conv_q : role == 1 ? conv_k : conv_v) + (i64)ch * conv;
        const i64 w0 = role * wf + (i64)ch * (conv - 1);
        const float y = kda_conv_step(wconv, region + w0, ckpt ? ckpt + w0 : nullptr, in[(i64)n * hk + ch], conv);
        (role == 0 ? qs : role == 1 ? ks : vs)[c] = y;
        if (role < 2) {  // L2 norm partial sums of q (warps 0-3) and k (warps 4-7)
            const float ss = warp_sum(y * y);
            if (lane == 0) red[warp] = ss;
        }
    } else {
        alpha[c] = expf(kda_gate(f_in[(i64)n * hk + ch], dt_bias[ch], expf(a_log[h]), lower_bound));
        if (c == 0) beta_s = k3_sigmoid(b_in[(i64)n * heads + h]);
    }
    __syncthreads();
    if (tid < 2 * KDA_K) {
        const int base = tid < KDA_K ? 0 : 4;
        const float ss = red[base] + red[base + 1] + red[base + 2] + red[base + 3];
        // q also carries the K^-1/2 attention scale.
        const float inv = (tid < KDA_K ? rsqrtf((float)KDA_K) : 1.0f) / sqrtf(ss + 1e-6f);
        if (tid < KDA_K) qs[c] *= inv; else ks[c] *= inv;
    }
    __syncthreads();

    // Phase 2: the delta rule on this thread's 32 state values (columns v0..v0+3, rows i*16 + kr);
    // q and k are normalised already (scales 1).
    kda_decode_rows(s, alpha, ks, qs, vs + v0, 1.0f, 1.0f, beta_s, kr, lane, S + v0, s_al,
                    ckpt ? ckpt + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V + v0 : nullptr, c_al,
                    o_out + (i64)n * hk + h * KDA_V + v0);
}

// ---------------------------------------------------------------------------------------------
// Split variant, the default (H200, N = 256: 1090.7 us = 69% of the DRAM floor, vs 1186.2 for the
// kernel above, which K3_KDA_DECODE=old still picks; a two-kernel prep + streaming-state variant
// measured 1138-1727 and was dropped): the state tile of one
// (sequence, head) is cut into KDA_SPLIT column slices of 32, one 128-thread block each, the
// slices of one head forming a thread-block cluster. Small blocks keep 8 per SM at different
// phases (one loading while another stores) and fill all 132 SMs at N = 1, where the 512-thread
// kernel used 96. The window race is avoided by ownership, not ordering: block r of the cluster
// convolves (and rewrites the windows of) q, k and v channels r*32..r*32+31 and the gate of those
// key rows, then pushes its q, k, alpha slices and its two L2 partial sums into the other blocks
// of the cluster with st.async (plain stores into itself), counted by one mbarrier per block: no
// cluster-scope release fence, which compiles to MEMBAR.GPU and would stall on the outstanding
// state loads. A block exits only after receiving everything, so nobody writes into a finished
// block and no exit barrier is needed.
// Same math and per-warp state layout as the kernel above (lane l of warp w: columns
// r*32 + w*8 + (l&1)*4 .. +3 of rows i*16 + (l>>1)); the L2 sums add the same four 32-channel
// partials in the same order and q, k are scaled by the same factors: bit-identical results.
#define KDA_SPLIT 4
#define KDA_SPLIT_COLS (KDA_V / KDA_SPLIT)
#define KDA_SPLIT_THREADS 128
// Bytes each block receives: from each other block, 32 q + 32 k + 32 alpha + 2 partial sums
// (its own slices it stores directly, ordered by the __syncthreads before the wait).
#define KDA_SPLIT_TX_BYTES ((KDA_SPLIT - 1) * (3 * KDA_SPLIT_COLS + 2) * 4)

__device__ __forceinline__ u32 kda_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 kda_smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// Store `v` at shared address `addr` (of this block) in block `rank`, completing 4 bytes of the
// transaction count of that block's mbarrier at `bar` (same offset in every block).
__device__ __forceinline__ void kda_push(u32 addr, float v, u32 bar, u32 rank) {
    u32 ra, rb;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(addr), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(bar), "r"(rank));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(ra), "r"(__float_as_uint(v)), "r"(rb) : "memory");
}

// Phase 2 of the "lines" layout (kda_decode_lines_f32): lane l of warp w holds columns
// 4 (l & 7) .. +3 of the block's 32 and rows i * 16 + w * 4 + (l >> 3), so one warp instruction
// moves 4 whole 128-byte lines (4 L2 requests) where the split layout moves 16 32-byte sectors of
// 16 lines (16 requests). The K reductions then cross warps: 2 shuffles + a [4][32] shared-memory
// sum each (two __syncthreads), the 4 warps added in a fixed order.
template <bool CS>
__device__ __forceinline__ void kda_decode_lines_rows(float4 (&s)[KDA_DEC_ROWS], const float* alpha, const float* ks,
                                                      const float* qs, const float* vcol, float invk, float invq,
                                                      float beta, int kr, int warp, int lane, float* S, bool s_al,
                                                      float* Sc, bool c_al, float* out, float (*red_kv)[KDA_SPLIT_COLS],
                                                      float (*red_o)[KDA_SPLIT_COLS]) {
    const int cq = 4 * (lane & 7);
    float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) {
        const int k = i * 16 + kr;
        const float a = alpha[k], kk = ks[k] * invk;
        s[i].x *= a; s[i].y *= a; s[i].z *= a; s[i].w *= a;
        kv[0] += s[i].x * kk; kv[1] += s[i].y * kk; kv[2] += s[i].z * kk; kv[3] += s[i].w * kk;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        kv[j] += __shfl_xor_sync(K3_FULL_MASK, kv[j], 8);
        kv[j] += __shfl_xor_sync(K3_FULL_MASK, kv[j], 16);
    }
    if (lane < 8) *reinterpret_cast<float4*>(&red_kv[warp][cq]) = make_float4(kv[0], kv[1], kv[2], kv[3]);
    __syncthreads();
    float u[4], o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int v = cq + j;
        u[j] = beta * (vcol[v] - (((red_kv[0][v] + red_kv[1][v]) + red_kv[2][v]) + red_kv[3][v]));
    }
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) {
        const int k = i * 16 + kr;
        const float kk = ks[k] * invk, qq = qs[k] * invq;
        s[i].x += kk * u[0]; s[i].y += kk * u[1]; s[i].z += kk * u[2]; s[i].w += kk * u[3];
        o[0] += s[i].x * qq; o[1] += s[i].y * qq; o[2] += s[i].z * qq; o[3] += s[i].w * qq;
        kda_st4<CS>(S + k * KDA_V + cq, s[i], s_al);
    }
    if (Sc) {
#pragma unroll
        for (int i = 0; i < KDA_DEC_ROWS; ++i) kda_st4<CS>(Sc + (i * 16 + kr) * KDA_V + cq, s[i], c_al);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        o[j] += __shfl_xor_sync(K3_FULL_MASK, o[j], 8);
        o[j] += __shfl_xor_sync(K3_FULL_MASK, o[j], 16);
    }
    if (lane < 8) *reinterpret_cast<float4*>(&red_o[warp][cq]) = make_float4(o[0], o[1], o[2], o[3]);
    __syncthreads();
    if (warp == 0 && lane < 8) {
        float r4[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int v = cq + j;
            r4[j] = ((red_o[0][v] + red_o[1][v]) + red_o[2][v]) + red_o[3][v];
        }
        *reinterpret_cast<float4*>(out + cq) = make_float4(r4[0], r4[1], r4[2], r4[3]);
    }
}

// The split kernels: LINES picks the state layout of phase 2 (kda_decode_rows or
// kda_decode_lines_rows), CS the evict-first state accesses. Phase 1 is the same for all.
template <bool LINES, bool CS>
__device__ __forceinline__ void kda_decode_split_impl(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    // qs/ks/alpha/ssp are filled by the cluster's pushes (q and k before normalisation; ssp[2b],
    // ssp[2b+1]: block b's sums of q^2 and k^2); vs and beta_s are this block's own.
    __shared__ float qs[KDA_K], ks[KDA_K], alpha[KDA_K], ssp[2 * KDA_SPLIT], vs[KDA_SPLIT_COLS];
    __shared__ float beta_s;
    __shared__ __align__(8) unsigned long long bar;
    __shared__ __align__(16) float red_kv[LINES ? 4 : 1][KDA_SPLIT_COLS];  // lines only
    __shared__ __align__(16) float red_o[LINES ? 4 : 1][KDA_SPLIT_COLS];
    const u32 r = kda_cluster_rank();
    const int h = blockIdx.x / KDA_SPLIT, n = blockIdx.y;
    // Uniform over the cluster (same h and n), so no block skips the cluster barrier alone.
    if (h >= heads || n >= n_seqs || conv < 1 || conv > KDA_MAX_CONV) return;
    const int hk = heads * KDA_K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 bar_a = kda_smem_addr(&bar);
    if (tid == 0) {  // one arrival (this one) plus the bytes of every push
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_a) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar_a), "r"(KDA_SPLIT_TX_BYTES) : "memory");
    }
    // Nobody pushes before every block's mbarrier is initialised (the wait is just before the pushes).
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    float* region = arena + state_off[n];
    float* ckpt = ckpt_off[n] >= 0 ? arena + ckpt_off[n] : nullptr;
    const i64 wf = kda_window_floats(hk, conv);
    // The thread's 4 columns (vl in the block's slice, v0 in the head) and its row offset kr.
    const int vl = LINES ? 4 * (lane & 7) : warp * 8 + (lane & 1) * 4, v0 = (int)r * KDA_SPLIT_COLS + vl;
    const int kr = LINES ? warp * 4 + (lane >> 3) : lane >> 1;
    float* S = region + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    const bool s_al = (state_off[n] & 3) == 0, c_al = (ckpt_off[n] & 3) == 0;
    float4 s[KDA_DEC_ROWS];
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) s[i] = kda_ld4<CS>(S + (i * 16 + kr) * KDA_V + v0, s_al);

    // Phase 1: warp 0/1/2 convolve channel r*32 + lane of q/k/v (and update its window), warp 3
    // computes the gate of key row r*32 + lane.
    const int c = (int)r * KDA_SPLIT_COLS + lane, ch = h * KDA_K + c;
    float y, ss = 0.0f;
    if (warp < 3) {
        const float* in = warp == 0 ? q_in : warp == 1 ? k_in : v_in;
        const float* wconv = (warp == 0 ? conv_q : warp == 1 ? conv_k : conv_v) + (i64)ch * conv;
        const i64 w0 = warp * wf + (i64)ch * (conv - 1);
        y = kda_conv_step(wconv, region + w0, ckpt ? ckpt + w0 : nullptr, in[(i64)n * hk + ch], conv);
        if (warp == 2) vs[lane] = y;
        else ss = warp_sum(y * y);
    } else {
        y = expf(kda_gate(f_in[(i64)n * hk + ch], dt_bias[ch], expf(a_log[h]), lower_bound));
        if (lane == 0) beta_s = k3_sigmoid(b_in[(i64)n * heads + h]);
    }
    __syncwarp();  // the .aligned cluster barrier wants converged warps
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    if (warp != 2) {
        float* dst = warp == 0 ? &qs[c] : warp == 1 ? &ks[c] : &alpha[c];
        float* dss = &ssp[2 * r + (warp & 1)];  // used by warps 0 and 1
        *dst = y;
        if (warp < 2 && lane == 0) *dss = ss;
#pragma unroll
        for (u32 b = 1; b < KDA_SPLIT; ++b) {
            const u32 to = (r + b) % KDA_SPLIT;
            kda_push(kda_smem_addr(dst), y, bar_a, to);
            if (warp < 2 && lane == 0) kda_push(kda_smem_addr(dss), ss, bar_a, to);
        }
    }
    __syncthreads();  // vs, beta_s and this block's own slices
    asm volatile("{\n\t.reg .pred done;\n"
                 "KDA_WAIT_%=:\n\t"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n\t"
                 "@!done bra KDA_WAIT_%=;\n\t}" :: "r"(bar_a) : "memory");
    // Same expressions (and order) as kda_decode_f32's normalisation.
    const float invq = rsqrtf((float)KDA_K) / sqrtf(ssp[0] + ssp[2] + ssp[4] + ssp[6] + 1e-6f);
    const float invk = 1.0f / sqrtf(ssp[1] + ssp[3] + ssp[5] + ssp[7] + 1e-6f);

    // Phase 2: as in kda_decode_f32, on this block's 32 columns.
    float* Sc = ckpt ? ckpt + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V : nullptr;
    if (LINES) {
        const int c0 = (int)r * KDA_SPLIT_COLS;  // the slice's first column
        kda_decode_lines_rows<CS>(s, alpha, ks, qs, vs, invk, invq, beta_s, kr, warp, lane, S + c0, s_al,
                                  Sc ? Sc + c0 : nullptr, c_al, o_out + (i64)n * hk + h * KDA_V + c0, red_kv, red_o);
    } else {
        kda_decode_rows<CS>(s, alpha, ks, qs, vs + vl, invk, invq, beta_s, kr, lane, S + v0, s_al,
                            Sc ? Sc + v0 : nullptr, c_al, o_out + (i64)n * hk + h * KDA_V + v0);
    }
}

// K3_KDA_DECODE=split (default).
extern "C" __global__ void __cluster_dims__(KDA_SPLIT, 1, 1) __launch_bounds__(KDA_SPLIT_THREADS)
kda_decode_split_f32(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    kda_decode_split_impl<false, false>(q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, arena,
                                       state_off, ckpt_off, o_out, n_seqs, heads, conv, lower_bound);
}
// K3_KDA_DECODE=split_cs: the same with evict-first state loads and stores.
extern "C" __global__ void __cluster_dims__(KDA_SPLIT, 1, 1) __launch_bounds__(KDA_SPLIT_THREADS)
kda_decode_split_cs_f32(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    kda_decode_split_impl<false, true>(q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, arena,
                                       state_off, ckpt_off, o_out, n_seqs, heads, conv, lower_bound);
}
// K3_KDA_DECODE=lines: whole 128-byte lines per warp instruction, evict-first state accesses.
extern "C" __global__ void __cluster_dims__(KDA_SPLIT, 1, 1) __launch_bounds__(KDA_SPLIT_THREADS)
kda_decode_lines_f32(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    kda_decode_split_impl<true, true>(q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, arena,
                                       state_off, ckpt_off, o_out, n_seqs, heads, conv, lower_bound);
}
