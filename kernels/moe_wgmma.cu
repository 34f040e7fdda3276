// Routed experts in MXFP4 as a grouped GEMM on Hopper wgmma (moe/wgmma.rs; sm_90a only: elsewhere
// the GEMM kernels are trapping stubs and dispatch.rs does not send steps here). The contract
// of a grouped mma.sync pair (deleted: tiles of one expert's sorted assignments, the tile
// list derived on the device, SiTU-GLU in the up epilogue, y rows by assignment, then
// moe_combine_ids_f32) with its own activation layout and a runtime `planes`: 2 = hi / lo bf16
// (split_bf16, ~16 mantissa bits: f32-level results, `--dtype float32`), 1 = bf16 rounded once
// (what vLLM / SGLang do: ~3e-3 relative; `--dtype bfloat16`, the default; SiTU there uses the
// hardware tanh, 2^-11 relative, below the bf16 rounding that follows). Deterministic either way.
//
// Why. An mma.sync m16n8k16 grouped pair is slower: a warp issues one mma per 16 rows x 4 tokens
// (hi / lo columns) and reads every B fragment with its own LDS, so issue slots and shared-memory
// wavefronts, not the tensor cores, set its pace (about 3x the hi / lo FLOP floor at
// K3 prefill sizes). wgmma m64nNk16 takes A (the weights) from registers - the decode writes the
// fragment straight into them; weights never touch shared memory after their packed bytes are
// staged - and B (the tokens) from shared memory through a descriptor: one instruction per
// warpgroup covers 64 rows x N tokens x 16 with no per-thread B traffic.
//
// CTA: 256 threads = 2 warpgroups, both consumers (no producer warp: every thread issues its
// share of the weight copies, warp 0 the token copies; one barrier per stage). 256 weight rows x
// one tile of up to 128 tokens; one CTA per SM (209,920 B of shared memory). Warpgroup v owns
// staged rows [128 v, 128 v + 128) as two m64 tiles m = 0, 1 (UP: W1 and W3 rows r0 + 64 v + 0..63,
// so gate and up of one (row, token) sit in the same thread; DOWN: W2 rows r0 + 128 v + 64 m + 0..63).
// Why 256 x 128: B is the operand that is expensive to move (4 B per element at hi / lo against
// 0.53 B per packed weight), so the CTA takes as many weight rows as the accumulators allow
// (2 x m64n128 f32 = 128 registers per thread): ~20 B / clock per SM from L2 at full tensor rate.
// A tile's N is its token count rounded up to 32 (instantiations 32 / 64 / 96 / 128): an expert's
// last, partial tile costs MMA in proportion to its tokens.
//
// Pipeline. Stage = 64 columns (one activation group, below); ring of S = 5 (planes 2) / 8
// (planes 1) stages. Stage c + S - 2 is issued while stage c is consumed, into the buffer of
// stage c - 2: the last wgmma group of stage c - 1 may still be reading its own buffer, but every
// warpgroup waited for stage c - 2's groups (wait_group 1 after stage c - 1's first k-step)
// before arriving at stage c's barrier. Two kinds of copy fill a stage:
//   weights and scales: cp.async by every thread (a 16-byte piece of two staged rows and a row's
//     4 scale bytes), read back with plain loads by the decode: cp.async.wait_group S - 3, then
//     the stage's __syncthreads;
//   tokens: 8 x planes bulk copies (cp.async.bulk, one per 16-byte chunk column: nt x 16
//     contiguous bytes in the chunk-major layout below) issued by warp 0's lanes against the
//     stage's mbarrier, which lane 0 arms with the byte count; every thread waits for the
//     mbarrier's phase just before the stage's first wgmma. The bulk copies are async-proxy
//     writes read by the async proxy (wgmma), so no proxy fence is needed; columns [nt, N) of the
//     tile keep whatever the buffer held (their outputs are never stored: a wgmma column is its
//     own dot product). Per-thread cp.async gathers of the tokens from z's rows were ~1 ms slower
//     in the up kernel (docs/performance-history.md, calls CC and CD).
// Then 4 k-steps, each: decode the lane's A fragments of both m-tiles, wgmma.fence (the A registers
// were just written), planes x 2 wgmmas (m-tile x plane; both planes accumulate into the same
// registers), commit, a share of stage c + S - 2's copies (k-step 0: weights and scales; 1:
// tokens), wait_group 1 (the previous k-step's group is done: its A registers may be reused, and
// the current group runs under the next decode); then commit stage c + S - 2's cp.async copies as
// one group. ptxas (-v) reports no wgmma serialisation and 0 spills.
//
// Determinism (device_check.py check_moe_wg_repeat). Every output element - an intermediate value
// (row, sorted position) or a y value (row, assignment) - is one accumulator lane of one thread,
// staged and written once (no atomics, no split K), and summed in a fixed order: stages
// c = 0.., k-steps 0..3, plane 0 then 1, each one k16 dot product of the weight row with that
// token's column. wgmma computes each column's dot product alone, so which tile / column the sort
// (atomic cursor: any order within an expert) gives a token, and that tile's N, change no bit;
// columns past nt hold stale buffer bytes and are never stored. Checked on the device by runs on
// reordered sorts and NaN-prefilled scratch.
//
// Shared memory of a stage (bytes from the stage base; SB = 9,216 + 16,384 planes):
//   [0, 8192)      packed weights: staged row ar (0..255) at 32 ar: its 64 columns of the stage.
//   [8192, 9216)   scales: staged row ar's 4 E8M0 bytes of the 128-column super-step holding the
//                  stage (block 2 (c & 1) + b of stage c at byte 4 ar + 2 (c & 1) + b).
//   [9216, SB)     tokens (B), K-major, no swizzle: 16-byte chunk cc = 8 p + q (plane p, positions
//                  8 q .. 8 q + 7 of the stage's 64) of token n at 9216 + 2048 cc + 16 n, so a
//                  core matrix (8 tokens x 8 k) is 128 contiguous bytes (conflict-free), and chunk
//                  cc of the tile's tokens is one run of 16 nt bytes: one bulk copy.
// The ring's mbarriers (one per stage buffer) are static shared memory.
// B descriptor (PTX matrix descriptor: start >> 4 | LBO >> 4 << 16 | SBO >> 4 << 32, layout type
// 0 = no swizzle, base offset 0; CUTLASS's K-major INTERLEAVE canonical layout ((8, n), 2) :
// ((16 B, SBO), LBO)) for plane p, k-step s (0..3): start = B base + 2048 (8 p + 2 s), LBO = 2048
// (the k 8..15 core matrix = the next chunk), SBO = 128 (the next 8 tokens); the instruction's N
// reads N / 8 token groups.
//
// Fragments. A (m64nNk16, warp w of the warpgroup holds rows 16 w .. 16 w + 15 in the mma.sync
// m16n8k16 layout; CUTLASS ALayout_64x16): lane (g = lane / 4, t = lane % 4) holds a0 = (row g,
// k 2t, 2t+1), a1 = (row g+8, same k), a2 = (row g, k 2t+8, 2t+9), a3 = (row g+8, same). Which
// physical column a k slot stands for is free as long as B agrees: lane t reads bytes 8t .. 8t+7
// of its rows in the stage (columns 16t .. 16t+15, MX block t / 2), and k-step s takes byte 2s
// (columns 16t + 4s + 0, 1 -> k 2t, 2t+1) and byte 2s + 1 (columns 16t + 4s + 2, 3 -> k 2t+8,
// 2t+9). So column c of a stage is k-step (c >> 2) & 3, k = 2 (c >> 4) + (c & 1) + 8 ((c >> 1) & 1),
// and the activations are stored at position 16 s + k (mxw_pos): B rows in k order.
// Accumulator (m64nN f32): d[4 j + 2 h + e] of lane (g, t) in warp w is row 16 w + g + 8 h,
// token 8 j + 2 t + e.
// Decode without a table (no shared-memory traffic, which the wgmma B reads need): for byte b of
// a packed word, PRMT builds [lower code, 0, upper code, 0]; times 2^6 + 2^12 (the two codes do
// not overlap) and masked, each code's exponent + mantissa lands in bf16 bits 6-8 and its sign in
// bit 15: the bf16x2 pair E2M1 * 2^-126 (code 1 = the subnormal 2^-127). Times 2^(min(s, 128) - 1)
// then 2^(max(s, 128) - 128), both normal bf16, it is E2M1 * 2^(s - 127) exactly for every E8M0 s
// (one factor cannot hold 2^(s - 1) past s = 128). 4.5 instructions per bf16x2 + 1 for the second
// factor; ~340-410 instructions per warp and stage in all (SASS of the N = 64 / 128 loops).
//
// Activation layout, chunk-major (what the stage's bulk copies read): [ceil(cols / 64) groups G]
// [8 planes chunks cc][R rows][8] bf16, R = the step's assignments; column 64 G + c of row r is
// element pos & 7 of chunk cc = 8 p + (pos >> 3), pos = mxw_pos(c), plane p (hi, lo or the one
// bf16); columns past `cols` zero (they meet zero-filled weights; zeros keep NaN out). Row r is
// sorted position r for both GEMMs, so a tile's tokens are consecutive rows: the split gathers
// z's rows into sorted order (sorted[r] / top_k), the up kernel writes the intermediate so.
//   mxfp4_experts_wgmma_split_f32     zx[r] = split(z[sorted[r] / top_k]) (planes 2) or bf16 (planes 1)
//   mxfp4_experts_wgmma_up_f32        actx[r] = split(SiTU-GLU(W1_e zx[r], W3_e zx[r]))
//   mxfp4_experts_wgmma_down_f32      y[sorted[r]] = W2_e actx[r]
//
// Expected (H200, K3: latent 3584, inter 3072, top-16 of 128). MMA = planes x 2.16 TFLOP at
// T = 2048: 5.5 ms (hi / lo) / 2.7 ms (bf16) at ~790 TFLOP/s, +~6 % for rounding partial tiles up
// to 32 tokens. Per stage a warp issues ~380 instructions against 2048 (planes 2, N = 128) /
// 1024 (planes 1) tensor clocks shared by the SM's two warps per scheduler, so the tensor pipe
// can stay fed: ~80 % of peak -> ~7 ms hi / lo, ~3.7 ms bf16 at T = 2048. At T = 512 (~64 tokens
// per expert: N = 64 / 96 tiles) ~2 ms hi / lo; bf16 there is issue-bound (N = 64: ~680 issue
// slots per 512 tensor clocks), ~1.2 ms. Weights stream from HBM about once per layer (0.5 ms).
#include "mxfp4_mma.cuh"

