// Helpers shared by the tensor-core MXFP4 expert kernels (moe_single_token.cu, moe_few_tokens.cu):
// E2M1 -> bf16 decode through a per-lane shared table, E8M0 block scales as
// bf16x2 and the cp.async wrappers (the mma itself: tensor_core.cuh tc_mma_bf16).
#pragma once
#include "tensor_core.cuh"

// bf16 bits of an E2M1 code (the f32 value has no bits below the top 16).
__device__ __forceinline__ u32 mx_bf16_of(u32 code) { return __float_as_uint(fp4_e2m1_to_f32(code)) >> 16; }

// E8M0 byte -> bf16x2 (2^(s-127) twice; s = 0 is the bf16 subnormal 2^-127).
__device__ __forceinline__ u32 mx_scale2(u32 s) {
    const u32 b = s ? (s << 7) : 0x40u;
    return b | (b << 16);
}

// Pair of weights (byte `byte` of `word`: low nibble = lower column) as scaled bf16x2: one
// conflict-free LDS from the per-lane table times the block scale. fma with a -0 addend is the
// exact product (keeps -0); bf16 fma keeps subnormals.
__device__ __forceinline__ u32 mx_pair(const u32* tab_lane, u32 word, int byte, u32 sc2) {
    const u32 raw = tab_lane[__byte_perm(word, 0, 0x4440 + byte) * 32];
    u32 out;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(raw), "r"(sc2), "r"(0x80008000u));
    return out;
}

// mx_pair without the table (the few-token kernels, moe_few_tokens.cu): the two nibbles of the byte placed
// as bf16 bits s.000000ee.m000000 (E2M1 x 2^-126: e = 0 lands on the bf16 subnormal 0.m x
// 2^-126, which bf16 fma keeps), then x 2^126 and x the block scale: both products exact, so the
// result is bitwise mx_pair's (the few-token kernels' outputs agree bit for bit under either decode).
__device__ __forceinline__ u32 mx_pair_alu(u32 word, int byte, u32 sc2) {
    const u32 t = __byte_perm(word, 0, 0x4440 + byte) * 0x1001u;  // low nibble at bit 0, high at bit 16
    const u32 raw = ((t << 6) & 0x01C001C0u) | ((t << 12) & 0x80008000u);
    u32 up, out;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(up) : "r"(raw), "r"(0x7E807E80u), "r"(0x80008000u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(up), "r"(sc2), "r"(0x80008000u));
    return out;
}

// Word j (0..3) of a uint4.
__device__ __forceinline__ u32 mx_word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// Column c of a 128-column super-step -> its index in a staged hi / lo row (c = 32 t + 4 s + j ->
// 16 s + 4 t + j: lane t's k-step s reads 4 consecutive values).
__device__ __forceinline__ int mx_pos(int c) { return 16 * ((c >> 2) & 7) + 4 * (c >> 5) + (c & 3); }

// 16-byte async copies; with `bytes` < 16 the rest is zero-filled (0: nothing read).
__device__ __forceinline__ void mx_cp16_l2(u32 dst, const void* src, u32 bytes) {  // + L2 256-byte prefetch
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mx_cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void mx_cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void mx_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// For 3-stage rings: wait until at most one group is still in flight.
__device__ __forceinline__ void mx_wait_all_but_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// The replicated decode table in `tab` (`words` u32): word 32 b + l = bf16x2 (E2M1(b & 15),
// E2M1(b >> 4)) for every lane l, 16 bytes per store.
__device__ __forceinline__ void mx_fill_table(u32* tab, int words) {
    uint4* tab4 = reinterpret_cast<uint4*>(tab);
    for (int i = threadIdx.x; i < words / 4; i += blockDim.x) {
        const u32 b = (u32)i >> 3;  // 8 uint4 (32 lanes) per entry
        const u32 v = mx_bf16_of(b & 15u) | (mx_bf16_of(b >> 4) << 16);
        tab4[i] = make_uint4(v, v, v, v);
    }
}

// act = SiTU-GLU of the up kernel's gate / up partial sums, columns col .. col + 7 of one
// assignment: `gu` = its [parts][2][inter] rows, parts added in order (deterministic). Used by
// the single-token down kernel's staging.
__device__ __forceinline__ void mx_glu_parts8(const float* gu, int parts, int inter, int col, float beta,
                                              float beta_lin, int has_lin, float* v) {
    float gs[8], us[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) gs[k] = us[k] = 0.0f;
    for (int p = 0; p < parts; ++p) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float4 a = *reinterpret_cast<const float4*>(gu + (2 * p) * (i64)inter + col + 4 * h);
            const float4 b = *reinterpret_cast<const float4*>(gu + (2 * p + 1) * (i64)inter + col + 4 * h);
            gs[4 * h] += a.x, gs[4 * h + 1] += a.y, gs[4 * h + 2] += a.z, gs[4 * h + 3] += a.w;
            us[4 * h] += b.x, us[4 * h + 1] += b.y, us[4 * h + 2] += b.z, us[4 * h + 3] += b.w;
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = situ_glu_one(gs[k], us[k], beta, beta_lin, has_lin);
}

// Tile `tile` of the grouped GEMMs (mxfp4_grouped.cu, moe_wgmma.cu: each expert's sorted
// assignments cut into pieces of TOK tokens, expert by expert): its expert and first token within
// the expert's sorted range, or false past the last tile. Warp 0 scans ceil(count / TOK) over the
// experts 32 at a time. Block-uniform: every thread reaches the barrier.
template <int TOK>
__device__ bool mx_find_tile(const int* __restrict__ offsets, int experts, int tile, int& e_out, int& t0_out) {
    __shared__ int s_e, s_t0;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int base = 0, fe = -1, ft = 0;
        for (int e0 = 0; e0 < experts; e0 += 32) {
            const int e = e0 + lane;
            const int n = e < experts ? (offsets[e + 1] - offsets[e] + TOK - 1) / TOK : 0;
            int incl = n;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int v = __shfl_up_sync(K3_FULL_MASK, incl, d);
                if (lane >= d) incl += v;
            }
            const int rel = tile - base;
            const u32 hit = __ballot_sync(K3_FULL_MASK, rel >= incl - n && rel < incl);
            if (hit) {  // warp-uniform
                const int src = __ffs(hit) - 1;
                fe = e0 + src;
                ft = (rel - __shfl_sync(K3_FULL_MASK, incl - n, src)) * TOK;
                break;
            }
            base += __shfl_sync(K3_FULL_MASK, incl, 31);
        }
        if (lane == 0) {
            s_e = fe;
            s_t0 = ft;
        }
    }
    __syncthreads();
    e_out = s_e;
    t0_out = s_t0;
    return e_out >= 0;
}
