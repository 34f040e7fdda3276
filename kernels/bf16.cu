// Dense matmuls with bf16 weights (a bf16 checkpoint keeps half the bytes on the device): the f32
// activation rows are split into bf16 hi and lo rows (common.cuh split_bf16), one tensor-core
// GEMM (cuBLAS, f32 accumulate) computes both against the weights, and the halves are summed.
//   bf16_split_rows_f32   x [M, K] f32 -> xs [planes M, K] bf16 bits: rows 0..M hi, M..2M lo (planes
//                         2; planes 1 writes the hi rows alone: x rounded once, bf16 mode)
//   sum_row_halves_f32    c [2M, N] f32 -> y [M, N] = c[0..M] + c[M..2M]
//   bf16_to_f32           widen (f32 copies for ops without a bf16 kernel)
//   gemv_bf16_tc_f32      y = x w^T for M <= 16 rows (decode): tensor cores, x in three bf16 pieces
//                         (float32 mode) or rounded once (bf16 mode); split-K partials summed by
//                         the last block of each row block
#include "tensor_core.cuh"

extern "C" __global__ void bf16_split_rows_f32(const float* __restrict__ x, u16* __restrict__ xs, i64 n, int planes) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        u16 hi, lo;
        split_bf16(x[i], hi, lo);
        xs[i] = hi;
        if (planes > 1) xs[n + i] = lo;
    }
}

extern "C" __global__ void sum_row_halves_f32(const float* __restrict__ c, float* __restrict__ y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = c[i] + c[n + i];
}

// bf16 bits -> f32 (the f32 copy of a bf16 weight for ops with only an f32 kernel).
extern "C" __global__ void bf16_to_f32(const u16* __restrict__ b, float* __restrict__ out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = bf16_bits_to_f32(b[i]);
}

// Decode-sized products on the tensor cores, reading each weight byte once for all M <= 16 rows:
// y [M, N] = x [M, K] . w [N, K]^T with the weight as the MMA's A operand (16 output rows) and
// the activation rows as B (two n8 tiles). With `pieces` = 3 each x value enters as three bf16
// pieces (hi + mid + lo = all 24 mantissa bits) and bf16 x bf16 products are exact in the f32
// accumulator, so the result tracks an f32 matmul (~1e-6) while the FMA count stops limiting at
// M = 16 (float32 mode); with `pieces` = 1 x is rounded once to bf16, as the bf16 mode's GEMMs
// take it, and a third of the mma and split work is left.
// Sums over k do not care about the order of k, so a lane loads 8 consecutive bf16 of a row (one
// 16-byte load) and the matching 8 x values, and they fill its fragment slots of two k16 MMAs.
// Block: 4 warps x 32 rows (two m16 tiles each), all on one K slice (the warps' x reads then hit
// L1); grid (ceil(N / 128), splits), slice `kslice` columns (a multiple of GEMV_TC_KSTEP).
// out [splits, M, N]: y itself when there is one split, else the partials, which the last block of
// each row block to finish adds into y (gemv_bf16_tc_f32). K % 8 == 0 (16-byte rows); M <= 16.
#define GEMV_TC_MAX_M 16
#define GEMV_TC_MT 2      // m16 tiles per warp
#ifndef GEMV_TC_UNROLL       // harness probes may set it (benchmarks.py bench_gemv, K3_GEMV_DIAG)
#define GEMV_TC_UNROLL 2  // 32-column chunks per step (a step's loads are issued together)
#endif
#define GEMV_TC_KSTEP (32 * GEMV_TC_UNROLL)

template <int P>
__device__ __forceinline__ void gemv_bf16_tc(const float* __restrict__ x, const u16* __restrict__ w,
                                             float* __restrict__ out, int M, int N, int K, int kslice) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 128 + (threadIdx.x >> 5) * (16 * GEMV_TC_MT);
    const int k0 = blockIdx.y * kslice, k1 = min(K, k0 + kslice);
    const bool two = M > 8;  // uniform: the second n8 tile of x rows
    // This lane's weight rows (g and g + 8 of each m tile); rows past N read nothing.
    const u16* wr[GEMV_TC_MT][2];
    bool wok[GEMV_TC_MT][2];
#pragma unroll
    for (int mt = 0; mt < GEMV_TC_MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + mt * 16 + h * 8 + g;
            wok[mt][h] = r < N;
            wr[mt][h] = w + (i64)min(r, N - 1) * K;
        }
    // This lane's x rows: g (tile 0) and 8 + g (tile 1).
    const bool xok0 = g < M, xok1 = two && g + 8 < M;
    const float* xr0 = x + (i64)min(g, M - 1) * K;
    const float* xr1 = x + (i64)min(g + 8, M - 1) * K;
    float acc[GEMV_TC_MT][2][4];