#define MXW_TOK 128      // tokens per tile (the largest wgmma N here)
#define MXW_KC 64        // columns per stage = one activation group
#define MXW_AROWS 256    // weight rows per CTA
#define MXW_UP_ROWS 128  // intermediate rows per up CTA (W1 and W3 each)
#define MXW_THREADS 256  // two warpgroups
#define MXW_A_BYTES (MXW_AROWS * 32)
#define MXW_S_BYTES (MXW_AROWS * 4)
#define MXW_CHUNK_BYTES (MXW_TOK * 16)  // one 16-byte chunk of every token
#define MXW_STAGE_BYTES(P) (MXW_A_BYTES + MXW_S_BYTES + 8 * (P) * MXW_CHUNK_BYTES)
#define MXW_STAGES(P) ((P) == 2 ? 5 : 8)
// Harness-only timing probes (benchmarks_moe.py bench_moe_wg_diag; never set by the backend): bits
// of what to leave out - 1 the weight decode (raw words feed the MMA), 2 the wgmma, 4 the token
// copies, 8 the weight and scale copies, 16 the epilogue (nothing stored, the accumulators kept
// live), 32 SiTU (the up epilogue stores gate x up); 64 evaluates the bf16 mode's SiTU as the
// float32 mode's (k3_tanh). Results are garbage under 1..32.
#ifndef MXW_DIAG
#define MXW_DIAG 0
#endif
#define MXW_SWAP_LBO_SBO 16  // GEMM kernels' mode bit: swap the B descriptor's LBO / SBO (diagnostic)
// Dynamic shared memory of both GEMM kernels (geometry.rs MX_WG_SHARED): 209,920 B.
#define MXW_SHARED_BYTES (MXW_STAGES(2) * MXW_STAGE_BYTES(2))

