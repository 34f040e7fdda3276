// Shared device helpers for the k3 kernels. NVRTC-only: no host code, no system headers.
// Every *.cu file includes this one file; the loaders (Rust and scripts/device_check.py)
// inline it textually, so it must stay self-contained.
#pragma once

#define K3_WARP 32
#define K3_FULL_MASK 0xffffffffu

typedef unsigned int u32;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

// No <math.h> under NVRTC: spell -inf by its bits.
#define K3_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float k3_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ __forceinline__ float k3_silu(float x) { return x * k3_sigmoid(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = K3_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(K3_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = K3_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(K3_FULL_MASK, v, o));
    return v;
}

// Block-wide sum; `scratch` holds one float per warp (>= 32 floats). Every thread gets the result.
// Callers must not reuse `scratch` before a __syncthreads() that follows this call.
// Arg-max order shared by the router's top-k and greedy sampling: larger value wins, ties go to the
// lower index (the CPU backend's rule, so both pick the same expert / token).
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Warp-wide (value, index) arg-max in that order; every lane ends with the winner.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
    for (int o = K3_WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(K3_FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(K3_FULL_MASK, bi, o);
        if (argmax_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    const int nwarps = (blockDim.x + K3_WARP - 1) / K3_WARP;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & (K3_WARP - 1), warp = threadIdx.x / K3_WARP;
    const int nwarps = (blockDim.x + K3_WARP - 1) / K3_WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : K3_NEG_INF;
    return warp_max(v);
}

// bf16 stored as raw 16-bit patterns (no cuda_bf16.h needed): widening is a shift.
__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) { return __uint_as_float(((u32)b) << 16); }

// FP4 E2M1 code -> value (bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa) by building the
// f32 bits: a table in constant memory would serialise when lanes read different codes.
__device__ __forceinline__ float fp4_e2m1_to_f32(u32 code) {
    const u32 e = (code >> 1) & 3u, m = code & 1u;
    const u32 mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3f000000u : 0u);  // e = 0: 0 or 0.5
    return __uint_as_float(mag | ((code & 8u) << 28));
}

// E8M0 scale byte -> 2^(s-127) exactly (s = 0 gives 2^-127, a subnormal: built from bits).
__device__ __forceinline__ float e8m0_to_f32(u8 s) {
    return s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(((u32)s) << 23);
}

// tanh without a data-dependent branch (the CPU backend's fastmath::tanh, same split): an odd
// polynomial below |x| = 0.125, where 1 - 2 / (e^2|x| + 1) cancels, that formula beyond; both are
// computed and one selected. Within ~1e-6 relative of tanhf. Why: tanhf branches on |x|, so an
// unrolled run of them cannot be interleaved, and the expert kernels' SiTU epilogues (64 values
// per thread, 8 warps per SM) ran latency-bound on it.
__device__ __forceinline__ float k3_tanh(float x) {
    const float ax = fabsf(x);
    const float big = 1.0f - __fdividef(2.0f, __expf(2.0f * ax) + 1.0f);  // e^2|x| = inf: 1
    const float x2 = x * x;
    float p = 62.0f / 2835.0f;
    p = fmaf(p, x2, -17.0f / 315.0f);
    p = fmaf(p, x2, 2.0f / 15.0f);
    p = fmaf(p, x2, -1.0f / 3.0f);
    const float small = fmaf(p * x2, ax, ax);
    return copysignf(ax < 0.125f ? small : big, x);
}

// SiTU-GLU of one element (docs/k3-model.md §6), branch-free (k3_tanh; the sigmoid's division
// approximate, 2 ulp); shared by every kernel that applies it. Against tanhf and IEEE divisions
// it took a ninth off the grouped up GEMM (the expert kernels evaluate it in their epilogues).
__device__ __forceinline__ float situ_glu_one(float g, float u, float beta, float beta_lin, int has_lin) {
    const float a = beta * k3_tanh(g * __fdividef(1.0f, beta)) * __fdividef(1.0f, 1.0f + __expf(-g));
    const float b = has_lin ? beta_lin * k3_tanh(u * __fdividef(1.0f, beta_lin)) : u;
    return a * b;
}

typedef unsigned short u16;

// f32 -> bf16 bits, round to nearest even (NaN kept quiet).
__device__ __forceinline__ u16 f32_to_bf16_bits(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// x = hi + lo + O(2^-16 |x|) with hi, lo bf16: GEMMs of bf16 weights with both halves of an f32
// activation keep ~16 mantissa bits of it (moe_gemm.cu, bf16.cu).
__device__ __forceinline__ void split_bf16(float x, u16& hi, u16& lo) {
    hi = f32_to_bf16_bits(x);
    lo = f32_to_bf16_bits(x - bf16_bits_to_f32(hi));
}

// Eight values as hi / lo bf16 pairs packed two per word (element 2k in the low half of word k):
// the staged-activation layout of the MXFP4 stream kernels.
__device__ __forceinline__ void split8_bf16(const float (&v)[8], u32 (&hi)[4], u32 (&lo)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u16 h0, l0, h1, l1;
        split_bf16(v[2 * k], h0, l0);
        split_bf16(v[2 * k + 1], h1, l1);
        hi[k] = h0 | ((u32)h1 << 16);
        lo[k] = l0 | ((u32)l1 << 16);
    }
}

// mbarrier helpers (shared-memory addresses from __cvta_generic_to_shared; sm_90+: try_wait).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` of transactions (bulk copies, st.async) in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives on `bar` once this thread's earlier cp.async copies have landed (counted in the
// mbarrier's initial count: .noinc).
__device__ __forceinline__ void mbar_arrive_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Wait for the phase of parity `parity` to complete (acquire at CTA scope).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "MBAR_WAIT_%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra MBAR_WAIT_%=;\n\t}" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
// The same with acquire at cluster scope: for data other blocks of the cluster pushed.
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "MBAR_WAIT_CLUSTER_%=:\n\t"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra MBAR_WAIT_CLUSTER_%=;\n\t}" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
