// Candidate selection for sampling on the GPU: each logits row's k largest finite entries, so a
// decode step moves k (id, logit) pairs per sequence to the host instead of a whole vocabulary
// row (k3_model::top_k_of_row defines the result; the host samplers consume it exactly).
#include "common.cuh"

#define TOPK_MAX 1024
#define TOPK_THREADS 1024

// Order-preserving key: a larger float has a larger key, -0 below +0 (Rust's total_cmp on
// finite values); masked (non-finite) logits get 0, below every finite key, and are never taken.
__device__ __forceinline__ unsigned topk_key(float v) {
    if (!isfinite(v)) return 0u;
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (key, id) a ranks before b: larger key, then lower id.
__device__ __forceinline__ bool topk_before(unsigned ka, int ia, unsigned kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// One block of TOPK_THREADS per row. ids / vals [rows, k]: the row's selection, largest first,
// ties to the lower id; count[r] how many entries are valid (< k when the row has fewer finite
// logits). 1 <= k <= TOPK_MAX.
// Radix select finds the k-th largest key one byte at a time (4 histogram passes over the row,
// each restricted to the keys matching the bytes chosen so far); one ordered pass then takes
// every key above it and the lowest ids equal to it, and a bitonic sort orders the <= k picks.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
topk_rows_f32(const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ vals,
              int* __restrict__ count, int rows, int vocab, int k) {
    __shared__ unsigned hist[256];
    __shared__ unsigned sel_key[TOPK_MAX];
    __shared__ int sel_id[TOPK_MAX];
    __shared__ unsigned s_prefix, s_want, s_finite;
    __shared__ int warp_base[TOPK_THREADS / K3_WARP];
    __shared__ int s_gt, s_eq_taken;
    const int r = blockIdx.x, tid = threadIdx.x;
    if (r >= rows || k < 1 || k > TOPK_MAX) return;
    const float* x = logits + (i64)r * vocab;
    const int lane = tid & (K3_WARP - 1), warp = tid / K3_WARP, nwarps = blockDim.x / K3_WARP;

    if (k == 1) {  // greedy: one arg-max pass
        unsigned bk = 0u;
        int bi = 0x7fffffff;
        for (int c = tid; c < vocab; c += blockDim.x) {
            const unsigned key = topk_key(x[c]);
            if (topk_before(key, c, bk, bi)) {
                bk = key;
                bi = c;
            }
        }
        for (int o = K3_WARP / 2; o > 0; o >>= 1) {
            const unsigned ok = __shfl_xor_sync(0xffffffffu, bk, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (topk_before(ok, oi, bk, bi)) {
                bk = ok;
                bi = oi;
            }
        }
        if (lane == 0) {
            sel_key[warp] = bk;
            sel_id[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < nwarps; ++w)
                if (topk_before(sel_key[w], sel_id[w], bk, bi)) {
                    bk = sel_key[w];
                    bi = sel_id[w];
                }
            const bool any = bk != 0u;
            ids[r] = any ? bi : -1;
            vals[r] = any ? x[bi] : 0.0f;
            count[r] = any ? 1 : 0;
        }
        return;
    }

    // Radix select of the k-th largest finite key (or "all finite" when there are <= k).
    unsigned prefix = 0, mask = 0, want = (unsigned)k;
    for (int digit = 3; digit >= 0; --digit) {
        for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        const int shift = digit * 8;
        for (int base = 0; base < vocab; base += blockDim.x) {  // warp-uniform trip count
            const int c = base + tid;
            const unsigned key = c < vocab ? topk_key(x[c]) : 0u;
            const bool counted = key != 0u && (key & mask) == prefix;
            // Logits share few exponents, so many lanes hit the same bin: one atomic per bin
            // per warp instead of one per lane.
            const unsigned bin = counted ? (key >> shift) & 255u : 256u;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (counted && (tid & (K3_WARP - 1)) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            unsigned above = 0, total = 0;
            for (int b = 0; b < 256; ++b) total += hist[b];
            if (digit == 3) s_finite = total;
            int chosen = 0;
            for (int b = 255; b >= 0; --b) {
                if (above + hist[b] >= want) {
                    chosen = b;
                    break;
                }
                above += hist[b];
            }
            s_prefix = prefix | ((unsigned)chosen << shift);
            s_want = want - above;
        }
        __syncthreads();
        if (digit == 3 && s_finite <= (unsigned)k) break;  // everything finite is taken
        prefix = s_prefix;
        want = s_want;
        mask |= 255u << shift;
    }
    const bool take_all = s_finite <= (unsigned)k;
    const int n_sel = take_all ? (int)s_finite : k;
    // Keys above `kth` are all taken; of the keys equal to it, the `want` lowest ids.
    const unsigned kth = take_all ? 0u : prefix;
    const int eq_need = take_all ? 0 : (int)want;
    const int gt_slots = n_sel - eq_need;
    if (tid == 0) {
        s_gt = 0;
        s_eq_taken = 0;
    }
    __syncthreads();
    for (int base = 0; base < vocab; base += blockDim.x) {
        const int c = base + tid;
        const unsigned key = c < vocab ? topk_key(x[c]) : 0u;
        if (key > kth) {
            const int slot = atomicAdd(&s_gt, 1);
            if (slot < gt_slots) {
                sel_key[slot] = key;
                sel_id[slot] = c;
            }
        }
        if (eq_need > 0 && s_eq_taken < eq_need) {  // uniform: s_eq_taken changes only below
            // Ordered rank of this thread among the chunk's equal keys (ids ascend with tid).
            const bool eq = key == kth && key != 0u;
            const unsigned ballot = __ballot_sync(0xffffffffu, eq);
            if (lane == 0) warp_base[warp] = __popc(ballot);
            __syncthreads();
            int before = 0, chunk_total = 0;
            for (int w = 0; w < nwarps; ++w) {
                if (w < warp) before += warp_base[w];
                chunk_total += warp_base[w];
            }
            const int rank = s_eq_taken + before + __popc(ballot & ((1u << lane) - 1u));
            if (eq && rank < eq_need) {
                sel_key[gt_slots + rank] = key;
                sel_id[gt_slots + rank] = c;
            }
            __syncthreads();
            if (tid == 0) s_eq_taken += chunk_total;
        }
        __syncthreads();
    }

    // Bitonic sort of the picks (padded to a power of two with entries that rank last).
    int n = 1;
    while (n < n_sel) n <<= 1;
    for (int i = n_sel + tid; i < n; i += blockDim.x) {
        sel_key[i] = 0u;
        sel_id[i] = 0x7fffffff;
    }
    __syncthreads();
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < n; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    // Ascending in rank order (rank first = "smallest") within blocks of `size`
                    // whose bit `size` is clear, descending otherwise.
                    const bool up = (i & size) == 0;
                    const bool swap = up ? topk_before(sel_key[j], sel_id[j], sel_key[i], sel_id[i])
                                         : topk_before(sel_key[i], sel_id[i], sel_key[j], sel_id[j]);
                    if (swap) {
                        const unsigned tk = sel_key[i];
                        const int ti = sel_id[i];
                        sel_key[i] = sel_key[j];
                        sel_id[i] = sel_id[j];
                        sel_key[j] = tk;
                        sel_id[j] = ti;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += blockDim.x) {
        const bool valid = i < n_sel;
        ids[(i64)r * k + i] = valid ? sel_id[i] : -1;
        vals[(i64)r * k + i] = valid ? x[sel_id[i]] : 0.0f;
    }
    if (tid == 0) count[r] = n_sel;
}