static_assert(MXW_SHARED_BYTES == 209920, "keep geometry.rs MX_WG_SHARED in step");
static_assert(MXW_STAGES(1) * MXW_STAGE_BYTES(1) <= MXW_SHARED_BYTES, "planes = 1 ring fits");

// Column c (0..63) of a stage -> its position in a staged activation group (header).
__device__ __forceinline__ int mxw_pos(int c) {
    return 16 * ((c >> 2) & 3) + 8 * ((c >> 1) & 1) + 2 * (c >> 4) + (c & 1);
}

// Grid (ceil(R / 8), ceil(cols / 64)), 64 threads: z [T, cols] f32 -> xs (chunk-major, header)
// in sorted order. Thread (i = tid & 7, q = tid >> 3) writes chunk q of each plane of row r =
// 8 blockIdx.x + i, group blockIdx.y: the 8 columns 64 G + 2 q + 16 m + {0, 1} (m = 0..3) of z's
// row sorted[r] / top_k, whose positions are 8 q + 2 m + {0, 1}. A warp's stores are runs of 128
// contiguous bytes (8 rows of one chunk). Rows from offsets[experts] on (dropped slots, never
// read by a tile) are skipped.
extern "C" __global__ void mxfp4_experts_wgmma_split_f32(const float* __restrict__ z, const int* __restrict__ sorted,
                                                         const int* __restrict__ offsets, u16* __restrict__ xs, int R,
                                                         int cols, int top_k, int experts, int planes) {
    const int r = 8 * blockIdx.x + (threadIdx.x & 7), q = threadIdx.x >> 3, grp = blockIdx.y;
    if (r >= R || r >= offsets[experts]) return;
    const float* src = z + (i64)(sorted[r] / top_k) * cols + 64 * grp + 2 * q;
    float v[8];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        float2 f = make_float2(0.0f, 0.0f);
        if (64 * grp + 2 * q + 16 * m < cols)  // cols is even: the pair's second column is in the row too
            f = *reinterpret_cast<const float2*>(src + 16 * m);
        v[2 * m] = f.x, v[2 * m + 1] = f.y;
    }
    u16 hi[8], lo[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (planes == 2)
            split_bf16(v[k], hi[k], lo[k]);
        else
            hi[k] = f32_to_bf16_bits(v[k]);
    }
    auto pack = [](const u16(&h)[8]) {
        return make_uint4(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16), h[4] | ((u32)h[5] << 16),
                          h[6] | ((u32)h[7] << 16));
    };
    uint4* dst = reinterpret_cast<uint4*>(xs) + ((i64)grp * 8 * planes + q) * R + r;
    dst[0] = pack(hi);
    if (planes == 2) dst[(i64)8 * R] = pack(lo);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

