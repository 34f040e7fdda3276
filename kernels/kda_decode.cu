// KDA decode: one new token for each of N sequences, everything fused in one launch
// (docs/k3-model.md §3: inputs, recurrence, decode state): short conv + SiLU (and the window update), L2 norms, safe gate,
// beta, the delta-rule step on the f32 state, o = S^T q. Sequences are addressed by state-slot
// offsets into the arena, so the engine batches any set of slots without copies.
//
// kda_decode_lines_f32, the only decode kernel (about fla's fused_recurrent_kda speed, at half
// the DRAM floor or better; it beats a 512-thread block per head, and the same cluster with a
// 16-row x 32-byte state layout with and without evict-first accesses, at every N, so those were
// deleted): the state tile of one (sequence, head) is cut into
// KDA_SPLIT column slices of 32, one 128-thread block each, the slices of one head forming a
// thread-block cluster. Small blocks keep 8 per SM at different phases (one loading while another
// stores) and fill all 132 SMs at N = 1. The window race is avoided by ownership, not ordering:
// block r of the cluster convolves (and rewrites the windows of) q, k and v channels r*32..r*32+31
// and the gate of those key rows, then pushes its q, k, alpha slices and its two L2 partial sums
// into the other blocks of the cluster with st.async (plain stores into itself), counted by one
// mbarrier per block: no cluster-scope release fence, which compiles to MEMBAR.GPU and would stall
// on the outstanding state loads. A block exits only after receiving everything, so nobody writes
// into a finished block and no exit barrier is needed. The state loads are issued before the
// conv/gate phase so their latency overlaps it (the state does not depend on phase 1).
//
// ReplaySSM for speculative decoding (docs/speculative-decoding.md, "ReplaySSM on CUDA") reuses
// this body (kda_lines) rather than copying it. kda_verify_lines_f32 steps a sequence's T tokens
// through the same conv, gate, norm and delta-rule code, the state held in registers and never
// stored, and writes each step's record; it also decodes the one-token sequences of a mixed batch.
// kda_commit_lines_f32 replays an accepted prefix through the same state half of the step. Verify
// outputs and committed states are therefore the decode kernel's, bit for bit.
#include "kda.cuh"


// One channel's short conv for one new input x: SiLU(sum_j w[j] hist[j] + w[conv-1] x), with the
// window `hist` (oldest first, conv-1 taps used) shifted by one in registers. Unrolled to the
// constant bound so the history stays in registers (no local-memory stack). Decode and verify both
// convolve through this, so a verified token's conv output is the decoded one's, bit for bit.
__device__ __forceinline__ float kda_conv_reg(const float* wconv, float (&hist)[KDA_MAX_CONV - 1], float x, int conv) {
    float y = wconv[conv - 1] * x;
#pragma unroll
    for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
        if (j < conv - 1) y += wconv[j] * hist[j];
    }
#pragma unroll
    for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
        if (j < conv - 1) hist[j] = j + 1 < conv - 1 ? hist[j + 1] : x;
    }
    return k3_silu(y);
}

__device__ __forceinline__ void kda_window_load(float (&hist)[KDA_MAX_CONV - 1], const float* win, int conv) {
#pragma unroll
    for (int j = 0; j < KDA_MAX_CONV - 1; ++j) hist[j] = j < conv - 1 ? win[j] : 0.0f;
}

__device__ __forceinline__ void kda_window_store(const float (&hist)[KDA_MAX_CONV - 1], float* win, int conv) {
#pragma unroll
    for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
        if (j < conv - 1) win[j] = hist[j];
    }
}

// One decode token of one channel: the conv of x over the window in the arena, which is shifted in
// place (and also written to the checkpoint copy `ckwin` when set).
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

// State accesses, ld/st.global.cs (evict-first): every state value is read once and written once
// per step, so it should not push the reused conv weights, windows and inputs out of L2. Slots
// are only 4-byte aligned at the API: the 16-byte path when the offset allows (block-uniform).
__device__ __forceinline__ float4 kda_ld4(const float* p, bool aligned) {
    return aligned ? __ldcs(reinterpret_cast<const float4*>(p))
                   : make_float4(__ldcs(p), __ldcs(p + 1), __ldcs(p + 2), __ldcs(p + 3));
}
__device__ __forceinline__ void kda_st4(float* p, float4 v, bool aligned) {
    if (aligned) {
        __stcs(reinterpret_cast<float4*>(p), v);
    } else {
        __stcs(p, v.x); __stcs(p + 1, v.y); __stcs(p + 2, v.z); __stcs(p + 3, v.w);
    }
}

