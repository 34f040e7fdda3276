// Shared definitions of the KDA kernels (docs/k3-model.md §3, docs/model-format.md).
//
// Per-layer state region of one sequence (f32, offsets in floats): conv windows q, k, v, each
// [H*K, W-1] (per channel, oldest first, PRE-conv inputs), then S [H, K, V] (S[k][v], v contiguous).
// Only K = V = 128 is supported (K3 and k3-mini); the launchers check it.
#pragma once
#include "common.cuh"

#define KDA_K 128
#define KDA_V 128
#define KDA_MAX_CONV 8

// Thread tile of the state, shared by decode and prefill: a warp owns 8 value columns; lane l
// holds column (l & 7) of them and the 32 key rows k = i*4 + (l >> 3), i < 32. Reductions over K
// are then two shuffles (xor 8, 16) with no shared memory, and the 4 key-quarters of a warp read
// 4 adjacent rows, so shared-memory vectors indexed by k hit 4 different banks.
#define KDA_ROWS 32
__device__ __forceinline__ int kda_row(int i, int lane) { return i * 4 + (lane >> 3); }
__device__ __forceinline__ float kda_reduce_k(float v) {
    v += __shfl_xor_sync(K3_FULL_MASK, v, 8);
    v += __shfl_xor_sync(K3_FULL_MASK, v, 16);
    return v;
}

// Safe gate: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) in (lb, 0).
__device__ __forceinline__ float kda_gate(float f, float dt_bias, float a_exp, float lower_bound) {
    return lower_bound * (1.0f / (1.0f + expf(-a_exp * (f + dt_bias))));
}

__device__ __forceinline__ i64 kda_window_floats(int hk, int conv) { return (i64)hk * (conv - 1); }
__device__ __forceinline__ i64 kda_state_base(int hk, int conv) { return 3 * kda_window_floats(hk, conv); }