extern __shared__ __align__(128) u8 mxw_smem[];

// The ring's mbarriers (one per stage buffer; MXW_STAGES(1) is the larger ring).
__shared__ __align__(8) u64 mxw_bars[8];

// `bytes` (a multiple of 16) from global to this CTA's shared memory, completing on `bar`.
__device__ __forceinline__ void mxw_bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ float mxw_tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// SiTU-GLU in bf16 mode (situ_glu_one's formula, docs/k3-model.md §6) with the hardware tanh
// (2^-11 relative; the result is rounded to bf16, 2^-9, next): one MUFU op per tanh against
// k3_tanh's two and ~15 more instructions. The sigmoid stays exp + reciprocal (a tanh-based
// sigmoid loses its relative precision for negative gates). ib / ibl = 1 / beta, 1 / beta_lin.
__device__ __forceinline__ float mxw_situ_glu_bf16(float g, float u, float beta, float ib, float beta_lin, float ibl,
                                                   int has_lin) {
    const float a = beta * mxw_tanh_approx(g * ib) * __fdividef(1.0f, 1.0f + __expf(-g));
    return a * (has_lin ? beta_lin * mxw_tanh_approx(u * ibl) : u);
}
__device__ __forceinline__ void mxw_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mxw_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void mxw_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void mxw_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across the asynchronous window.
template <int L>
__device__ __forceinline__ void mxw_pin(float (&d)[L]) {
#pragma unroll
    for (int i = 0; i < L; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d += A B: wgmma m64nNk16, A (bf16) from registers, B (bf16, K-major) from the descriptor, f32
// accumulators (N = 2 x the array length; the overload picks the shape).
__device__ __forceinline__ void mxw_mma(float (&d)[16], const u32 (&a)[4], u64 desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void mxw_mma(float (&d)[32], const u32 (&a)[4], u64 desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void mxw_mma(float (&d)[48], const u32 (&a)[4], u64 desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
                 "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void mxw_mma(float (&d)[64], const u32 (&a)[4], u64 desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// B descriptor: no swizzle, LBO = one chunk of every token (k 8..15), SBO = 8 tokens (header).
// `swap` exchanges the two fields: a diagnostic only (MXW_SWAP_LBO_SBO in the mode argument), so
// one device run can tell a misread descriptor from other faults.
__device__ __forceinline__ u64 mxw_desc(u32 addr, bool swap) {
    const u64 lbo = swap ? 128 : MXW_CHUNK_BYTES, sbo = swap ? MXW_CHUNK_BYTES : 128;
    return (u64)((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
}

// Byte b (compile-time after unrolling) of a packed word, both codes, as bf16x2 E2M1 * 2^-126 times
// sc (bf16x2 2^(min(s, 128) - 1)) times sc2 (2^(max(s, 128) - 128): 1 unless s > 128). lo / hi =
// the word's lower / upper codes, one per byte (w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F). PRMT
// builds t = [lo.b, 0, hi.b, 0] (selector 8 | b replicates the sign bit of lo.b: 0); the two codes
// times 2^6 + 2^12 do not overlap, and the mask keeps each code's exponent + mantissa (bits 6-8 /
// 22-24) and sign (15 / 31): 4 instructions per bf16x2 and no shared-memory table.
__device__ __forceinline__ u32 mxw_dec(u32 lo, u32 hi, int b, u32 sc, u32 sc2) {
    u32 t, out;
    const u32 sel = (u32)(b | ((8 | b) << 4) | ((4 + b) << 8) | ((8 | b) << 12));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(lo), "r"(hi), "r"(sel));
    const u32 raw = (t * 4160u) & 0x81C081C0u;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(raw), "r"(sc), "r"(0x80008000u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(out), "r"(sc2), "r"(0x80008000u));
    return out;
}

// One CTA's tile: nt (1..128) tokens, rows p0 .. p0 + nt - 1 of xs (chunk-major, R rows); staged
// A-row ar is, for UP, row r0 + 64 (ar >> 7) + (ar & 63) of W1 ((ar >> 6) & 1 == 0) or W3, else
// row r0 + ar of W2; `rows` x `cols` per matrix.
struct MxwTile {
    const u16* xs;
    i64 R;
    const int* sorted;  // DOWN: y row of each sorted position
    int p0, nt;
    const u8* pk[2];
    const u8* ps[2];
    int rows, cols, r0;
    u16* actx;  // UP output (chunk-major, R rows)
    float* y;   // DOWN output
    float beta, beta_lin;
    int has_lin;
    bool swap;  // mode & MXW_SWAP_LBO_SBO
};

// The epilogue stages a tile's results in the (then idle) ring and writes them with 16-byte
// stores, each warp's a contiguous run, instead of 2- or 4-byte pieces straight from the
// accumulators (16 scattered sectors per warp store for the up kernel): 0.2 / 0.1 ms off the up /
// down kernels at T = 2048 (docs/performance-history.md, calls CD and CE).
// UP: run (v, cc) of warpgroup v's group holds its chunk column cc for the tile's tokens, 16 B
// per token, runs MXW_RUN_BYTES apart (16 B of padding: fewer bank conflicts).
// DOWN: token i's 256 y values at float MXW_Y_ROW * i (4 floats of padding, likewise).
#define MXW_RUN_BYTES (MXW_TOK * 16 + 16)
#define MXW_Y_ROW (MXW_AROWS + 4)
static_assert(2 * 16 * MXW_RUN_BYTES <= MXW_SHARED_BYTES, "up staging fits the ring");
static_assert(MXW_TOK * MXW_Y_ROW * 4 <= MXW_SHARED_BYTES, "down staging fits the ring");

// A tile's results: UP, actx = SiTU-GLU of each thread's gate (m-tile 0) and up (m-tile 1) rows,
// split into `P` planes; else y rows by assignment. Threads 0..255 (the two warpgroups), after
// both warpgroups' last wgmma (the staging overwrites the ring).
template <int P, bool UP, int N>
__device__ __forceinline__ void mxw_epilogue(const MxwTile& a, const float (&acc)[2][N / 2]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7, wq = warp & 3, g = lane >> 2,
              t = lane & 3;
    if constexpr (UP) {
        const int ng = (a.rows + MXW_KC - 1) / MXW_KC;  // group of warpgroup v: 2 blockIdx.x + v
        // Every SiTU first, without a branch (tokens past nt included: computed, never stored), so
        // the evaluations interleave.
        const float ib = __fdividef(1.0f, a.beta), ibl = __fdividef(1.0f, a.beta_lin);
        float v[N / 2];
#pragma unroll
        for (int x = 0; x < N / 2; ++x) {
            const float gate = acc[0][x], up = acc[1][x];
            if (MXW_DIAG & 32)
                v[x] = gate * up;
            else if (P == 1 && !(MXW_DIAG & 64))
                v[x] = mxw_situ_glu_bf16(gate, up, a.beta, ib, a.beta_lin, ibl, a.has_lin);
            else
                v[x] = situ_glu_one(gate, up, a.beta, a.beta_lin, a.has_lin);
        }
        // Element 4 j + 2 h + e: local row rl = 16 wq + 8 h + g (column rl of the group: position
        // 8 (4 h + (g >> 1)) + 2 wq + (g & 1)), token i = 8 j + 2 t + e.
        u16* st = reinterpret_cast<u16*>(mxw_smem) + 2 * wq + (g & 1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const bool row_in = a.r0 + 64 * wg + 16 * wq + 8 * h + g < a.rows;  // else zeros (padding)
            const int run = wg * 8 * P + 4 * h + (g >> 1);
#pragma unroll
            for (int j = 0; j < N / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = 8 * j + 2 * t + e;
                    const float val = row_in ? v[4 * j + 2 * h + e] : 0.0f;
                    u16* dst = st + (run * MXW_RUN_BYTES + 16 * i) / 2;
                    if (P == 2) {
                        u16 hi, lo;
                        split_bf16(val, hi, lo);
                        dst[0] = hi;
                        dst[8 * MXW_RUN_BYTES / 2] = lo;  // run + 8: plane 1
                    } else {
                        dst[0] = f32_to_bf16_bits(val);
                    }
                }
        }
        __syncthreads();
        // Run r = (v, cc): nt 16-byte pieces to actx's chunk column cc of group 2 blockIdx.x + v.
        for (int k = tid; k < 2 * 8 * P * MXW_TOK; k += MXW_THREADS) {
            const int r = k / MXW_TOK, i = k % MXW_TOK, grp = 2 * blockIdx.x + r / (8 * P);
            if (i >= a.nt || grp >= ng) continue;
            const uint4 x = *reinterpret_cast<const uint4*>(mxw_smem + r * MXW_RUN_BYTES + 16 * i);
            reinterpret_cast<uint4*>(a.actx)[((i64)grp * 8 * P + r % (8 * P)) * a.R + a.p0 + i] = x;
        }
    } else {
        float* st = reinterpret_cast<float*>(mxw_smem);
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        st[(8 * j + 2 * t + e) * MXW_Y_ROW + 128 * wg + 64 * m + 16 * wq + 8 * h + g] =
                            acc[m][4 * j + 2 * h + e];
        __syncthreads();
        // Token i (warp i % 8): its 256 values to y row sorted[p0 + i], 512 contiguous bytes per
        // warp store (rows % 4 == 0: a float4 is inside the row or past it).
        for (int i = warp; i < a.nt; i += MXW_THREADS / 32) {
            float* row = a.y + (i64)a.sorted[a.p0 + i] * a.rows + a.r0;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int c = 4 * lane + 128 * k;
                if (a.r0 + c < a.rows)
                    *reinterpret_cast<float4*>(row + c) = *reinterpret_cast<const float4*>(st + i * MXW_Y_ROW + c);
            }
        }
    }
}

template <int P, bool UP, int N>
__device__ __forceinline__ void mxw_tile(const MxwTile& a) {
    constexpr int S = MXW_STAGES(P), SB = MXW_STAGE_BYTES(P), L = N / 2;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7, wq = warp & 3, g = lane >> 2,
              t = lane & 3;
    const int cols = a.cols, nb = cols >> 5, nch = (cols + MXW_KC - 1) / MXW_KC;
    const u32 sbase = (u32)__cvta_generic_to_shared(mxw_smem);

    // Copy duty. A: 16-byte half (tid & 1) of staged rows (tid >> 1) + 128 i; scales: staged row
    // tid (cp.async). Rows past the matrix are clamped (loaded, never stored). B: warp 0, lane
    // cc < 8 P: chunk column cc of the tile's rows, 16 nt contiguous bytes (a bulk copy).
    auto src_row = [&](int ar, int& m) {
        m = UP ? (ar >> 6) & 1 : 0;
        return min(UP ? a.r0 + 64 * (ar >> 7) + (ar & 63) : a.r0 + ar, a.rows - 1);
    };
    const u8* wsrc[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int m;
        const int r = src_row((tid >> 1) + 128 * i, m);
        wsrc[i] = (m ? a.pk[1] : a.pk[0]) + (i64)r * (cols / 2) + 16 * (tid & 1);
    }
    int sm;
    const int sr = src_row(tid, sm);
    const u8* ssrc = (sm ? a.ps[1] : a.ps[0]) + (i64)sr * nb;
    const u32 bar0 = (u32)__cvta_generic_to_shared(mxw_bars), tok_bytes = 16u * (u32)a.nt;
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < S; ++i) mbar_init(bar0 + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the mbarriers are initialised before anyone arms or waits on them

    // part: -1 all of stage c's copies (the prologue); 0..3 the share issued after k-step `part`
    // of an earlier stage: 0 the weights and scales, 1 the tokens.
    auto issue = [&](int c, int part) {
        const u32 bs = sbase + (c % S) * SB;
        const bool in = 64 * c + 32 * (tid & 1) < cols;  // past the row's end: zeros (code 0 = +0)
        if (!(MXW_DIAG & 8) && part <= 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
                mx_cp16_l2(bs + ((tid >> 1) + 128 * i) * 32 + 16 * (tid & 1), wsrc[i] + (in ? 32 * c : 0),
                           in ? 16u : 0u);  // 256-byte L2 prefetch: HBM sees 8 stages of a row at once
            if ((nb & 3) == 0) {
                mx_cp4(bs + MXW_A_BYTES + 4 * tid, ssrc + 4 * (c >> 1));
            } else {  // scale rows not 4-byte aligned (test shapes only): a plain load and store
                u32 v = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (4 * (c >> 1) + k < nb) v |= (u32)ssrc[4 * (c >> 1) + k] << (8 * k);
                *reinterpret_cast<u32*>(mxw_smem + (c % S) * SB + MXW_A_BYTES + 4 * tid) = v;
            }
        }
        if ((MXW_DIAG & 4) || (part != -1 && part != 1) || warp != 0) return;
        const u32 bar = bar0 + 8 * (c % S);
        if (lane == 0) mbar_arrive_expect_tx(bar, 8 * P * tok_bytes);
        __syncwarp();
        if (lane < 8 * P)
            mxw_bulk(bs + MXW_A_BYTES + MXW_S_BYTES + lane * MXW_CHUNK_BYTES,
                     a.xs + (((i64)c * 8 * P + lane) * a.R + a.p0) * 8, tok_bytes, bar);
    };

    float acc[2][L];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < L; ++i) acc[m][i] = 0.0f;
    mxw_pin(acc[0]);
    mxw_pin(acc[1]);
#pragma unroll
    for (int j = 0; j < S - 2; ++j) {
        if (j < nch) issue(j, -1);
        mx_commit();
    }
    for (int c = 0; c < nch; ++c) {
        mxw_cp_wait<S - 3>();  // this thread's weight copies of stage c are done (S - 3 younger groups)
        __syncthreads();       // everyone's; and every warpgroup is done with stage c - 2's buffer
        const u8* buf = mxw_smem + (c % S) * SB;
        uint2 wv[2][2];
        u32 sc[2][2], sc2[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int ar = 128 * wg + 64 * m + 16 * wq + 8 * h + g;
                wv[m][h] = *reinterpret_cast<const uint2*>(buf + ar * 32 + 8 * t);
                const u32 s = buf[MXW_A_BYTES + 4 * ar + 2 * (c & 1) + (t >> 1)];
                const u32 b1 = (min(s, 128u) + 126u) << 7, b2 = (max(s, 128u) - 1u) << 7;
                sc[m][h] = b1 | (b1 << 16);
                sc2[m][h] = b2 | (b2 << 16);
            }
        // Descriptor of plane 0, k-step 0; (plane, k-step) adds its chunk offset to the start
        // field (>> 4; stays below 2^14: shared addresses < 256 KB).
        const u64 db = mxw_desc(sbase + (c % S) * SB + MXW_A_BYTES + MXW_S_BYTES, a.swap);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 af[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const u32 w0 = (s >> 1) ? wv[m][0].y : wv[m][0].x, w1 = (s >> 1) ? wv[m][1].y : wv[m][1].x;
                const u32 l0 = w0 & 0x0F0F0F0Fu, h0 = (w0 >> 4) & 0x0F0F0F0Fu;
                const u32 l1 = w1 & 0x0F0F0F0Fu, h1 = (w1 >> 4) & 0x0F0F0F0Fu;
                const int by = 2 * (s & 1);
                if (MXW_DIAG & 1) {
                    af[m][0] = l0, af[m][1] = l1, af[m][2] = h0, af[m][3] = h1;
                    continue;
                }
                af[m][0] = mxw_dec(l0, h0, by, sc[m][0], sc2[m][0]);
                af[m][1] = mxw_dec(l1, h1, by, sc[m][1], sc2[m][1]);
                af[m][2] = mxw_dec(l0, h0, by + 1, sc[m][0], sc2[m][0]);
                af[m][3] = mxw_dec(l1, h1, by + 1, sc[m][1], sc2[m][1]);
            }
            if (s == 0 && !(MXW_DIAG & 4)) mbar_wait(bar0 + 8 * (c % S), (u32)(c / S) & 1u);  // the tokens
            mxw_wg_fence();  // the A registers (and, first time, the zeroed accumulators) were written
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int p = 0; p < P; ++p)
                    if (!(MXW_DIAG & 2)) mxw_mma(acc[m], af[m], db + (u64)((8 * p + 2 * s) * (MXW_CHUNK_BYTES >> 4)));
            mxw_wg_commit();
            if (c + S - 2 < nch) issue(c + S - 2, s);  // a share of stage c + S - 2's copies
            mxw_wg_wait<1>();  // the previous k-step's group is done
        }
        mx_commit();  // stage c + S - 2's cp.async group (possibly empty: keeps the count per stage fixed)
    }
    mxw_wg_wait<0>();
    mxw_pin(acc[0]);
    mxw_pin(acc[1]);
    if (MXW_DIAG & 16) {  // keep the accumulators live (a store never taken): else ptxas drops the wgmmas
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < L; ++i) sum += acc[0][i] + acc[1][i];
        if (a.cols < 0) *reinterpret_cast<float*>(UP ? (void*)a.actx : (void*)a.y) = sum;  // cols: a kernel argument
        return;
    }
    __syncthreads();  // both warpgroups' wgmmas are done with the ring: the epilogue stages in it
    mxw_epilogue<P, UP, N>(a, acc);
}

// The tile's N: its tokens rounded up to 32.
template <int P, bool UP>
__device__ __forceinline__ void mxw_dispatch(const MxwTile& a) {
    switch ((a.nt + 31) >> 5) {
        case 1: mxw_tile<P, UP, 32>(a); break;
        case 2: mxw_tile<P, UP, 64>(a); break;
        case 3: mxw_tile<P, UP, 96>(a); break;
        default: mxw_tile<P, UP, 128>(a); break;
    }
}
#endif

// Grid (ceil(inter / 128), assignments / 128 + min(E, assignments) (a bound on the tiles)), 256
// threads, MXW_SHARED_BYTES (opt-in). mode = planes (1 or 2) | MXW_SWAP_LBO_SBO (a diagnostic).
// zx: mxfp4_experts_wgmma_split_f32's R rows (sorted positions) with those planes; actx: R rows of
// ceil(inter / 64) groups, both chunk-major (header): the up CTA (x, tile) writes groups 2x, 2x + 1
// of its tokens' rows (rows past inter as zeros). Other arguments as mxfp4_up_grouped_f32.
extern "C" __global__ void __launch_bounds__(MXW_THREADS, 1)
mxfp4_experts_wgmma_up_f32(const u16* __restrict__ zx, const u8* __restrict__ w1p, const u8* __restrict__ w1s,
                           const u8* __restrict__ w3p, const u8* __restrict__ w3s, const int* __restrict__ offsets,
                           u16* __restrict__ actx, int R, int latent, int inter, float beta, float beta_lin,
                           int has_lin, int experts, int mode) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    int e, t0;
    if (!mx_find_tile<MXW_TOK>(offsets, experts, blockIdx.y, e, t0)) return;  // block-uniform
    const i64 mat = (i64)e * inter;
    MxwTile a;
    a.xs = zx;
    a.R = R;
    a.sorted = nullptr;
    a.p0 = offsets[e] + t0;
    a.nt = min(MXW_TOK, offsets[e + 1] - a.p0);
    a.pk[0] = w1p + mat * (latent / 2);
    a.pk[1] = w3p + mat * (latent / 2);
    a.ps[0] = w1s + mat * (latent / 32);
    a.ps[1] = w3s + mat * (latent / 32);
    a.rows = inter;
    a.cols = latent;
    a.r0 = blockIdx.x * MXW_UP_ROWS;
    a.actx = actx;
    a.y = nullptr;
    a.beta = beta;
    a.beta_lin = beta_lin;
    a.has_lin = has_lin;
    a.swap = (mode & MXW_SWAP_LBO_SBO) != 0;
    if ((mode & 3) == 2)
        mxw_dispatch<2, true>(a);
    else
        mxw_dispatch<1, true>(a);
#else
    __trap();  // wgmma needs sm_90a: ops.rs only dispatches here on it
#endif
}

