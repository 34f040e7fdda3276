// The vision tower's ops (docs/vision.md): bias add, tanh-GELU, 2-D RoPE, the non-causal
// attention over one image's patches, and the 2x2 patch merge. Images are small (hundreds of
// patches), so these stay simple; the tower's matmuls go through the dense GEMM path.
#include "common.cuh"

// x[r, c] += b[c] for n = rows * cols elements (grid-stride).
extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ b, i64 n, int cols) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] += b[i % cols];
}

// x = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in place (torch's approximate="tanh").
extern "C" __global__ void gelu_tanh_f32(float* __restrict__ x, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
}

// q and k of qkv [n, 3 * heads * hd] rotated by 2-D RoPE into qk [2, heads, n, hd] (head-major,
// so the attention reads each head's keys contiguously). The first hd/2 dims of a head rotate
// with the patch's grid row (i / grid_w), the rest with its column; inside each half, dims e and
// e + hd/4 form a rotate-half pair turned by pos * theta^(-e / (hd/4)). Angles in double, as
// the reference and the CPU backend compute them. One thread per output element.
extern "C" __global__ void vision_rope_f32(const float* __restrict__ qkv, float* __restrict__ qk, int n, int heads,
                                           int hd, int grid_w, float theta) {
    const i64 total = 2LL * heads * n * hd;
    const int half = hd / 2, quarter = hd / 4, width = heads * hd;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < total; t += (i64)gridDim.x * blockDim.x) {
        const int d = (int)(t % hd);
        const int i = (int)((t / hd) % n);
        const int h = (int)((t / ((i64)hd * n)) % heads);
        const int s = (int)(t / ((i64)hd * n * heads));  // 0: q, 1: k
        const int pos = d < half ? i / grid_w : i % grid_w;
        const int e = d % half, f = e % quarter;
        const float* src = qkv + (i64)i * 3 * width + s * width + h * hd + (d - e);
        const double a = (double)pos * pow((double)theta, -(double)f / (double)quarter);
        const float c = (float)cos(a), sn = (float)sin(a);
        const float x1 = src[f], x2 = src[f + quarter];
        qk[t] = e < quarter ? x1 * c - x2 * sn : x2 * c + x1 * sn;
    }
}

#define VISION_MAX_HD 256
#define VISION_WARPS 4

// o [n, heads * hd] = softmax(q k^T / sqrt(hd)) v per head over all n patches (non-causal).
// q, k from vision_rope_f32's qk; v straight from qkv. One warp per (query, head): lane l holds
// dims l, l + 32, ... of the query and of its output; keys are visited in order with an online
// softmax (running max and sum), the score of each a warp-wide dot product.
extern "C" __global__ void __launch_bounds__(VISION_WARPS * K3_WARP)
    vision_attention_f32(const float* __restrict__ qk, const float* __restrict__ qkv, float* __restrict__ out, int n,
                         int heads, int hd) {
    const int lane = threadIdx.x & (K3_WARP - 1);
    const int i = blockIdx.x * VISION_WARPS + threadIdx.x / K3_WARP;
    const int h = blockIdx.y;
    if (i >= n || h >= heads) return;  // whole warps exit together
    const int width = heads * hd;
    const int per = (hd + K3_WARP - 1) / K3_WARP;
    const float* q = qk + ((i64)h * n + i) * hd;
    const float* kbase = qk + ((i64)heads + h) * n * hd;
    const float scale = rsqrtf((float)hd);
    float qr[VISION_MAX_HD / K3_WARP], acc[VISION_MAX_HD / K3_WARP];
#pragma unroll
    for (int r = 0; r < VISION_MAX_HD / K3_WARP; r++) {
        const int d = lane + r * K3_WARP;
        qr[r] = r < per && d < hd ? q[d] : 0.0f;
        acc[r] = 0.0f;
    }
    float m = K3_NEG_INF, z = 0.0f;
    for (int j = 0; j < n; j++) {
        const float* k = kbase + (i64)j * hd;
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < VISION_MAX_HD / K3_WARP; r++) {
            const int d = lane + r * K3_WARP;
            if (r < per && d < hd) s += qr[r] * k[d];
        }
        s = warp_sum(s) * scale;
        const float m2 = fmaxf(m, s);
        const float corr = __expf(m - m2), p = __expf(s - m2);
        z = z * corr + p;
        const float* v = qkv + (i64)j * 3 * width + 2 * width + h * hd;
#pragma unroll
        for (int r = 0; r < VISION_MAX_HD / K3_WARP; r++) {
            const int d = lane + r * K3_WARP;
            if (r < per && d < hd) acc[r] = acc[r] * corr + p * v[d];
        }
        m = m2;
    }
    float* o = out + (i64)i * width + h * hd;
#pragma unroll
    for (int r = 0; r < VISION_MAX_HD / K3_WARP; r++) {
        const int d = lane + r * K3_WARP;
        if (r < per && d < hd) o[d] = acc[r] / z;
    }
}

// x [grid_h * grid_w, cols] -> y [(grid_h / merge) * (grid_w / merge), merge * merge * cols]:
// each merge x merge block of patches (blocks row-major) concatenated, patches row-major inside.
extern "C" __global__ void merge_patches_f32(const float* __restrict__ x, float* __restrict__ y, int grid_h, int grid_w,
                                             int cols, int merge) {
    const int bw = grid_w / merge, out_cols = merge * merge * cols;
    const i64 total = (i64)(grid_h / merge) * bw * out_cols;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < total; t += (i64)gridDim.x * blockDim.x) {
        const int c = (int)(t % out_cols), b = (int)(t / out_cols);
        const int sub = c / cols, cc = c % cols;
        const int row = (b / bw) * merge + sub / merge, col = (b % bw) * merge + sub % merge;
        y[t] = x[((i64)row * grid_w + col) * cols + cc];
    }
}
