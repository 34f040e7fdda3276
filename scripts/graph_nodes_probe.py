# On the H200: whether graph memory nodes (cudaMallocAsync / cudaFreeAsync captured around each
# kernel, as a captured k3serve decode step holds them) cost launch time on the host or time on
# the GPU, against the same 325 kernels on fixed buffers (performance-history.md, call DM).
#   python3 scripts/graph_nodes_probe.py
import time, cupy as cp
src = r'''extern "C" __global__ void f(float* x, int n, int spin){
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.f;
  for (int s = 0; s < spin; ++s) v = v * 0.999f + 1.0f;
  if (i < n) x[i] = v; }'''
k = cp.RawKernel(src, 'f')
s = cp.cuda.Stream(non_blocking=True)
rt = cp.cuda.runtime
NK = 325
def build(mode, blocks, spin):
    n = blocks * 128
    fixed = [rt.malloc(n * 4) for _ in range(4)]
    with s:
        s.begin_capture()
        prev = None
        for i in range(NK):
            if mode == "alloc":
                p = rt.mallocAsync(n * 4, s.ptr)
            else:
                p = fixed[i % 4]
            k((blocks,), (128,), (cp.uint64(p), cp.int32(n), cp.int32(spin)))
            if mode == "alloc" and prev is not None:
                rt.freeAsync(prev, s.ptr)
            prev = p
        if mode == "alloc":
            rt.freeAsync(prev, s.ptr)
        g = s.end_capture()
    return g
for blocks, spin in ((1, 0), (132, 0), (264, 200)):
    for mode in ("fixed", "alloc", "fixed", "alloc"):
        g = build(mode, blocks, spin)
        g.launch(s); s.synchronize()
        host = []
        for _ in range(50):
            t = time.perf_counter(); g.launch(s); host.append(time.perf_counter() - t); s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(100): g.launch(s)
        e1.record(s); e1.synchronize()
        gpu = cp.cuda.get_elapsed_time(e0, e1) / 100
        host.sort()
        print(f"{mode:5s} blocks={blocks:3d} spin={spin:3d}: launch host p50 {host[25]*1e6:7.1f} us, GPU per replay {gpu*1e3:7.1f} us ({NK} kernels)", flush=True)
