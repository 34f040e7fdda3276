// Helpers shared by the tensor-core MXFP4 expert kernels (moe_single_token.cu, moe_few_tokens.cu):
// E2M1 -> bf16 decode in registers (mx_raw4, mx_scaled), E8M0 block scales as bf16x2, the staged
// column order (mx_pos) and the cp.async wrappers (the mma itself: tensor_core.cuh tc_mma_bf16).
#pragma once
#include "tensor_core.cuh"

// bf16 bits of an E2M1 code (the f32 value has no bits below the top 16).
__device__ __forceinline__ u32 mx_bf16_of(u32 code) { return __float_as_uint(fp4_e2m1_to_f32(code)) >> 16; }

// E8M0 byte -> bf16x2 (2^(s-127) twice; s = 0 is the bf16 subnormal 2^-127).
__device__ __forceinline__ u32 mx_scale2(u32 s) {
    const u32 b = s ? (s << 7) : 0x40u;
    return b | (b << 16);
}

// E8M0 byte (at most MX_DEC_MAX_FOLDED) -> bf16x2 2^(s-1) twice: the block scale with the decode's
// 2^126 folded in (2^(s-127) x 2^126; s = 0 gives 2^-1). moe_wgmma.cu mxw_dec folds the same
// way, inline.
#define MX_DEC_MAX_FOLDED 128u
__device__ __forceinline__ u32 mx_scale2_folded(u32 s) {
    const u32 b = (s + 126u) << 7;
    return b | (b << 16);
}

// (a & mask) | (b & ~mask) as one LOP3: ptxas splits the C++ form of it in two once it has folded
// the shift's zero bits into the mask.
__device__ __forceinline__ u32 mx_select(u32 mask, u32 a, u32 b) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xCA;" : "=r"(d) : "r"(mask), "r"(a), "r"(b));
    return d;
}

// The four unscaled bf16x2 of a packed word: r[c] holds code c (bits 4c..4c+3) in its low half and
// code c + 4 in its high half, each code's sign at bit 15 and its exponent and mantissa bits at bits
// 6..8, zeros elsewhere: a bf16 of E2M1 x 2^-126 (exponent 0 lands on the bf16 subnormal
// 0.m x 2^-126, which bf16 fma keeps). The target shape (bits b..b+2 and b+9) is a code's own bits
// with the sign moved 6 up: xa does that for codes 0, 1, 4, 5 (sign from w << 6), xb for codes 2, 3,
// 6, 7 (magnitude from w >> 6, sign in place), so one shift and the mask then place each pair: 11
// integer ops a word, against 15 for four pairs shifted and masked apart (each pair's sign and
// magnitude move by amounts 6 apart, so no one rotation of the word places two pairs).
__device__ __forceinline__ void mx_raw4(u32 w, u32 (&r)[4]) {
    constexpr u32 kS = 0x81C081C0u, kA = 0x22002200u, kB = 0x88008800u;
    const u32 xa = mx_select(kA, w << 6, w), xb = mx_select(kB, w, w >> 6);
    r[0] = (xa << 6) & kS;
    r[1] = (xa << 2) & kS;
    r[2] = (xb << 4) & kS;
    r[3] = xb & kS;
}

// An mx_raw4 word times the block scale: one fma with mx_scale2_folded applies 2^126 and the
// scale at once (`two`: two fmas, x 2^126 and x mx_scale2, for scales past MX_DEC_MAX_FOLDED;
// callers pass a constant after a uniform branch). Every product is exact, so both give
// E2M1 x 2^(s-127) bit for bit; -0 addends keep -0.
__device__ __forceinline__ u32 mx_scaled(u32 raw, u32 sc2, bool two) {
    u32 out;
    if (two) {
        u32 up;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(up) : "r"(raw), "r"(0x7E807E80u), "r"(0x80008000u));
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(up), "r"(sc2), "r"(0x80008000u));
    } else {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(raw), "r"(sc2), "r"(0x80008000u));
    }
    return out;
}

// E2M1 -> E4M3 (MXFP8 mode, moe_few_tokens.cu): a code's sign, exponent and mantissa bits moved
// into an e4m3 byte as (s, 0000, eem, 00) are that byte's value = E2M1 x 2^-6 exactly (exponent 0
// lands on the e4m3 subnormal 0.m x 2^-6), so a word's eight nibbles become two words of four
// e4m3 values each with two or three logic ops, and the block scale waits for the mma's f32
// result. Even nibbles (0, 2, 4, 6) into bytes 0..3:
__device__ __forceinline__ u32 mx_e4m3_even(u32 w) { return ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu); }
// ... and odd nibbles (1, 3, 5, 7), whose sign bits already sit at each byte's top.
__device__ __forceinline__ u32 mx_e4m3_odd(u32 w) { return (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu); }

// Byte b of four E8M0 scales as the f32 2^(s - 127); s = 0 gives 0 (a block of at most
// 6 x 2^-127 in magnitude: below anything an f32 sum of products keeps).
__device__ __forceinline__ float mx_scale_f32(u32 s4, int b) { return __uint_as_float(((s4 >> (8 * b)) & 0xffu) << 23); }

// d = A B with mma.sync m16n8k32, e4m3 inputs, f32 result (a fresh accumulator: the caller scales
// it per MX block). sm_89 and later; the MXFP8 path is only dispatched there (dispatch.rs).
__device__ __forceinline__ void tc_mma_e4m3(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
#else
    __trap();
#endif
}

// Word j (0..3) of a uint4.
__device__ __forceinline__ u32 mx_word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// Column c of a 128-column super-step -> its index in a staged hi / lo row (moe_few_tokens.cu):
// c = 32 t + 8 w + i (lane t's block, word w, nibble i) feeds k-step s = 2 w + h, h = 1 for
// nibbles 0, 1, 4, 5; lane t's 4 values of k-step s sit at 16 s + 4 t + j in the order the stage
// takes mx_raw4's pairs: nibbles (3, 7, 2, 6) - 2h.
__device__ __forceinline__ int mx_pos(int c) {
    const int i = c & 7, h = ((i >> 1) & 1) ^ 1, j = ((i & 1) ? 0 : 2) + (i >> 2);
    return 16 * (2 * ((c >> 3) & 3) + h) + 4 * (c >> 5) + j;
}

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

// Tile `tile` of the grouped GEMMs (moe_wgmma.cu: each expert's sorted
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
