// bf16 tensor-core and streaming-load helpers shared by the kernels that multiply f32 activations
// with bf16 (or bf16-decoded) weights: bf16.cu, mla.cu, mla_attend_bf16.cu and the MXFP4 kernels.
#pragma once
#include "common.cuh"

// Two f32 -> bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 tc_pack_bf16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// (a, b) -> three bf16x2 words whose sum is (a, b): each piece is the residual of the ones before
// rounded to bf16, and every residual is exact in f32, so hi + mid + lo carries all 24 mantissa
// bits and bf16 x bf16 products of the pieces are exact f32 products.
__device__ __forceinline__ void tc_split3(float a, float b, u32& p0, u32& p1, u32& p2) {
    p0 = tc_pack_bf16(a, b);
    a -= __uint_as_float(p0 << 16);
    b -= __uint_as_float(p0 & 0xffff0000u);
    p1 = tc_pack_bf16(a, b);
    a -= __uint_as_float(p1 << 16);
    b -= __uint_as_float(p1 & 0xffff0000u);
    p2 = tc_pack_bf16(a, b);
}
__device__ __forceinline__ void tc_split3(float a, float b, u32* p) { tc_split3(a, b, p[0], p[1], p[2]); }

// c += A B with mma.sync m16n8k16, bf16 inputs, f32 accumulation.
__device__ __forceinline__ void tc_mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void tc_mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    tc_mma_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}

// Loads of data read once (weights, cache rows): bypass L1. volatile: call sites rely on issue
// order for loads in flight.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_stream_u2(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_stream_f4(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ float ld_stream_f1(const float* p) {
    float v;
    asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