#define KDA_DEC_ROWS 8  // float4 rows per thread
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

// Lanes l, l ^ 8, l ^ 16, l ^ 24 hold the same 4 columns for different state rows: sum them.
__device__ __forceinline__ void kda_sum_row_groups(float (&v)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] += __shfl_xor_sync(K3_FULL_MASK, v[j], 8);
        v[j] += __shfl_xor_sync(K3_FULL_MASK, v[j], 16);
    }
}

// ReplaySSM record of one verified block of T tokens of one layer (f32, offsets in floats from
// the record's start; docs/speculative-decoding.md, "ReplaySSM on CUDA"):
//   per head h and token t, at (h*T + t)*KDA_REC_HEAD: k̂[K] (the normalised key exactly as the
//   delta rule multiplies by it), v[V] (after conv + SiLU), alpha[K] = exp(g) (the decay factor
//   of each key row, as the decode step applies it), beta;
//   then, at kda_rec_pre_base(T, H), the pre-conv q, k, v inputs [3][T][H*K] (they roll the windows).
// T * (H*(3K+1) + 3*H*K) floats in all (KdaGeom::record_floats_per_token per token). Storing the
// values the recurrence consumes, not its inputs, makes the replay the decode step's state half.
#define KDA_REC_HEAD (2 * KDA_K + KDA_V + 1)
__device__ __forceinline__ i64 kda_rec_pre_base(int tokens, int heads) { return (i64)tokens * heads * KDA_REC_HEAD; }

// Phase 2 on one thread's KDA_DEC_ROWS float4 of the state: decay by alpha, delta rule with beta
// against v, store back when STORE (and into the checkpoint Sc when set), then o = S^T q when OUT,
// k and q scaled by invk / invq on the fly. Lane l of warp w holds columns 4 (l & 7) .. +3 of the
// block's 32 and rows i * 16 + w * 4 + (l >> 3), so one warp instruction moves 4 whole 128-byte
// lines (4 L2 requests; a 16-row x 32-byte layout needed 16 and was slower at every N). The K
// reductions then cross warps: 2 shuffles + a [4][32] shared-memory sum each (two __syncthreads),
// the 4 warps added in a fixed order. Decode (STORE, OUT), verify (OUT: the state stays in
// registers) and the ReplaySSM commit (neither; invk = 1 on recorded k̂, an exact product) all run
// this one step, so a replayed state is the decoded one bit for bit.
template <bool STORE, bool OUT>
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
    kda_sum_row_groups(kv);
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
        const float kk = ks[k] * invk, qq = OUT ? qs[k] * invq : 0.0f;
        s[i].x += kk * u[0]; s[i].y += kk * u[1]; s[i].z += kk * u[2]; s[i].w += kk * u[3];
        if constexpr (OUT) {
            o[0] += s[i].x * qq; o[1] += s[i].y * qq; o[2] += s[i].z * qq; o[3] += s[i].w * qq;
        }
        if constexpr (STORE) kda_st4(S + k * KDA_V + cq, s[i], s_al);
    }
    if constexpr (STORE) {
        if (Sc) {
#pragma unroll
            for (int i = 0; i < KDA_DEC_ROWS; ++i) kda_st4(Sc + (i * 16 + kr) * KDA_V + cq, s[i], c_al);
        }
    }
    if constexpr (OUT) {
        kda_sum_row_groups(o);
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
}

