// Hopper (sm_90a) pieces shared by the wgmma MLA decode kernels (mla_attend_wg.cu, mla_attend_wgf.cu):
// named barriers, the async-proxy fence, wgmma issue / commit / wait, 128-byte-swizzle matrix
// descriptors, cluster ranks and barriers, mbarriers with transaction counts, and st.async into a
// partner block's shared memory. Everything is inside the sm_90a guard: the files' entry points
// trap elsewhere.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
typedef unsigned long long u64;

__device__ __forceinline__ void mlw_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void mlw_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// Generic-proxy st.shared -> wgmma (async proxy) reads: each writer fences before the barrier.
__device__ __forceinline__ void mlw_fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mlw_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving accumulator reads / writes across the async window.
template <int N = 24>
__device__ __forceinline__ void mlw_pin(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// 128-byte-swizzle matrix descriptor (base offset 0: every atom is 1024-aligned).
__device__ __forceinline__ u64 mlw_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// Cluster pieces (clusters of 2 blocks: mla_attend_wg2_f32, mla_attend_wgf_f32).
__device__ __forceinline__ u32 mlw_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 mlw_mapa(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ void mlw_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void mlw_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mlw_mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mlw_mbar_arrive_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrive on the partner's mbarrier (a shared::cluster address from mlw_mapa).
__device__ __forceinline__ void mlw_mbar_arrive_remote(u32 rbar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(rbar) : "memory");
}
__device__ __forceinline__ void mlw_mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "MLW_WAIT_%=:\n\t"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra MLW_WAIT_%=;\n\t}" ::"r"(bar), "r"(parity) : "memory");
}
// 8 bytes into the partner's shared memory, counted by its mbarrier's transaction bytes (no
// cluster-scope release fence per store: the complete_tx releases them).
__device__ __forceinline__ void mlw_st_async8(u32 raddr, u32 x, u32 y, u32 rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                 ::"r"(raddr), "r"(x), "r"(y), "r"(rbar) : "memory");
}

// d[0..23] += A B, m64n48k16, bf16 in, f32 accumulate; TA = imm-trans-a (1: A is M-major).
#define MLW_WGMMA_N48(NAME, TA)                                                                                 \
    __device__ __forceinline__ void NAME(float* d, u64 da, u64 db) {                                             \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"                                               \
                     "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "                                     \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                     "%20, %21, %22, %23}, %24, %25, p, 1, 1, " #TA ", 0;\n}\n"                                  \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
                       "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),   \
                       "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),             \
                       "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])                                        \
                     : "l"(da), "l"(db), "r"(1));                                                                \
    }
MLW_WGMMA_N48(mlw_mma_kmajor, 0)
MLW_WGMMA_N48(mlw_mma_amajor_m, 1)

// d[0..47] += A B, m64n96k16 (mla_attend_wgf.cu's P V over the 96 heads of a block pair).
#define MLW_WGMMA_N96(NAME, TA)                                                                                 \
    __device__ __forceinline__ void NAME(float* d, u64 da, u64 db) {                                             \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"                                               \
                     "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "                                     \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                     "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
                     "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, " #TA ", 0;\n}\n"     \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
                       "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),   \
                       "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),             \
                       "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),             \
                       "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),             \
                       "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),             \
                       "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),             \
                       "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])                                        \
                     : "l"(da), "l"(db), "r"(1));                                                                \
    }
MLW_WGMMA_N96(mlw_mma96_amajor_m, 1)

// 4 bytes into the partner's shared memory, counted by its mbarrier's transaction bytes.
__device__ __forceinline__ void mlw_st_async4(u32 raddr, float x, u32 rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(raddr), "r"(__float_as_uint(x)), "r"(rbar) : "memory");
}
#endif