#pragma unroll
    for (int mt = 0; mt < GEMV_TC_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

    // One K step's operands: the weight rows' 16-byte chunks and the matching x values.
    struct Step {
        uint4 w[GEMV_TC_UNROLL][GEMV_TC_MT][2];
        float4 x[GEMV_TC_UNROLL][2][2];  // [u][x tile][columns 8t+0..3 | 8t+4..7]
    };
    auto load = [&](int kb, Step& s) {
#pragma unroll
        for (int u = 0; u < GEMV_TC_UNROLL; ++u) {
            const int col = kb + u * 32 + t * 8;
            const bool cin = col < k1;
#pragma unroll
            for (int mt = 0; mt < GEMV_TC_MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    s.w[u][mt][h] = (cin && wok[mt][h]) ? ld_stream_u4(wr[mt][h] + col) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                s.x[u][nt][0] = s.x[u][nt][1] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (cin && (nt == 0 ? xok0 : xok1)) {
                    const float4* p = reinterpret_cast<const float4*>((nt == 0 ? xr0 : xr1) + col);
                    s.x[u][nt][0] = __ldg(p);
                    s.x[u][nt][1] = __ldg(p + 1);
                }
            }
        }
    };
    auto compute = [&](const Step& s) {
#pragma unroll
        for (int u = 0; u < GEMV_TC_UNROLL; ++u) {
            // B fragments: [piece][tile][k16 half][b0b1 | b2b3] (physical columns 8t+0..3, 8t+4..7).
            u32 b[P][2][2][2];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float4 lo4 = s.x[u][nt][0], hi4 = s.x[u][nt][1];
                if constexpr (P == 3) {
                    tc_split3(lo4.x, lo4.y, b[0][nt][0][0], b[1][nt][0][0], b[2][nt][0][0]);
                    tc_split3(lo4.z, lo4.w, b[0][nt][0][1], b[1][nt][0][1], b[2][nt][0][1]);
                    tc_split3(hi4.x, hi4.y, b[0][nt][1][0], b[1][nt][1][0], b[2][nt][1][0]);
                    tc_split3(hi4.z, hi4.w, b[0][nt][1][1], b[1][nt][1][1], b[2][nt][1][1]);
                } else {
                    b[0][nt][0][0] = tc_pack_bf16(lo4.x, lo4.y);
                    b[0][nt][0][1] = tc_pack_bf16(lo4.z, lo4.w);
                    b[0][nt][1][0] = tc_pack_bf16(hi4.x, hi4.y);
                    b[0][nt][1][1] = tc_pack_bf16(hi4.z, hi4.w);
                }
            }
#pragma unroll
            for (int mt = 0; mt < GEMV_TC_MT; ++mt) {
                const uint4 r = s.w[u][mt][0], r8 = s.w[u][mt][1];
#pragma unroll
                for (int p = P - 1; p >= 0; --p) {  // small pieces first
                    tc_mma_bf16(acc[mt][0], r.x, r8.x, r.y, r8.y, b[p][0][0][0], b[p][0][0][1]);
                    tc_mma_bf16(acc[mt][0], r.z, r8.z, r.w, r8.w, b[p][0][1][0], b[p][0][1][1]);
                    if (two) {
                        tc_mma_bf16(acc[mt][1], r.x, r8.x, r.y, r8.y, b[p][1][0][0], b[p][1][0][1]);
                        tc_mma_bf16(acc[mt][1], r.z, r8.z, r.w, r8.w, b[p][1][1][0], b[p][1][1][1]);
                    }
                }
            }
        }
    };
    for (int kb = k0; kb < k1; kb += GEMV_TC_KSTEP) {
        Step cur;
        load(kb, cur);
        compute(cur);
    }
    // D fragment: c0/c1 at (row g, x rows 2t, 2t+1), c2/c3 at row g + 8.
    float* o = out + (i64)blockIdx.y * M * N;
#pragma unroll
    for (int mt = 0; mt < GEMV_TC_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = nt * 8 + 2 * t + (i & 1), r = row0 + mt * 16 + g + (i >> 1) * 8;
                if (m < M && r < N) o[(i64)m * N + r] = acc[mt][nt][i];
            }
}

// `pieces`: 3 (float32 mode) or 1 (bf16 mode). One split (gridDim.y == 1): `part` is y and the
// blocks write it directly. Several: each block writes its [M, 128-row] partial to part[split],
// then takes a ticket for its row block (`tickets[blockIdx.x]`, 0 between launches); the block
// that takes the last one sums the row block's partials in split order (the order and the f32
// additions of a separate sum kernel, so the bits are the same) into y and puts the ticket back
// to 0. That saves the sum kernel's launch per split product (~20 per k3-slice decode step).
// The tickets are shared by every launch on the stream; launches on other streams would need
// their own.
extern "C" __global__ void __launch_bounds__(128, 4)
    gemv_bf16_tc_f32(const float* __restrict__ x, const u16* __restrict__ w, float* part, float* y,
                     int* tickets, int M, int N, int K, int kslice, int pieces) {
    if (pieces == 1)
        gemv_bf16_tc<1>(x, w, part, M, N, K, kslice);
    else
        gemv_bf16_tc<3>(x, w, part, M, N, K, kslice);
    const int splits = gridDim.y;
    if (splits == 1) return;
    __shared__ int last;
    __threadfence();  // this block's partial is visible device-wide before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&tickets[blockIdx.x], 1) == splits - 1;
        if (last) tickets[blockIdx.x] = 0;  // every split has taken its ticket
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int r = blockIdx.x * 128 + threadIdx.x;
    if (r >= N) return;
    for (int m = 0; m < M; ++m) {
        float s = 0.0f;
        for (int j = 0; j < splits; ++j) s += __ldcg(part + ((i64)j * M + m) * N + r);
        y[(i64)m * N + r] = s;
    }
}