// The fused step of kda_decode_lines_f32 (MULTI = false: one token per sequence, sequence n's
// inputs and output are row n, the state and windows are updated in place) and of
// kda_verify_lines_f32 (MULTI = true: sequence n has seq_tokens[n] tokens from row seq_row[n],
// stepped one after another with the state in registers and the windows in the conv threads'
// registers; rec_off[n] >= 0 makes it a speculative verify, which reads the state and windows,
// never writes them nor the checkpoint, and writes the ReplaySSM record at rec_off[n];
// rec_off[n] < 0 is a plain decode, which writes the state, windows and checkpoint after its last
// token). Every token goes through the same conv, gate, norm and delta-rule code in the same
// order, so a verify's outputs are those of decoding its tokens one at a time, bit for bit.
template <bool MULTI>
__device__ __forceinline__ void kda_lines(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, const i64* __restrict__ rec_off, const int* __restrict__ seq_row,
    const int* __restrict__ seq_tokens, float* __restrict__ o_out, int n_seqs, int heads, int conv,
    float lower_bound) {
    // qs/ks/alpha/ssp are filled by the cluster's pushes (q and k before normalisation; ssp[2b],
    // ssp[2b+1]: block b's sums of q^2 and k^2); vs and beta_s are this block's own.
    __shared__ float qs[KDA_K], ks[KDA_K], alpha[KDA_K], ssp[2 * KDA_SPLIT], vs[KDA_SPLIT_COLS];
    __shared__ float beta_s;
    __shared__ __align__(8) unsigned long long bar;
    __shared__ __align__(16) float red_kv[4][KDA_SPLIT_COLS];  // phase 2's cross-warp K sums
    __shared__ __align__(16) float red_o[4][KDA_SPLIT_COLS];
    const u32 r = kda_cluster_rank();
    const int h = blockIdx.x / KDA_SPLIT, n = blockIdx.y;
    // Uniform over the cluster (same h and n), so no block skips the cluster barrier alone.
    if (h >= heads || n >= n_seqs || conv < 1 || conv > KDA_MAX_CONV) return;
    const int tokens = MULTI ? seq_tokens[n] : 1;
    if (tokens < 1) return;
    const i64 row0 = MULTI ? (i64)seq_row[n] : (i64)n;
    const bool verify = MULTI && rec_off[n] >= 0;
    const int hk = heads * KDA_K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 bar_a = kda_smem_addr(&bar);
    if (tid == 0) {  // one arrival (this one) plus the bytes of every push
        mbar_init(bar_a, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        mbar_arrive_expect_tx(bar_a, KDA_SPLIT_TX_BYTES);
    }
    // Nobody pushes before every block's mbarrier is initialised (the wait is just before the pushes).
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    float* region = arena + state_off[n];
    float* ckpt = !verify && ckpt_off[n] >= 0 ? arena + ckpt_off[n] : nullptr;
    float* rec = verify ? arena + rec_off[n] : nullptr;
    const i64 wf = kda_window_floats(hk, conv);
    // The thread's first column in the head and its row offset kr (rows i * 16 + kr).
    const int v0 = (int)r * KDA_SPLIT_COLS + 4 * (lane & 7), kr = warp * 4 + (lane >> 3);
    float* S = region + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    const bool s_al = (state_off[n] & 3) == 0, c_al = (ckpt_off[n] & 3) == 0;
    float4 s[KDA_DEC_ROWS];
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) s[i] = kda_ld4(S + (i * 16 + kr) * KDA_V + v0, s_al);

    // Phase 1 (per token): warp 0/1/2 convolve channel r*32 + lane of q/k/v (and shift its
    // window), warp 3 computes the gate of key row r*32 + lane.
    const int c = (int)r * KDA_SPLIT_COLS + lane, ch = h * KDA_K + c;
    float hist[KDA_MAX_CONV - 1];  // MULTI: the window, carried across the tokens
    if (MULTI && warp < 3) kda_window_load(hist, region + warp * wf + (i64)ch * (conv - 1), conv);
    for (int t = 0; t < tokens; ++t) {
        const i64 row = row0 + t;
        float y, ss = 0.0f;
        if (warp < 3) {
            const float* in = warp == 0 ? q_in : warp == 1 ? k_in : v_in;
            const float* wconv = (warp == 0 ? conv_q : warp == 1 ? conv_k : conv_v) + (i64)ch * conv;
            const i64 w0 = warp * wf + (i64)ch * (conv - 1);
            const float x = in[row * hk + ch];
            if (MULTI) {
                y = kda_conv_reg(wconv, hist, x, conv);
                if (verify) rec[kda_rec_pre_base(tokens, heads) + ((i64)warp * tokens + t) * hk + ch] = x;
            } else {
                y = kda_conv_step(wconv, region + w0, ckpt ? ckpt + w0 : nullptr, x, conv);
            }
            if (warp == 2) vs[lane] = y;
            else ss = warp_sum(y * y);
        } else {
            y = expf(kda_gate(f_in[row * hk + ch], dt_bias[ch], expf(a_log[h]), lower_bound));
            if (lane == 0) beta_s = k3_sigmoid(b_in[row * heads + h]);
        }
        if (MULTI && t > 0) {
            // Arm this token's phase of the mbarrier before anyone may push into it, and let no
            // block push before every block has finished reading the last token's pushes (the
            // arrive releases those reads, the wait below acquires them).
            if (tid == 0) {
                mbar_arrive_expect_tx(bar_a, KDA_SPLIT_TX_BYTES);
            }
            __syncwarp();
            asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
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
        mbar_wait_cluster(bar_a, MULTI ? (u32)t & 1u : 0u);  // phase t of the mbarrier
        // q also carries the K^-1/2 attention scale; the four partials added in a fixed order.
        const float invq = rsqrtf((float)KDA_K) / sqrtf(ssp[0] + ssp[2] + ssp[4] + ssp[6] + 1e-6f);
        const float invk = 1.0f / sqrtf(ssp[1] + ssp[3] + ssp[5] + ssp[7] + 1e-6f);
        if (verify) {  // this block's channels of the token's record (ks[c] == y: the same k̂ bits)
            float* hr = rec + ((i64)h * tokens + t) * KDA_REC_HEAD;
            if (warp == 1) hr[c] = y * invk;
            else if (warp == 2) hr[KDA_K + c] = y;
            else if (warp == 3) {
                hr[KDA_K + KDA_V + c] = y;
                if (r == 0 && lane == 0) hr[2 * KDA_K + KDA_V] = beta_s;
            }
        }

        // Phase 2: the delta rule on this block's 32 columns.
        float* Sc = ckpt ? ckpt + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V : nullptr;
        const int c0 = (int)r * KDA_SPLIT_COLS;  // the slice's first column
        float* out = o_out + row * hk + h * KDA_V + c0;
        if constexpr (MULTI) {
            kda_decode_lines_rows<false, true>(s, alpha, ks, qs, vs, invk, invq, beta_s, kr, warp, lane, nullptr,
                                               false, nullptr, false, out, red_kv, red_o);
        } else {
            kda_decode_lines_rows<true, true>(s, alpha, ks, qs, vs, invk, invq, beta_s, kr, warp, lane, S + c0,
                                              s_al, Sc ? Sc + c0 : nullptr, c_al, out, red_kv, red_o);
        }
    }
    if (MULTI && !verify) {  // a plain decode: the state, windows and checkpoint after its last token
        float* Sc = ckpt ? ckpt + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V : nullptr;
#pragma unroll
        for (int i = 0; i < KDA_DEC_ROWS; ++i) {
            kda_st4(S + (i * 16 + kr) * KDA_V + v0, s[i], s_al);
            if (Sc) kda_st4(Sc + (i * 16 + kr) * KDA_V + v0, s[i], c_al);
        }
        if (warp < 3) {
            const i64 w0 = warp * wf + (i64)ch * (conv - 1);
            kda_window_store(hist, region + w0, conv);
            if (ckpt) kda_window_store(hist, ckpt + w0, conv);
        }
    }
}

extern "C" __global__ void __cluster_dims__(KDA_SPLIT, 1, 1) __launch_bounds__(KDA_SPLIT_THREADS)
kda_decode_lines_f32(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, float* __restrict__ o_out, int n_seqs, int heads, int conv, float lower_bound) {
    kda_lines<false>(q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, arena, state_off,
                     ckpt_off, nullptr, nullptr, nullptr, o_out, n_seqs, heads, conv, lower_bound);
}

// Speculative verify (ReplaySSM) of any number of sequences in one launch, mixed with plain
// one-token decodes (see kda_lines): the grid and cluster of kda_decode_lines_f32; inputs and o
// are the step's stacked rows, addressed per sequence by seq_row, so a batch of verifying and
// non-verifying sequences needs no gather or scatter copies.
extern "C" __global__ void __cluster_dims__(KDA_SPLIT, 1, 1) __launch_bounds__(KDA_SPLIT_THREADS)
kda_verify_lines_f32(
    const float* __restrict__ q_in, const float* __restrict__ k_in, const float* __restrict__ v_in,
    const float* __restrict__ f_in, const float* __restrict__ b_in, const float* __restrict__ conv_q,
    const float* __restrict__ conv_k, const float* __restrict__ conv_v, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ arena, const i64* __restrict__ state_off,
    const i64* __restrict__ ckpt_off, const i64* __restrict__ rec_off, const int* __restrict__ seq_row,
    const int* __restrict__ seq_tokens, float* __restrict__ o_out, int n_seqs, int heads, int conv,
    float lower_bound) {
    kda_lines<true>(q_in, k_in, v_in, f_in, b_in, conv_q, conv_k, conv_v, a_log, dt_bias, arena, state_off,
                    ckpt_off, rec_off, seq_row, seq_tokens, o_out, n_seqs, heads, conv, lower_bound);
}

// ReplaySSM commit of any number of verified blocks in one launch: block (h * 4 + r, n) replays
// the first accepted[n] of the rec_tokens[n] recorded steps of commit n into columns r*32.. of
// head h of the state at state_off[n], in place, through the decode step's own state half
// (kda_decode_lines_rows, the same thread tile and reduction order), and rolls the q, k, v conv
// windows of channels r*32.. to end at the last accepted token. The blocks of a head need nothing
// from each other (the record holds the normalised keys, decays, values and beta), so no cluster.
// accepted[n] == 0 leaves commit n untouched.
extern "C" __global__ void __launch_bounds__(KDA_SPLIT_THREADS)
kda_commit_lines_f32(float* __restrict__ arena, const i64* __restrict__ state_off, const i64* __restrict__ rec_off,
                     const int* __restrict__ rec_tokens, const int* __restrict__ accepted, int n_commits, int heads,
                     int conv) {
    __shared__ float ks[KDA_K], alpha[KDA_K], vs[KDA_SPLIT_COLS];
    __shared__ float beta_s;
    __shared__ __align__(16) float red_kv[4][KDA_SPLIT_COLS];
    const int r = blockIdx.x % KDA_SPLIT, h = blockIdx.x / KDA_SPLIT, n = blockIdx.y;
    if (h >= heads || n >= n_commits || conv < 1 || conv > KDA_MAX_CONV) return;
    const int tokens = rec_tokens[n], acc = accepted[n];
    if (acc < 1 || acc > tokens) return;  // the launcher checks 0 <= accepted <= tokens
    const int hk = heads * KDA_K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* region = arena + state_off[n];
    const float* rec = arena + rec_off[n];
    const i64 wf = kda_window_floats(hk, conv);
    const int c0 = r * KDA_SPLIT_COLS, v0 = c0 + 4 * (lane & 7), kr = warp * 4 + (lane >> 3);
    float* S = region + kda_state_base(hk, conv) + (i64)h * KDA_K * KDA_V;
    const bool s_al = (state_off[n] & 3) == 0;
    float4 s[KDA_DEC_ROWS];
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) s[i] = kda_ld4(S + (i * 16 + kr) * KDA_V + v0, s_al);

    // The windows: the last conv-1 of (window ++ the first acc pre-conv inputs), channel c0 + lane
    // of q (warp 0), k (1), v (2).
    if (warp < 3) {
        const int ch = h * KDA_K + c0 + lane;
        float* win = region + warp * wf + (i64)ch * (conv - 1);
        const float* pre = rec + kda_rec_pre_base(tokens, heads) + (i64)warp * tokens * hk + ch;
        float old[KDA_MAX_CONV - 1];
        kda_window_load(old, win, conv);
#pragma unroll
        for (int j = 0; j < KDA_MAX_CONV - 1; ++j) {
            if (j < conv - 1) {
                const int e = acc + j;  // index into window ++ inputs
                float nv = 0.0f;
                if (e < conv - 1) {
#pragma unroll
                    for (int m = 0; m < KDA_MAX_CONV - 1; ++m) nv = m == e ? old[m] : nv;  // no local memory
                } else {
                    nv = pre[(i64)(e - (conv - 1)) * hk];
                }
                win[j] = nv;
            }
        }
    }

    const float* hrec = rec + (i64)h * tokens * KDA_REC_HEAD;
    for (int t = 0; t < acc; ++t) {
        const float* st = hrec + (i64)t * KDA_REC_HEAD;
        ks[tid] = st[tid];
        alpha[tid] = st[KDA_K + KDA_V + tid];
        if (tid < KDA_SPLIT_COLS) vs[tid] = st[KDA_K + c0 + tid];
        if (tid == 0) beta_s = st[2 * KDA_K + KDA_V];
        __syncthreads();
        kda_decode_lines_rows<false, false>(s, alpha, ks, nullptr, vs, 1.0f, 0.0f, beta_s, kr, warp, lane, nullptr,
                                            false, nullptr, false, nullptr, red_kv, nullptr);
        __syncthreads();  // everyone has read this step's record before the next overwrites it
    }
#pragma unroll
    for (int i = 0; i < KDA_DEC_ROWS; ++i) kda_st4(S + (i * 16 + kr) * KDA_V + v0, s[i], s_al);
}
