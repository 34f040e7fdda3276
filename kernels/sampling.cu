// Candidate selection for sampling on the GPU: each logits row's k largest finite entries, so a
// decode step moves k (id, logit) pairs per sequence to the host instead of a whole vocabulary
// row (k3_model::top_k_of_row defines the result; the host samplers consume it exactly).
// Two launches, so that one row is read by many SMs at once:
//   topk_segments_f32  grid (segments, rows): the top k of each TOPK_SEG-wide slice of a row
//   topk_merge_f32     grid (rows): the top k of a row's segment picks
// Both run the same block selection (block_topk). Order: larger logit first, ties to the lower id.
#include "common.cuh"

#define TOPK_MAX 1024

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

struct TopkShared {
    unsigned hist[256];
    unsigned sel_key[TOPK_MAX];
    int sel_id[TOPK_MAX];
    int warp_base[32];
    unsigned prefix, want, finite;
    int gt, eq_taken;
};

// The top k (1 <= k <= TOPK_MAX) of n candidates src.key(i) / src.id(i), written to out_id /
// out_val [k] (unused slots: id -1) and *out_count. Within equal keys, candidates must come in
// ascending id order (true for a row slice, and for segment picks listed segment by segment).
// Radix select finds the k-th largest key a byte at a time (4 histogram passes restricted to the
// keys matching the bytes chosen so far); an ordered pass takes every key above it and the first
// equal ones; a bitonic sort orders the picks.
template <class Src>
__device__ void block_topk(const Src& src, int n, int k, int* out_id, float* out_val, int* out_count,
                           TopkShared& s) {
    const int tid = threadIdx.x, lane = tid & (K3_WARP - 1), warp = tid / K3_WARP;
    const int nwarps = blockDim.x / K3_WARP;
    if (k == 1) {  // greedy: one arg-max pass
        unsigned bk = 0u;
        int bi = 0x7fffffff;
        for (int i = tid; i < n; i += blockDim.x) {
            const unsigned key = src.key(i);
            const int id = src.id(i);
            if (key != 0u && topk_before(key, id, bk, bi)) {
                bk = key;
                bi = id;
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
            s.sel_key[warp] = bk;
            s.sel_id[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < nwarps; ++w)
                if (topk_before(s.sel_key[w], s.sel_id[w], bk, bi)) {
                    bk = s.sel_key[w];
                    bi = s.sel_id[w];
                }
            const bool any = bk != 0u;
            out_id[0] = any ? bi : -1;
            out_val[0] = any ? src.value_of_id(bi) : 0.0f;
            *out_count = any ? 1 : 0;
        }
        return;
    }

    unsigned prefix = 0, mask = 0, want = (unsigned)k;
    for (int digit = 3; digit >= 0; --digit) {
        for (int b = tid; b < 256; b += blockDim.x) s.hist[b] = 0;
        __syncthreads();
        const int shift = digit * 8;
        for (int base = 0; base < n; base += blockDim.x) {  // warp-uniform trip count
            const int i = base + tid;
            const unsigned key = i < n ? src.key(i) : 0u;
            const bool counted = key != 0u && (key & mask) == prefix;
            // Logits share few exponents, so many lanes hit the same bin: one atomic per bin
            // per warp instead of one per lane.
            const unsigned bin = counted ? (key >> shift) & 255u : 256u;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (counted && lane == __ffs(peers) - 1) atomicAdd(&s.hist[bin], __popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            unsigned above = 0, total = 0;
            for (int b = 0; b < 256; ++b) total += s.hist[b];
            if (digit == 3) s.finite = total;
            int chosen = 0;
            for (int b = 255; b >= 0; --b) {
                if (above + s.hist[b] >= want) {
                    chosen = b;
                    break;
                }
                above += s.hist[b];
            }
            s.prefix = prefix | ((unsigned)chosen << shift);
            s.want = want - above;
        }
        __syncthreads();
        if (digit == 3 && s.finite <= (unsigned)k) break;  // everything finite is taken
        prefix = s.prefix;
        want = s.want;
        mask |= 255u << shift;
    }
    const bool take_all = s.finite <= (unsigned)k;
    const int n_sel = take_all ? (int)s.finite : k;
    // Keys above `kth` are all taken; of the keys equal to it, the first `eq_need`.
    const unsigned kth = take_all ? 0u : prefix;
    const int eq_need = take_all ? 0 : (int)want;
    const int gt_slots = n_sel - eq_need;
    if (tid == 0) {
        s.gt = 0;
        s.eq_taken = 0;
    }
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + tid;
        const unsigned key = i < n ? src.key(i) : 0u;
        if (key > kth) {
            const int slot = atomicAdd(&s.gt, 1);
            if (slot < gt_slots) {
                s.sel_key[slot] = key;
                s.sel_id[slot] = src.id(i);
            }
        }
        if (eq_need > 0 && s.eq_taken < eq_need) {  // uniform: eq_taken changes only below
            const bool eq = key == kth && key != 0u;
            const unsigned ballot = __ballot_sync(0xffffffffu, eq);
            if (lane == 0) s.warp_base[warp] = __popc(ballot);
            __syncthreads();
            int before = 0, chunk_total = 0;
            for (int w = 0; w < nwarps; ++w) {
                if (w < warp) before += s.warp_base[w];
                chunk_total += s.warp_base[w];
            }
            const int rank = s.eq_taken + before + __popc(ballot & ((1u << lane) - 1u));
            if (eq && rank < eq_need) {
                s.sel_key[gt_slots + rank] = key;
                s.sel_id[gt_slots + rank] = src.id(i);
            }
            __syncthreads();
            if (tid == 0) s.eq_taken += chunk_total;
        }
        __syncthreads();
    }

    // Bitonic sort of the picks (padded to a power of two with entries that rank last).
    int p2 = 1;
    while (p2 < n_sel) p2 <<= 1;
    for (int i = n_sel + tid; i < p2; i += blockDim.x) {
        s.sel_key[i] = 0u;
        s.sel_id[i] = 0x7fffffff;
    }
    __syncthreads();
    for (int size = 2; size <= p2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < p2; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    // Rank order ("ascending") where bit `size` of i is clear, reversed elsewhere.
                    const bool up = (i & size) == 0;
                    const bool swap = up ? topk_before(s.sel_key[j], s.sel_id[j], s.sel_key[i], s.sel_id[i])
                                         : topk_before(s.sel_key[i], s.sel_id[i], s.sel_key[j], s.sel_id[j]);
                    if (swap) {
                        const unsigned tk = s.sel_key[i];
                        const int ti = s.sel_id[i];
                        s.sel_key[i] = s.sel_key[j];
                        s.sel_id[i] = s.sel_id[j];
                        s.sel_key[j] = tk;
                        s.sel_id[j] = ti;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += blockDim.x) {
        const bool valid = i < n_sel;
        out_id[i] = valid ? s.sel_id[i] : -1;
        out_val[i] = valid ? src.value_of_id(s.sel_id[i]) : 0.0f;
    }
    if (tid == 0) *out_count = n_sel;
}

// A slice of one logits row: candidate i is column first + i. `allowed` (null: every token) is
// the row's token bitmask for constrained decoding, bit t % 32 of word t / 32; a forbidden token
// keys as a masked logit.
struct RowSlice {
    const float* row;
    int first;
    const unsigned* allowed;
    __device__ unsigned key(int i) const {
        const int t = first + i;
        if (allowed != nullptr && ((allowed[t >> 5] >> (t & 31)) & 1u) == 0u) return 0u;
        return topk_key(row[t]);
    }
    __device__ int id(int i) const { return first + i; }
    __device__ float value_of_id(int id) const { return row[id]; }
};

// One row's segment picks, segment after segment (`k` slots each, `count[s]` of them valid).
struct SegmentPicks {
    const int* ids;
    const float* vals;
    const int* count;
    const float* row;
    int k;
    __device__ unsigned key(int i) const {
        const int seg = i / k, j = i - seg * k;
        return j < count[seg] ? topk_key(vals[i]) : 0u;
    }
    __device__ int id(int i) const { return ids[i]; }
    __device__ float value_of_id(int id) const { return row[id]; }
};

// Grid (segments, rows): seg_* [rows, segments, k], seg_count [rows, segments].
// Token masks: with mask_words > 0, mask_table holds `rows` mask indices (-1: row unmasked), then
// the masks, mask_words (>= ceil(vocab / 32)) words each; with mask_words == 0 it is not read.
extern "C" __global__ void __launch_bounds__(512)
topk_segments_f32(const float* __restrict__ logits, int* __restrict__ seg_ids, float* __restrict__ seg_vals,
                  int* __restrict__ seg_count, int rows, int vocab, int k, int seg_len,
                  const u32* __restrict__ mask_table, int mask_words) {
    __shared__ TopkShared s;
    const int seg = blockIdx.x, r = blockIdx.y, segments = gridDim.x;
    if (r >= rows || k < 1 || k > TOPK_MAX || seg_len < 1) return;
    const int first = seg * seg_len;
    const int n = max(0, min(seg_len, vocab - first));
    const unsigned* allowed = nullptr;
    if (mask_words > 0) {
        const int m = (int)mask_table[r];
        if (m >= 0) allowed = mask_table + rows + (i64)m * mask_words;
    }
    const RowSlice src{logits + (i64)r * vocab, first, allowed};
    const i64 slot = (i64)r * segments + seg;
    block_topk(src, n, k, seg_ids + slot * k, seg_vals + slot * k, seg_count + slot, s);
}

// Grid (rows): ids / vals [rows, k] (unused slots: id -1), count [rows].
extern "C" __global__ void __launch_bounds__(1024)
topk_merge_f32(const float* __restrict__ logits, const int* __restrict__ seg_ids, const float* __restrict__ seg_vals,
               const int* __restrict__ seg_count, int* __restrict__ ids, float* __restrict__ vals,
               int* __restrict__ count, int rows, int vocab, int k, int segments) {
    __shared__ TopkShared s;
    const int r = blockIdx.x;
    if (r >= rows || k < 1 || k > TOPK_MAX) return;
    const i64 base = (i64)r * segments;
    const SegmentPicks src{seg_ids + base * k, seg_vals + base * k, seg_count + base, logits + (i64)r * vocab, k};
    block_topk(src, segments * k, k, ids + (i64)r * k, vals + (i64)r * k, count + r, s);
}