// Grid (ceil(latent / 256), as the up kernel), 256 threads, MXW_SHARED_BYTES: y[sorted[p], r] =
// W2_e[r, :] . act[p, :] with act from actx (mxfp4_experts_wgmma_up_f32, same mode and R). Other
// arguments as mxfp4_down_grouped_f32.
extern "C" __global__ void __launch_bounds__(MXW_THREADS, 1)
mxfp4_experts_wgmma_down_f32(const u16* __restrict__ actx, const u8* __restrict__ w2p, const u8* __restrict__ w2s,
                             const int* __restrict__ offsets, const int* __restrict__ sorted, float* __restrict__ y,
                             int R, int latent, int inter, int experts, int mode) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    int e, t0;
    if (!mx_find_tile<MXW_TOK>(offsets, experts, blockIdx.y, e, t0)) return;
    const i64 mat = (i64)e * latent;
    MxwTile a;
    a.xs = actx;
    a.R = R;
    a.sorted = sorted;
    a.p0 = offsets[e] + t0;
    a.nt = min(MXW_TOK, offsets[e + 1] - a.p0);
    a.pk[0] = a.pk[1] = w2p + mat * (inter / 2);
    a.ps[0] = a.ps[1] = w2s + mat * (inter / 32);
    a.rows = latent;
    a.cols = inter;
    a.r0 = blockIdx.x * MXW_AROWS;
    a.actx = nullptr;
    a.y = y;
    a.beta = a.beta_lin = 0.0f;
    a.has_lin = 0;
    a.swap = (mode & MXW_SWAP_LBO_SBO) != 0;
    if ((mode & 3) == 2)
        mxw_dispatch<2, false>(a);
    else
        mxw_dispatch<1, false>(a);
#else
    __trap();
#endif
}
