#!/usr/bin/env python3
"""Op-level correctness checks and benchmarks of kernels/*.cu on a GPU (scripts/device-check.sh).

Each check builds random inputs, packs them the way the Rust backend will (arena offsets, page
tables, MXFP4 bytes), launches the kernels, and compares with the PyTorch reference in
reference/k3ref (float64 on the host). Benchmarks time the kernels with CUDA events at K3 shapes
and print the memory-traffic floor and, where importable, fla's kernels.

--dry-run runs everything without a GPU: every launch is checked against the kernel's parsed C
signature (argument count, scalar types, array dtypes) and then executed by a NumPy/PyTorch
emulator that reads the same packed arguments. That leaves only the GPU itself new on the device.

The emulators live in emulators.py, the benchmarks in benchmarks.py (the routed experts' in
benchmarks_moe.py), the routed-expert checks in
checks_moe.py, the ReplaySSM checks (and their two kernels' emulators) in checks_kda_replay.py, and
what they share (log, arena layout, KDA reference and prefill launches) in common.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Sibling modules (plain imports: run as a script, this folder is already sys.path[0]). common
# puts reference/ on sys.path for k3ref.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks import bench  # noqa: E402
from common import (KDA_CHUNK_TOL, KDA_DECODE_VARIANTS, KDA_PREP, KDA_SCAN_KERNELS, LOG, ROOT, cdiv,  # noqa: E402
                    kda_decode_launcher, kda_reference, kda_region_floats, log, pack_kda_region, rel_err, run_kda_prefill, unpack_kda_region)
from common import mla_prefill_plan, run_mla_prefill  # noqa: E402
from common import gemv_tc_plan, run_gemv_tc  # noqa: E402
from checks_moe import (check_moe, check_moe_gemm,  # noqa: E402
                        check_moe_single_token, check_moe_few_tokens, check_moe_tc_shapes, check_moe_wg, check_moe_wg_repeat)
from common import rand  # noqa: E402
from checks_kda_replay import check_kda_verify  # noqa: E402
from checks_vision import check_vision  # noqa: E402
from emulators import EMU  # noqa: E402
from k3ref.attnres import attn_res as ref_attn_res  # noqa: E402
from k3ref.moe import route as ref_route  # noqa: E402
from k3ref.norm import rms_norm as ref_rms_norm  # noqa: E402
from k3ref.situ import situ_glu as ref_situ_glu  # noqa: E402

KERNELS = ROOT / "kernels"
# host/kernels/src/key.rs NVRTC_OPTIONS: the harness compiles exactly as the backend does.
NVRTC_OPTIONS = ("--std=c++17", "-default-device")


def needs_arch_specific(f: Path) -> bool:
    """wgmma / setmaxnreg exist only on the arch-specific target (sm_90a), which CuPy never passes:
    such files go through Device._arch_module (the text with its headers: wgmma may sit in one)."""
    text = inline_includes(f)
    return "wgmma." in text or "setmaxnreg" in text


# ---------------------------------------------------------------------------------------------
# Kernel sources: inline includes (as the Rust loader does) and parse the entry points' signatures.


def inline_includes(path: Path, seen: set | None = None) -> str:
    seen = set() if seen is None else seen
    out = []
    for line in path.read_text().splitlines(keepends=True):
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc not in seen:
                seen.add(inc)
                out.append(inline_includes(inc, seen))
            continue
        out.append(line)
    return "".join(out)


# Attributes (__launch_bounds__, __cluster_dims__) may sit between `void` and the name.
ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__(?:launch_bounds|cluster_dims)__\([^)]*\)\s*)*'
                   r'(\w+)\s*\(([^)]*)\)', re.S)
SCALARS = {"int": np.int32, "float": np.float32, "i64": np.int64, "u32": np.uint32}
POINTEES = {"float": np.float32, "int": np.int32, "i64": np.int64, "u8": np.uint8, "u32": np.uint32,
            "unsigned short": np.uint16, "u16": np.uint16}


def parse_params(text: str) -> list[tuple[str, object]]:
    """[(name, dtype or ('ptr', dtype))] from a C parameter list."""
    params = []
    for p in (x.strip() for x in text.split(",")):
        p = re.sub(r"\b(const|__restrict__)\b", " ", p)
        m = re.match(r"(.*?)(\*?)\s*(\w+)$", " ".join(p.split()))
        base, star, name = m.group(1).strip(), m.group(2), m.group(3)
        if star or base.endswith("*"):
            params.append((name, ("ptr", POINTEES[base.rstrip("*").strip()])))
        else:
            params.append((name, SCALARS[base]))
    return params


def load_signatures() -> dict[str, tuple[Path, list]]:
    sigs = {}
    for f in sorted(KERNELS.glob("*.cu")):
        for m in ENTRY.finditer(f.read_text()):
            sigs[m.group(1)] = (f, parse_params(m.group(2)))
    return sigs


# ---------------------------------------------------------------------------------------------
# Device: real (cupy) or dry (numpy + emulators). Tensors live in torch; kernels see views.


class Device:
    def __init__(self, dry: bool):
        self.dry = dry
        self.sigs = load_signatures()
        self.tdev = "cpu" if dry else "cuda"
        self.modules = {}
        if not dry:
            import cupy as cp
            self.cp = cp

    def view(self, t: torch.Tensor):
        assert t.is_contiguous()
        return t.numpy() if self.dry else self.cp.from_dlpack(t)

    def kernel(self, name, defines=()):
        f, _ = self.sigs[name]
        key = (f, tuple(defines))
        if key not in self.modules:
            t0 = time.time()
            if defines or needs_arch_specific(f):
                self.modules[key] = self._arch_module(f, defines)
            else:
                self.modules[key] = self.cp.RawModule(code=inline_includes(f), options=NVRTC_OPTIONS)
                self.modules[key].compile()
            log(f"compiled {f.name}{' ' + ' '.join(defines) if defines else ''} in {time.time() - t0:.1f}s")
        return self.modules[key].get_function(name)

    def _arch_module(self, f: Path, defines=()):
        """NVRTC straight to a cubin for the arch-specific target (sm_90a on the H200, as
        geometry.rs nvrtc_arch): CuPy adds its own -arch=sm_90, and wgmma does not exist there."""
        try:
            from cupy_backends.cuda.libs import nvrtc
        except ImportError:  # CuPy < 10
            from cupy.cuda import nvrtc
        cc = str(self.cp.cuda.Device().compute_capability)
        arch = f"sm_{cc}a" if cc == "90" else f"sm_{cc}"
        opts = (*NVRTC_OPTIONS, f"--gpu-architecture={arch}", *defines)
        prog = nvrtc.createProgram(inline_includes(f), f.name, (), ())
        try:
            try:
                nvrtc.compileProgram(prog, opts)
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"{f.name} ({' '.join(opts)}): {e}\n{nvrtc.getProgramLog(prog)}") from None
            cubin = nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
        tag = "_".join(d.lstrip("-D").replace("=", "") for d in defines)
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"k3_{f.stem}_{arch}{'_' + tag if tag else ''}_{os.getpid()}.cubin"
        path.write_bytes(cubin)
        return self.cp.RawModule(path=str(path))

    def launch(self, name, grid, block, *args, shared_mem=0, defines=()):
        # K3_SKIP_KERNELS: kernels a first probe found hanging or wrong; their checks then fail
        # with this message instead of taking the whole run down with them.
        if name in os.environ.get("K3_SKIP_KERNELS", "").split(","):
            raise RuntimeError(f"{name}: skipped (K3_SKIP_KERNELS)")
        _, params = self.sigs[name]
        if len(args) != len(params):
            raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters")
        conv = []
        for (pname, want), a in zip(params, args):
            if isinstance(want, tuple):
                dt = getattr(a, "dtype", None)
                if dt is None or np.dtype(dt) != np.dtype(want[1]):
                    raise TypeError(f"{name}.{pname}: array of {want[1].__name__} expected, got {dt}")
                conv.append(a)
            else:
                if not isinstance(a, (int, float, np.integer, np.floating)):
                    raise TypeError(f"{name}.{pname}: scalar expected, got {type(a)}")
                conv.append(want(a))
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        block = tuple(block) if isinstance(block, (tuple, list)) else (block,)
        if self.dry:
            EMU[name](*conv)
        else:
            k = self.kernel(name, defines)
            # cupy's RawKernel takes no new attributes: the opted-in sizes live here, per kernel.
            opted = self.__dict__.setdefault("_opt_in", {})
            if shared_mem > 48 * 1024 and opted.get((name, defines), 0) < shared_mem:
                # Opt in once (as device.rs does for geometry.rs OPT_IN_SHARED), not inside a capture.
                k.max_dynamic_shared_size_bytes = shared_mem
                opted[(name, defines)] = shared_mem
            k(grid, block, tuple(conv), shared_mem=shared_mem)

    def sync(self):
        if not self.dry:
            torch.cuda.synchronize()

    def time_ms(self, fn, reps=20, warmup=3) -> float:
        """Median of per-launch-sequence times over `reps` CUDA-event measurements."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return float(np.median(times))

    def time_graph(self, fn, reps=20, inner=10) -> tuple[float, str]:
        """Median ms per call of `fn` replayed from a CUDA graph of `inner` calls: no Python launch
        overhead in the number (small decode kernels run in a few us, less than one cupy launch).
        Falls back to time_ms. fn must not create cupy views (dlpack syncs break the capture)."""
        def on_torch_stream():
            with self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    on_torch_stream()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(inner):
                    on_torch_stream()
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / inner)
            return float(np.median(times)), "graph"
        except Exception as e:  # noqa: BLE001
            log(f"graph timing failed ({type(e).__name__}: {str(e)[:160]}); eager timing")
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
            return self.time_ms(fn), "eager"


class Results:
    def __init__(self):
        self.checks, self.bench, self.failed = [], [], 0

    def check(self, name: str, err: float, tol: float):
        ok = err <= tol and math.isfinite(err)
        self.failed += not ok
        self.checks.append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
        log(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")

    def exact(self, name: str, ok: bool, detail: str = ""):
        self.failed += not ok
        self.checks.append({"name": name, "ok": ok, "detail": detail})
        log(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")


# ---------------------------------------------------------------------------------------------
# Checks (small shapes, every code path: tails, multiple sequences, scattered slots).


def check_pointwise(d: Device, r: Results, gen):
    T = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
    rows, eps = 37, 1e-5
    # 300 columns: the float4 path on the backend's 512 threads; 301: the scalar path.
    for cols, block in ((300, 512), (301, 256)):
        x, w = rand(rows, cols, gen=gen), rand(cols, gen=gen)
        y = torch.empty(rows, cols, device=d.tdev)
        d.launch("rms_norm_f32", rows, block, d.view(T(x)), d.view(T(w)), d.view(y), rows, cols, eps)
        d.sync()
        r.check(f"rms_norm cols={cols}", rel_err(y, ref_rms_norm(x, w, eps)), 1e-5)
    cols = 300

    heads, hd = 3, 128
    o, g, wn = rand(5, heads * hd, gen=gen), rand(5, heads * hd, gen=gen), rand(hd, gen=gen)
    y = torch.empty(5, heads * hd, device=d.tdev)
    d.launch("gated_head_norm_f32", cdiv(5 * heads, 4), 128, d.view(T(o)), d.view(T(g)), d.view(T(wn)), d.view(y),
             5, heads, hd, eps)
    d.sync()
    ref = (ref_rms_norm(o.view(5, heads, hd), wn, eps) * torch.sigmoid(g.view(5, heads, hd))).view(5, -1)
    r.check("gated_head_norm", rel_err(y, ref), 1e-5)

    n = 10007
    ga, up = rand(n, scale=6, gen=gen), rand(n, scale=40, gen=gen)
    for has_lin in (1, 0):
        y = torch.empty(n, device=d.tdev)
        d.launch("situ_glu_f32", cdiv(n, 256), 256, d.view(T(ga)), d.view(T(up)), d.view(y), n, 4.0, 25.0, has_lin)
        d.sync()
        r.check(f"situ_glu(lin={has_lin})", rel_err(y, ref_situ_glu(ga, up, 4.0, 25.0 if has_lin else None)), 1e-5)

    # Elementwise, over a sweep that crosses common.cuh k3_tanh's 0.125 switch (|g| / 4 and
    # |u| / 25 from 1e-7 up to saturation): the branch-free tanh must hold each value, not just
    # the norm, near the float64 SiTU.
    mag = torch.logspace(-6, 3, 4001, dtype=torch.float64)
    ga = torch.cat([mag, -mag]).float()
    up = torch.cat([mag.flip(0), mag]).float()
    for has_lin in (1, 0):
        y = torch.empty(ga.numel(), device=d.tdev)
        d.launch("situ_glu_f32", cdiv(ga.numel(), 256), 256, d.view(T(ga)), d.view(T(up)), d.view(y), ga.numel(),
                 4.0, 25.0, has_lin)
        d.sync()
        ref = ref_situ_glu(ga.double(), up.double(), 4.0, 25.0 if has_lin else None)
        big = ref.abs() > 1e-30
        worst = ((y.cpu().double() - ref).abs()[big] / ref.abs()[big]).max().item()
        r.check(f"situ_glu(lin={has_lin}) sweep 1e-6..1e3, max elementwise rel err", worst, 1e-5)

    rows_gu, inter = 7, 96
    gu = rand(rows_gu, 2 * inter, scale=6, gen=gen)
    y = torch.empty(rows_gu, inter, device=d.tdev)
    d.launch("situ_glu_packed_f32", cdiv(rows_gu * inter, 256), 256, d.view(T(gu)), d.view(y), rows_gu, inter, 4.0,
             25.0, 1)
    d.sync()
    r.check("situ_glu_packed", rel_err(y, ref_situ_glu(gu[:, :inter], gu[:, inter:], 4.0, 25.0)), 1e-5)

    p, a = T(rand(n, gen=gen)), rand(n, gen=gen)
    p0 = p.clone()
    d.launch("add_assign_f32", cdiv(n, 256), 256, d.view(p), d.view(T(a)), n)
    d.sync()
    r.check("add_assign", rel_err(p, p0.double().cpu() + a.float().double()), 1e-6)
    oo = T(rand(n, gen=gen))
    o0 = oo.clone()
    d.launch("sigmoid_mul_f32", cdiv(n, 256), 256, d.view(oo), d.view(T(a)), n)
    d.sync()
    r.check("sigmoid_mul", rel_err(oo, o0.double().cpu() * torch.sigmoid(a.float().double())), 1e-6)

    vocab, dm = 50, 64
    table = rand(vocab, dm, gen=gen)
    ids = torch.tensor([3, 0, 49, 7], dtype=torch.int32)
    out = torch.empty(4, dm, device=d.tdev)
    idv = d.view(ids.to(d.tdev)).view(np.uint32)
    d.launch("embed_rows_f32", 4, 64, d.view(T(table)), idv, d.view(out), 4, dm, vocab)
    d.sync()
    r.check("embed_rows_f32", rel_err(out, table[ids.long()]), 1e-7)
    tb = T(table).to(torch.bfloat16)
    out = torch.empty(4, dm, device=d.tdev)
    d.launch("embed_rows_bf16", 4, 64, d.view(tb.view(torch.int16)).view(np.uint16), idv, d.view(out), 4, dm, vocab)
    d.sync()
    r.check("embed_rows_bf16", rel_err(out, tb.float().cpu()[ids.long()]), 1e-7)


def check_attnres(d: Device, r: Results, gen):
    """attn_res_f32 (geometry.rs attn_res: a cluster of 8 blocks of 128 threads per row, block q on
    columns [q s, (q + 1) s), s = d / 8 rounded up to 4): 1000 columns (float4 path, a short last
    block), 1001 (the scalar path), K3's 7168 at one row, and 40 (blocks past the row's end)."""
    eps = 1e-5
    for n, dm, rows in ((1, 1000, 7), (2, 1000, 7), (9, 1000, 7), (9, 1001, 7), (9, 7168, 1), (3, 40, 5)):
        srcs = [rand(rows, dm, scale=1 + i, gen=gen) for i in range(n)]
        w = rand(dm, scale=0.05, gen=gen)
        dev = [d.view(s.float().contiguous().to(d.tdev)) for s in srcs]
        ptrs = dev + [dev[0]] * (9 - n)  # unused slots: any valid pointer, never read
        out = torch.empty(rows, dm, device=d.tdev)
        d.launch("attn_res_f32", rows * 8, 128, *ptrs, n, d.view(w.float().contiguous().to(d.tdev)), d.view(out),
                 rows, dm, eps)
        d.sync()
        ref = ref_attn_res(srcs[-1], srcs[:-1], w, torch.ones(1, dm, dtype=torch.float64), eps)
        r.check(f"attn_res(n={n}, d={dm}, rows={rows})", rel_err(out, ref), 1e-5)


def check_router_sampling(d: Device, r: Results, gen):
    """router_topk_f32 (one warp per token, 4 per 128-thread block: geometry.rs router) against
    ref_route: 5 tokens (a partial block) of 96 experts (lanes owning 2 or 3), K3's 128 / top-16 over
    9 tokens with renormalisation off, the 1024 / top-64 limit, and ties (logits rounded to a few
    values: equal scores go to the lower expert)."""
    for t, e, k, renorm, ties in ((5, 96, 8, 1, False), (9, 128, 16, 0, False), (3, 1024, 64, 1, False),
                                  (6, 128, 16, 1, True)):
        logits, bias = rand(t, e, scale=2, gen=gen), rand(e, scale=0.3, gen=gen)
        if ties:
            logits, bias = (logits * 2).round() / 2, torch.zeros(e, dtype=torch.float64)
        idx = torch.empty(t, k, dtype=torch.int32, device=d.tdev)
        w = torch.empty(t, k, device=d.tdev)
        d.launch("router_topk_f32", cdiv(t, 4), 128, d.view(logits.float().contiguous().to(d.tdev)),
                 d.view(bias.float().contiguous().to(d.tdev)), d.view(idx), d.view(w), t, e, k, renorm, 2.5)
        d.sync()
        ridx, rw, sc = ref_route(logits, torch.eye(e, dtype=torch.float64), bias, k, bool(renorm), 2.5)
        if ties:  # torch.topk does not promise which of equal scores comes first; the kernel takes the lower id
            ridx = torch.sort(sc + bias, dim=-1, descending=True, stable=True).indices[:, :k]
            rw = sc.gather(-1, ridx)
            rw = rw / (rw.sum(-1, keepdim=True) + 1e-20) * 2.5
        tag = f"T={t} E={e} top{k}" + ("" if renorm else " no renorm") + (" ties" if ties else "")
        r.exact(f"router idx {tag}", bool((idx.cpu().long() == ridx).all()))
        r.check(f"router weights {tag}", rel_err(w, rw), 1e-5)

    check_topk_rows(d, r, gen)


def ref_top_k_row(row, k):
    """The k largest finite entries as (id, value), largest first, ties to the lower id; -0 ranks
    below +0 (k3_model::top_k_of_row). Plain Python sorting, independent of the emulator."""
    import struct

    def key(v):
        b = struct.unpack("<I", struct.pack("<f", v))[0]
        return (0xFFFFFFFF - b) if b & 0x80000000 else (b | 0x80000000)
    fin = [(i, float(v)) for i, v in enumerate(row.tolist()) if math.isfinite(v)]
    fin.sort(key=lambda iv: (-key(iv[1]), iv[0]))
    return fin[:k]


def check_topk_rows(d: Device, r: Results, gen):
    """Candidate selection for sampling: exact ids, values and counts against the definition, on
    rows with heavy ties (quantised logits), -0 / +0, NaN / +-inf, fewer finite entries than k."""
    # 70001 / 163840: rows over 18 / 40 segments (equal logits across segment borders); 300: one
    # segment with fewer finite entries than k.
    for vocab, ks in ((70001, (1, 5, 64)), (163840, (1, 50, 1024)), (300, (1, 7, 1024))):
        rows = 4
        lg = (rand(rows, vocab, scale=3, gen=gen) * 4).round() / 4  # ties everywhere
        lg = lg.float()
        lg[0, 12345 % vocab] = 50.0
        lg[1, :] = 0.0
        lg[1, ::3] = -0.0
        lg[1, 7] = float("nan")
        lg[2, ::2] = float("nan")
        lg[2, 1::4] = float("-inf")
        lg[2, 3::8] = float("inf")
        lg[3, :] = float("nan")
        lg[3, 5:vocab:max(1, vocab // 40)] = torch.arange(len(range(5, vocab, max(1, vocab // 40)))).float()
        lgd = lg.contiguous().to(d.tdev)
        for k in ks:
            ids, vals, count = run_topk(d, lgd, rows, vocab, k)
            ids_h, vals_h, count_h = ids.cpu().view(rows, k), vals.cpu().view(rows, k), count.cpu()
            ok, detail = True, ""
            for row in range(rows):
                want = ref_top_k_row(lg[row], k)
                n = int(count_h[row])
                got = [(int(ids_h[row, i]), float(vals_h[row, i])) for i in range(n)]
                same = n == len(want) and all(
                    gi == wi and struct_bits(gv) == struct_bits(wv) for (gi, gv), (wi, wv) in zip(got, want))
                if not same:
                    ok, detail = False, f"row {row}: {got[:4]}... vs {want[:4]}... ({n} vs {len(want)})"
                    break
            r.exact(f"topk_rows vocab={vocab} k={k}", ok, detail)


TOPK_SEGMENT = 4096  # ops.rs TOPK_SEGMENT


def run_topk(d: Device, lgd, rows, vocab, k, seg_len=TOPK_SEGMENT):
    """ops.rs top_k_rows: per-segment picks, then the merge. Returns device (ids, vals, count)."""
    segs = cdiv(vocab, seg_len)
    seg_ids = torch.empty(rows * segs * k, dtype=torch.int32, device=d.tdev)
    seg_vals = torch.empty(rows * segs * k, device=d.tdev)
    seg_count = torch.empty(rows * segs, dtype=torch.int32, device=d.tdev)
    ids = torch.empty(rows * k, dtype=torch.int32, device=d.tdev)
    vals = torch.empty(rows * k, device=d.tdev)
    count = torch.empty(rows, dtype=torch.int32, device=d.tdev)
    no_mask = torch.empty(1, dtype=torch.uint32, device=d.tdev)  # not read with 0 mask words
    d.launch("topk_segments_f32", (segs, rows), 512, d.view(lgd), d.view(seg_ids), d.view(seg_vals),
             d.view(seg_count), rows, vocab, k, seg_len, d.view(no_mask), 0)
    d.launch("topk_merge_f32", rows, 1024, d.view(lgd), d.view(seg_ids), d.view(seg_vals), d.view(seg_count),
             d.view(ids), d.view(vals), d.view(count), rows, vocab, k, segs)
    d.sync()
    return ids, vals, count


def struct_bits(v):
    import struct
    return struct.unpack("<I", struct.pack("<f", v))[0]


def kda_inputs(t, heads, conv, gen, seqs=1):
    hk = heads * 128
    return dict(
        xq=[rand(t, hk, gen=gen) for _ in range(seqs)], xk=[rand(t, hk, gen=gen) for _ in range(seqs)],
        xv=[rand(t, hk, gen=gen) for _ in range(seqs)], f=[rand(t, hk, gen=gen) for _ in range(seqs)],
        b=[rand(t, heads, gen=gen) for _ in range(seqs)],
        convw=[rand(hk, conv, scale=0.5, gen=gen) for _ in range(3)],
        a_log=rand(heads, scale=0.5, gen=gen), dt_bias=rand(hk, scale=0.5, gen=gen),
        windows=[[rand(hk, conv - 1, gen=gen) for _ in range(3)] for _ in range(seqs)],
        S0=[rand(heads, 128, 128, scale=0.1, gen=gen) for _ in range(seqs)])


def check_kda_decode(d: Device, r: Results, gen):
    heads, conv, lb, n = 3, 4, -5.0, 3
    hk, reg = heads * 128, kda_region_floats(heads * 128, conv, heads)
    inp = kda_inputs(1, heads, conv, gen, seqs=n)
    # Scattered slots: seq i at slot order [2, 0, 3], checkpoint of seq 1 into slot 1.
    # Slot 2 is only 4-byte aligned (the kernel's scalar path), the others 16-byte aligned (float4).
    slots = [2, 0, 3]
    at = lambda s: 8 + s * (reg + 4) + (3 if s == 2 else 0)  # noqa: E731
    arena = torch.zeros(5 * (reg + 4) + 16, dtype=torch.float64)
    offs = [at(s) for s in slots]
    for i in range(n):
        pack_kda_region(arena, offs[i], inp["windows"][i], inp["S0"][i])
    ck = [-1, at(1), -1]
    refs = [kda_reference(inp["xq"][i], inp["xk"][i], inp["xv"][i], inp["f"][i], inp["b"][i], inp["convw"],
                          inp["a_log"], inp["dt_bias"], inp["windows"][i], inp["S0"][i], heads, lb) for i in range(n)]
    F32 = lambda xs: torch.cat([x for x in xs]).float().contiguous().to(d.tdev)  # noqa: E731
    outs = {}
    for variant in KDA_DECODE_VARIANTS:  # all from the same arena
        A = arena.float().to(d.tdev)
        o = torch.empty(n, hk, device=d.tdev)
        args = [d.view(F32(inp["xq"])), d.view(F32(inp["xk"])), d.view(F32(inp["xv"])), d.view(F32(inp["f"])),
                d.view(F32(inp["b"]))] + [d.view(w.float().contiguous().to(d.tdev)) for w in inp["convw"]] + [
            d.view(inp["a_log"].float().to(d.tdev)), d.view(inp["dt_bias"].float().to(d.tdev)), d.view(A),
            d.view(torch.tensor(offs, dtype=torch.int64).to(d.tdev)),
            d.view(torch.tensor(ck, dtype=torch.int64).to(d.tdev)), d.view(o), n, heads, conv, lb]
        kda_decode_launcher(d, variant, heads, n, args)()
        d.sync()
        A, o = A.cpu(), o.cpu()
        outs[variant] = (A, o)
        A = A.double()
        eo, es, ew = 0.0, 0.0, 0.0
        for i in range(n):
            ro, rS, rw, _ = refs[i]
            gw, gS = unpack_kda_region(A, offs[i], hk, conv, heads)
            eo = max(eo, rel_err(o[i:i + 1], ro))
            es = max(es, rel_err(gS, rS))
            ew = max(ew, max(rel_err(a, b) for a, b in zip(gw, rw)))
            if ck[i] >= 0:
                cw, cS = unpack_kda_region(A, ck[i], hk, conv, heads)
                es = max(es, rel_err(cS, rS))
                ew = max(ew, max(rel_err(a, b) for a, b in zip(cw, rw)))
        tag = "kda_decode" if variant == KDA_DECODE_VARIANTS[0] else f"kda_decode {variant}"
        r.check(f"{tag} o", eo, 2e-5)
        r.check(f"{tag} state (+checkpoint)", es, 2e-5)
        r.check(f"{tag} windows (+checkpoint)", ew, 1e-6)


def check_kda_prefill(d: Device, r: Results, gen, chunk="f32", prep=KDA_PREP, conv=4, seg=None, cases=None):
    heads, lb = 2, -5.0
    hk, reg = heads * 128, kda_region_floats(heads * 128, conv, heads)
    tag = "kda_prefill" if chunk == "f32" else f"kda_prefill[{chunk}]"
    if prep != KDA_PREP or conv != 4:
        tag += f"[prep={prep},conv={conv}]"
    if seg:
        tag += f"[seg={seg}]"
    extra = {"seg": seg} if seg else {}
    tol = KDA_CHUNK_TOL[chunk]
    cases = cases or ((45, [1, 16, 30, 45]), (16, []), (3, [2])) + (((2, [1]),) if conv == 4 else ())
    for t, emit in cases:
        inp = kda_inputs(t, heads, conv, gen)
        arena = torch.zeros((len(emit) + 1) * reg, dtype=torch.float64)
        off = len(emit) * reg  # the working slot is the last; checkpoint j goes to slot j
        pack_kda_region(arena, off, inp["windows"][0], inp["S0"][0])
        ck_off = [j * reg for j in range(len(emit))]
        A = arena.float().to(d.tdev)
        o, go = run_kda_prefill(d, t, heads, conv, lb, A, off, emit, ck_off, inp["xq"][0], inp["xk"][0], inp["xv"][0],
                                inp["f"][0], inp["b"][0], inp["convw"], inp["a_log"], inp["dt_bias"], chunk, prep,
                                **extra)
        go()
        d.sync()
        ro, rS, rw, em = kda_reference(inp["xq"][0], inp["xk"][0], inp["xv"][0], inp["f"][0], inp["b"][0], inp["convw"],
                                       inp["a_log"], inp["dt_bias"], inp["windows"][0], inp["S0"][0], heads, lb, emit)
        A = A.double().cpu()
        gw, gS = unpack_kda_region(A, off, hk, conv, heads)
        r.check(f"{tag} T={t} o", rel_err(o, ro), tol)
        r.check(f"{tag} T={t} state", rel_err(gS, rS), tol)
        r.check(f"{tag} T={t} windows", max(rel_err(a, b) for a, b in zip(gw, rw)), 1e-6)
        for slot, n in zip(ck_off, emit):
            cw, cS = unpack_kda_region(A, slot, hk, conv, heads)
            eS, eW = em[n]
            r.check(f"{tag} T={t} checkpoint n={n}", max(rel_err(cS, eS),
                    max(rel_err(a, b) for a, b in zip(cw, eW))), tol)


def check_kda_prefill_scan(d: Device, r: Results, gen):
    """The two-pass path (record pass + scan with the state in mma registers; 3xTF32: the f32
    tolerances hold), each record-pass variant: tails, checkpoints, chained 16-token segments, conv
    widths; and the one-pass f32 path at conv > 4 (where ops.rs always takes it)."""
    check_kda_prefill(d, r, gen, prep="split", conv=6)
    for scan in KDA_SCAN_KERNELS:
        check_kda_prefill(d, r, gen, chunk=scan)
        check_kda_prefill(d, r, gen, chunk=scan, seg=16)
        for conv in (2, 3):
            check_kda_prefill(d, r, gen, chunk=scan, conv=conv)
        # Several 8-chunk record blocks: conv history from the inputs at a block start, checkpoints
        # inside a block and on a block boundary, a 12-token tail.
        check_kda_prefill(d, r, gen, chunk=scan, cases=((300, [100, 128, 131, 300]),))


def check_kda_prefill_conv(d: Device, r: Results, gen):
    """The one-pass f32 kernels (conv + SiLU, prep, chunk) at other conv widths."""
    for conv in (3, 2):  # (conv 1 has no window; the checks below would compare empty tensors)
        check_kda_prefill(d, r, gen, conv=conv)


def mla_reference(q, rows, kv_b, heads, nope, rope, v_dim, kv_lora):
    """Expanded (naive) form for one query over rows [len, kv_lora + rope], float64."""
    c, kr = rows[:, :kv_lora], rows[:, kv_lora:]
    w = kv_b.view(heads, nope + v_dim, kv_lora)
    out = []
    for h in range(heads):
        k = torch.cat([c @ w[h, :nope].t(), kr], -1)
        v = c @ w[h, nope:].t()
        qh = q[h * (nope + rope):(h + 1) * (nope + rope)]
        a = torch.softmax(k @ qh * (nope + rope) ** -0.5, 0)
        out.append(a @ v)
    return torch.cat(out)


def check_mla(d: Device, r: Results, gen):
    for heads, nope, rope, v_dim, kv_lora, lens in ((6, 64, 32, 64, 128, [37, 70, 1]), (4, 128, 64, 128, 512, [50, 17])):
        row, pt, eps = kv_lora + rope, 16, 1e-5
        n = len(lens)
        npages = [cdiv(L, pt) for L in lens]
        total = sum(npages)
        perm = torch.randperm(total, generator=gen).tolist()  # pages scattered over the arena
        # This layer's rows start 3 rows into each page; one float further for the first shape, so
        # its rows are only 4-byte aligned (the tensor-core kernel's cp.async 4-byte path).
        layer_off = 3 * row + (1 if kv_lora == 128 else 0)
        page_floats = pt * row + 5 * row
        arena = torch.zeros(total * page_floats, dtype=torch.float64)
        page_start, pt_base, rows_all, k = [], [], [], 0
        for i, L in enumerate(lens):
            pt_base.append(len(page_start))
            for p in range(npages[i]):
                page_start.append(perm[k] * page_floats + layer_off)
                k += 1
            rows_all.append(rand(L, row, gen=gen))
        # Cached rows 0..L-2 are packed here; row L-1 is appended by the kernel from kv_a.
        kv_a = rand(n, row, gen=gen)
        norm_w = rand(kv_lora, gen=gen)
        dst = []
        for i, L in enumerate(lens):
            rows_all[i][L - 1] = torch.cat([ref_rms_norm(kv_a[i, :kv_lora], norm_w, eps), kv_a[i, kv_lora:]])
            for j in range(L):
                o = page_start[pt_base[i] + j // pt] + (j % pt) * row
                if j < L - 1:
                    arena[o:o + row] = rows_all[i][j]
                else:
                    dst.append(o)
        kv_b = rand(heads * (nope + v_dim), kv_lora, scale=kv_lora ** -0.5, gen=gen)
        q = rand(n, heads * (nope + rope), gen=gen)
        dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        A = dev(arena)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64).to(d.tdev)  # noqa: E731
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(d.tdev)  # noqa: E731
        d.launch("mla_append_rows_f32", n, 128, d.view(dev(kv_a)), d.view(dev(norm_w)), d.view(A), d.view(i64(dst)), n,
                 kv_lora, rope, eps)
        qt = torch.empty(n, heads, row, device=d.tdev)
        kvb = dev(kv_b)
        d.launch("mla_absorb_q_f32", (n, heads), 128, d.view(dev(q)), d.view(kvb), d.view(qt), n, heads, nope, rope,
                 v_dim, kv_lora)
        d.sync()
        Ah = A.double().cpu()
        r.check(f"mla append (Lkv={kv_lora})", max(rel_err(Ah[x:x + row], rows_all[i][lens[i] - 1])
                                                   for i, x in enumerate(dst)), 1e-5)
        ref = torch.stack([mla_reference(q[i], rows_all[i], kv_b, heads, nope, rope, v_dim, kv_lora) for i in range(n)])
        # mla_attend_tf32_f32 (mode = precision | prefetch tiles << 2) + mla_merge_f32 + mla_out_proj_f32.
        # precise = 3xTF32 (~f32, what the backend uses); fast = 1xTF32 (TF32 rounds to 11 significant
        # bits: ~1e-3 expected, 1e-2 allowed); mixed = 3xTF32 scores, 1xTF32 P V.
        # "per-item chunk" passes chunk 0: each item splits its own length (what ops.rs does, so
        # decode launches stay equal from step to step for CUDA graphs).
        for label, splits, tol, mode in (("precise", 3, 1e-4, 1 | 4 << 2), ("fast", 2, 1e-2, 0 | 4 << 2),
                                         ("precise pf0", 1, 1e-4, 1), ("mixed", 3, 1e-3, 3 | 4 << 2),
                                         ("precise per-item chunk", 4, 1e-4, 1 | 4 << 2)):
            chunk = 0 if "per-item" in label else cdiv(max(lens), splits)
            part = torch.empty(n, heads, splits, kv_lora + 2, device=d.tdev)
            d.launch("mla_attend_tf32_f32", (cdiv(heads, 16), n, splits), 256, d.view(qt), d.view(A),
                     d.view(i64(page_start)), d.view(i32(pt_base)), d.view(i32(lens)), d.view(part), n, heads, kv_lora,
                     rope, pt, splits, chunk, (nope + rope) ** -0.5, mode)
            lat = torch.empty(n, heads, kv_lora, device=d.tdev)
            d.launch("mla_merge_f32", (n, heads, cdiv(kv_lora, 128)), 128, d.view(part), d.view(lat), n, heads,
                     kv_lora, splits)
            o = torch.empty(n, heads * v_dim, device=d.tdev)
            d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(n, 64)), 256, d.view(lat), d.view(kvb),
                     d.view(o), n, heads, nope, v_dim, kv_lora)
            d.sync()
            r.check(f"mla decode tf32 {label} (H={heads}, Lkv={kv_lora}, splits={splits})", rel_err(o, ref), tol)


def check_mla_bf16_products(d: Device, r: Results, gen):
    """The decode W_UK / W_UV products on bf16 kv_b (mla_absorb_q_bf16, mla_out_proj_bf16; ops.rs
    mla_decode's path for a bf16 kv_b) against float64, f32 accuracy (x in three bf16 pieces, as in
    gemv_bf16_tc_f32): K3 per-head dims, k3-mini's, and an odd shape (two 128-row nope passes,
    kv_lora not a multiple of the 32-column chunk or the 128-column block, v_dim not a multiple of
    32); N across the two n8 tiles of a pass, and past 64 (two out_proj reduction passes). Outputs
    start as NaN: every element must be written."""
    dev = lambda t: t.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda t: d.view(t).view(np.uint16)  # noqa: E731
    for heads, nope, rope, v_dim, kv_lora, ns in ((3, 128, 64, 128, 512, (1, 3, 17, 64)),
                                                  (2, 64, 32, 64, 128, (1, 3, 17, 64)),
                                                  (2, 256, 32, 40, 200, (1, 17, 70))):
        w = rand(heads * (nope + v_dim), kv_lora, scale=kv_lora ** -0.5, gen=gen).float().to(torch.bfloat16)
        wb, wd = dev(w.view(torch.int16)), w.double().view(heads, nope + v_dim, kv_lora)
        row = kv_lora + rope
        for n in ns:
            q, lat = rand(n, heads, nope + rope, gen=gen), rand(n, heads, kv_lora, gen=gen)
            qt = dev(torch.full((n, heads, row), float("nan")))
            o = dev(torch.full((n, heads * v_dim), float("nan")))
            d.launch("mla_absorb_q_bf16", (cdiv(kv_lora, 128), heads), 128, d.view(dev(q.float())), u16(wb),
                     d.view(qt), n, heads, nope, rope, v_dim, kv_lora)
            d.launch("mla_out_proj_bf16", (cdiv(v_dim, 32), heads), 128, d.view(dev(lat.float())), u16(wb),
                     d.view(o), n, heads, nope, v_dim, kv_lora)
            d.sync()
            ref_qt = torch.cat([torch.einsum("nhp,hpl->nhl", q[..., :nope], wd[:, :nope]), q[..., nope:]], -1)
            ref_o = torch.einsum("nhl,hvl->nhv", lat, wd[:, nope:]).reshape(n, heads * v_dim)
            shape = f"H={heads} nope={nope} v={v_dim} Lkv={kv_lora} N={n}"
            r.check(f"mla_absorb_q_bf16 {shape}", rel_err(qt, ref_qt), 1e-5)
            r.check(f"mla_out_proj_bf16 {shape}", rel_err(o, ref_o), 1e-5)


# kernels/mla_attend_bf16.cu: 48 heads per 256-thread block, dynamic shared memory (geometry.rs
# MLA_BF16_SHARED: Q, two K tiles, score partials, P).
MLA_BF16_HEADS, MLA_BF16_SHARED = 48, 165568
# kernels/mla_attend_pair_wgmma.cu (wgmma, sm_90a): 48 heads per 384-thread block (geometry.rs MLA_WG_SHARED:
# Q^T, two 64-position bf16 tiles, P^T, scores, + 1 KB to align the base).
MLA_WG_HEADS, MLA_WG_THREADS, MLA_WG_SHARED = 48, 384, 223168
# mla_attend_pair_wgmma_f32 (same file): clusters of 2 blocks, grid x rounded up to pairs (geometry.rs
# mla_attend_pair_wgmma, MLA_WGMMA_SHARED: + 4 mbarriers).
MLA_WGMMA_SHARED = 223200


def mla_latent_reference(qt, rows, scale, kv_lora):
    """Latent attention of one item, float64: softmax(rows . q~_h * scale) @ rows[:, :kv_lora] -> [H, kv_lora]."""
    a = torch.softmax(qt.double() @ rows.double().T * scale, -1)
    return a @ rows.double()[:, :kv_lora]


def check_mla_bf16(d: Device, r: Results, gen):
    """mla_attend_bf16_f32 and mla_attend_pair_wgmma_f32 (wgmma, 64-position tiles, on
    2-block clusters, each block loading half of every tile; heads 4 / 6 leave the second block of the
    pair without heads), each + mla_merge_f32 (the
    latent o~, before W_UV), against (a) the float64 latent attention: bf16 rounding of q~, the rows and
    P allows 1e-2 (max-normalised; ~2.5e-3 seen), and (b) emulators._emu_mla_attend_bf16 run on the host
    at the kernel's tile (the same bf16 roundings): 2e-3, what f32 accumulation order, __expf and the
    rare bf16 rounding flips of P leave. In --dry-run the kernel *is* that emulator, so (b) only checks
    the plumbing there. Cases: several items of different lengths (not multiples of the tile, one of 1,
    one split with 1 position in its last tile), small pages (4 and 16 tokens: tiles cross pages), head
    counts that are not a multiple of 48 (the second head group partial; 4 and 6: one group mostly
    zero), rows only 4-byte aligned, K3 row width, long items with several splits (ops.rs per-item
    chunk 0) so the wg kernel's two-tile ring wraps (8 tiles in one split), and an item shorter than
    its split count (an empty split: o~ 0, m -inf, l 0). The wg kernels' final_rows path runs on every
    per-item case (check_mla_final_rows)."""
    from emulators import _emu_mla_attend_bf16
    cases = (  # heads, kv_lora, rope, page_tokens, lens, splits, chunk, aligned
        (6, 128, 32, 4, [37, 70, 1], 2, 0, False),
        (52, 512, 64, 16, [50, 17, 33], 1, 0, True),
        (4, 512, 64, 16, [700, 95], 5, 0, True),
        (96, 512, 64, 64, [300], 3, 128, True),
        (52, 512, 64, 16, [1000, 130], 2, 0, True),
        (96, 512, 64, 16, [200, 3], 4, 0, True),
    )
    kernels = (("bf16", "mla_attend_bf16_f32", 32, MLA_BF16_HEADS, 256, MLA_BF16_SHARED),
               ("pair", "mla_attend_pair_wgmma_f32", 64, 2 * MLA_WG_HEADS, MLA_WG_THREADS, MLA_WGMMA_SHARED))
    for heads, kv_lora, rope, pt, lens, splits, chunk, aligned in cases:
        row, n = kv_lora + rope, len(lens)
        npages = [cdiv(L, pt) for L in lens]
        perm = torch.randperm(sum(npages), generator=gen).tolist()
        layer_off = 2 * row + (0 if aligned else 1)
        page_floats = pt * row + 3 * row
        arena = torch.zeros(sum(npages) * page_floats, dtype=torch.float64)
        page_start, pt_base, rows_all, k = [], [], [], 0
        for i, L in enumerate(lens):
            pt_base.append(len(page_start))
            page_start += [perm[k + p] * page_floats + layer_off for p in range(npages[i])]
            k += npages[i]
            rows_all.append(rand(L, row, gen=gen).float())
            for j in range(L):
                o = page_start[pt_base[i] + j // pt] + (j % pt) * row
                arena[o:o + row] = rows_all[i][j].double()
        qt = (rand(n, heads, row, gen=gen) * 0.3).float()
        scale = 192 ** -0.5
        dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        ps = torch.tensor(page_start, dtype=torch.int64)
        base, lens_t = torch.tensor(pt_base, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        A = dev(arena)
        ref = torch.stack([mla_latent_reference(qt[i], rows_all[i], scale, kv_lora) for i in range(n)])
        tag = f"H={heads}, Lkv={kv_lora}, pages of {pt}, lens={lens}, splits={splits}, chunk={chunk}" + \
            ("" if aligned else ", 4-byte rows")
        for label, kname, tile, hpb, threads, smem in kernels:
            emu_part = np.zeros((n, heads, splits, kv_lora + 2), dtype=np.float32)
            _emu_mla_attend_bf16(qt.numpy(), arena.float().numpy(), ps.numpy(), base.numpy(), lens_t.numpy(),
                                 emu_part, n, heads, kv_lora, rope, pt, splits, chunk, np.float32(scale), tile=tile)
            P = torch.from_numpy(emu_part).double()
            w = torch.exp(P[..., kv_lora] - P[..., kv_lora].amax(-1, keepdim=True))
            emu = (w[..., None] * P[..., :kv_lora]).sum(2) / (w * P[..., kv_lora + 1]).sum(-1)[..., None]
            part = torch.full((n, heads, splits, kv_lora + 2), float("nan"), device=d.tdev)
            gx = cdiv(heads, hpb) * (2 if kname == "mla_attend_pair_wgmma_f32" else 1)  # pair: pairs of 48
            ins = (d.view(dev(qt)), d.view(A), d.view(ps.to(d.tdev)), d.view(base.to(d.tdev)),
                   d.view(lens_t.to(d.tdev)))
            fin = (0,) if label != "bf16" else ()  # the wg kernels' final_rows flag

            def attend(out, sp, fin=fin):
                d.launch(kname, (gx, n, sp), threads, *ins, d.view(out), n, heads, kv_lora, rope, pt, sp, chunk,
                         scale, *fin, shared_mem=smem)
            attend(part, splits)
            lat = torch.full((n, heads, kv_lora), float("nan"), device=d.tdev)
            d.launch("mla_merge_f32", (n, heads, cdiv(kv_lora, 128)), 128, d.view(part), d.view(lat), n, heads,
                     kv_lora, splits)
            d.sync()
            r.check(f"mla attend {label} vs float64 ({tag})", rel_err(lat, ref), 1e-2)
            r.check(f"mla attend {label} vs bf16 emulation ({tag})", rel_err(lat, emu), 2e-3)
            if min(lens) < splits:  # some split is empty: the exact partials the merge expects
                ph = part.cpu()
                ch = [chunk if chunk > 0 else cdiv(L, splits) for L in lens]
                empty = [(i, s) for i, L in enumerate(lens) for s in range(splits) if s * ch[i] >= L]
                ok = all(bool((ph[i, :, s, :kv_lora] == 0).all()) and bool((ph[i, :, s, kv_lora] == float("-inf")).all())
                         and bool((ph[i, :, s, kv_lora + 1] == 0).all()) for i, s in empty)
                r.exact(f"mla attend {label} empty splits write (0, -inf, 0) ({tag})", ok and bool(empty),
                        f"{len(empty)} empty")
            if fin and chunk == 0:
                check_mla_final_rows(d, r, tag, label, attend, part, lat, ref, n, heads, kv_lora)


def check_mla_final_rows(d: Device, r: Results, tag, label, attend, part, lat, ref, n, heads, kv_lora):
    """The wg kernels' final_rows = 1 (ops.rs when one split fills the GPU): the latent straight from
    the attend must be mla_merge_f32's answer for 1 split bitwise on the GPU (the same o~ * (1 / l)),
    and with more than one split the kernel writes nothing (its contract). In --dry-run the merge
    emulator divides in float64, hence 1e-6 there."""
    p1 = torch.full((n, heads, 1, kv_lora + 2), float("nan"), device=d.tdev)
    attend(p1, 1)
    d.launch("mla_merge_f32", (n, heads, cdiv(kv_lora, 128)), 128, d.view(p1), d.view(lat), n, heads, kv_lora, 1)
    rows = torch.full((n, heads, kv_lora), float("nan"), device=d.tdev)
    attend(rows, 1, fin=(1,))
    untouched = torch.full((n, heads, kv_lora), float("nan"), device=d.tdev)
    attend(untouched, 2, fin=(1,))
    d.sync()
    r.check(f"mla attend {label} final rows vs float64 ({tag})", rel_err(rows, ref), 1e-2)
    if d.dry:
        r.check(f"mla attend {label} final rows vs 1 split + merge ({tag})", rel_err(rows, lat), 1e-6)
    else:
        r.exact(f"mla attend {label} final rows == 1 split + merge, bitwise ({tag})", bool(torch.equal(rows, lat)),
                f"max |diff| {float((rows - lat).abs().max()):.3g}")
    r.exact(f"mla attend {label} final rows with 2 splits writes nothing ({tag})",
            bool(torch.isnan(untouched).all()), "written")


def mla_prefill_reference(q, rows, kv_b, heads, nope, rope, v_dim, kv_lora, start):
    """Expanded causal MLA, float64: queries q [T, H*(nope+rope)] at positions start.. over the latent
    rows [start + T, kv_lora + rope]. Returns o [T, H*v_dim]."""
    t, length, qk = q.shape[0], rows.shape[0], nope + rope
    c, kr = rows[:, :kv_lora], rows[:, kv_lora:]
    w = kv_b.view(heads, nope + v_dim, kv_lora)
    hidden = torch.arange(length)[None, :] > (start + torch.arange(t))[:, None]
    out = []
    for h in range(heads):
        k = torch.cat([c @ w[h, :nope].t(), kr], -1)
        s = (q[:, h * qk:(h + 1) * qk] @ k.t()) * qk ** -0.5
        out.append(torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ (c @ w[h, nope:].t()))
    return torch.stack(out, 1).reshape(t, heads * v_dim)


def check_mla_prefill(d: Device, r: Results, gen):
    """Expanded MLA prefill (kernels/mla_prefill.cu + the cuBLAS calls of mla_prefill.rs, launched by
    common.run_mla_prefill as the backend does) vs the float64 expanded form: new rows appended by
    mla_append_rows_f32 after a cached prefix (start > 0), T not a multiple of the query chunk,
    head groups with a smaller last one, the sequence's rows at row0 > 0 of q / o (mla_seqs_split
    writes into a shared o), the default plan, and one row of > 8192 keys (the softmax's
    two-read path)."""
    cases = (  # heads, nope, rope, v_dim, kv_lora, start, T, plan (head_group, q_chunk) or None
        (6, 64, 32, 64, 128, 0, 45, (4, 16)),
        (6, 64, 32, 64, 128, 37, 29, (6, 8)),
        (4, 128, 64, 128, 512, 50, 70, None),
        (2, 32, 16, 32, 64, 8300, 70, (1, 32)))
    for heads, nope, rope, v_dim, kv_lora, start, t, plan in cases:
        row, pt, eps, row0, qk = kv_lora + rope, 16, 1e-5, 3, nope + rope
        length = start + t
        npages = cdiv(length, pt)
        perm = torch.randperm(npages, generator=gen)
        layer_off = 2 * row + 1  # 4-byte aligned rows only, as in check_mla
        page_floats = pt * row + 3 * row
        page_start = perm.to(torch.int64) * page_floats + layer_off
        rows = rand(length, row, gen=gen)
        kv_a = rand(t, row, gen=gen)
        norm_w = rand(kv_lora, gen=gen)
        rows[start:] = torch.cat([ref_rms_norm(kv_a[:, :kv_lora], norm_w, eps), kv_a[:, kv_lora:]], -1)
        j = torch.arange(length)
        offs = page_start[j // pt] + (j % pt) * row
        arena = torch.zeros(npages * page_floats, dtype=torch.float64)
        arena[(offs[:start, None] + torch.arange(row)[None, :]).reshape(-1)] = rows[:start].reshape(-1)
        kv_b = rand(heads * (nope + v_dim), kv_lora, scale=kv_lora ** -0.5, gen=gen)
        q = rand(t, heads * qk, gen=gen)
        dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        A = dev(arena)
        d.launch("mla_append_rows_f32", t, 128, d.view(dev(kv_a)), d.view(dev(norm_w)), d.view(A),
                 d.view(offs[start:].contiguous().to(d.tdev)), t, kv_lora, rope, eps)
        qf = dev(torch.cat([rand(row0, heads * qk, gen=gen), q]))
        ref = mla_prefill_reference(q, rows, kv_b, heads, nope, rope, v_dim, kv_lora, start)
        for flash in (False, True):
            if flash and ((qk % 16) or v_dim % 8):
                continue
            o = torch.zeros(row0 + t, heads * v_dim, device=d.tdev)
            go, used = run_mla_prefill(d, A, page_start.to(d.tdev), qf, dev(kv_b), o, row0, t, start, heads, nope,
                                       rope, v_dim, kv_lora, pt, plan, flash)
            go()
            d.sync()
            kind = "flash bf16" if flash else "expanded"
            tag = f"mla_prefill {kind} (H={heads}, Lkv={kv_lora}, start={start}, T={t}, group,chunk={used})"
            # bf16 mode: Q, K, V and P rounded to bf16 (8 bits), sums in f32.
            r.check(tag, rel_err(o[row0:], ref), 1e-2 if flash else 2e-5)
            r.exact(f"{tag}: rows outside the sequence untouched", bool((o[:row0] == 0).all()))
        if start == 0:  # the vectorised reference against check_mla's per-query one
            i = t - 1
            one = mla_reference(q[i], rows[:start + i + 1], kv_b, heads, nope, rope, v_dim, kv_lora)
            r.check(f"mla_prefill_reference vs mla_reference (T={t})", rel_err(ref[i], one), 1e-12)
    # The backend's plan at K3 shapes (mla_prefill.rs plan_fits_the_budget_at_k3_shapes).
    k3 = lambda t, n: mla_prefill_plan(96, 128, 64, 128, 512, t, n)  # noqa: E731
    r.exact("mla_prefill plan (K3 shapes)", (k3(2048, 2048), k3(8192, 8192)[0], k3(4096, 1 << 20)) ==
            ((96, 512), 48, (1, 16)))


def check_bf16_matmul(d: Device, r: Results, gen):
    """Dense matmul with bf16 weights (kernels/bf16.cu around the cuBLAS bf16 GEMM of
    backend_impl.rs matmul_linear; the GEMM played by an f32 matmul of the same bf16 values)."""
    m, k, n = 5, 96, 40
    x = rand(m, k, gen=gen)
    w = rand(n, k, scale=0.1, gen=gen).float().to(torch.bfloat16).double()  # bf16 checkpoint values
    dev = lambda t: t.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda t: d.view(t).view(np.uint16)  # noqa: E731
    bits_f32 = lambda t: ((t.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)  # noqa: E731
    wb = dev(w.float().to(torch.bfloat16).view(torch.int16))
    wf = dev(torch.zeros(n, k))
    d.launch("bf16_to_f32", cdiv(n * k, 256), 256, u16(wb), d.view(wf), n * k)
    xs = dev(torch.zeros(2 * m, k, dtype=torch.int16))
    d.launch("bf16_split_rows_f32", cdiv(m * k, 256), 256, d.view(dev(x.float())), u16(xs), m * k, 2)
    d.sync()
    r.check("bf16_to_f32 (exact)", rel_err(wf, w), 0.0)
    c = dev(bits_f32(xs) @ bits_f32(wb).T)
    y = dev(torch.zeros(m, n))
    d.launch("sum_row_halves_f32", cdiv(m * n, 256), 256, d.view(c), d.view(y), m * n)
    d.sync()
    r.check("matmul with bf16 weights (split activations)", rel_err(y, x @ w.T), 2e-5)


def check_gemv_tc(d: Device, r: Results, gen):
    """The tensor-core decode product (gemv_bf16_tc_f32 + gemv_sum_splits_f32) against float64, f32
    accuracy: N below / not a multiple of the 128-row block, K not a multiple of the 64-column step
    (and a short last K slice), one split and several, M across both n8 tiles of x rows; x in three
    pieces (float32 mode) and rounded once (bfloat16 mode, against float64 of the rounded x)."""
    dev = lambda t: t.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda t: d.view(t).view(np.uint16)  # noqa: E731
    for n, k, plan in ((77, 520, None), (300, 1544, None), (130, 200, (1, 256)),
                       (260, 1032, (5, 256))):
        w = rand(n, k, scale=0.1, gen=gen).float().to(torch.bfloat16)
        wb = dev(w.view(torch.int16))
        part = dev(torch.zeros(16 * 16 * n))
        for m in (1, 3, 8, 16):
            x = rand(m, k, gen=gen)
            splits = (plan or gemv_tc_plan(n, k))[0]
            for pieces in (3, 1):
                y = dev(torch.full((m, n), float("nan")))
                run_gemv_tc(d, d.view(dev(x.float())), u16(wb), d.view(y), m, n, k, d.view(part), plan, pieces)
                d.sync()
                # pieces 1 (bfloat16 mode): against float64 of x rounded to bf16 as the kernel rounds it.
                xr = x if pieces == 3 else x.float().to(torch.bfloat16).double()
                r.check(f"gemv_bf16_tc_f32 M={m} {n}x{k} splits={splits} pieces={pieces}", rel_err(y, xr @ w.double().T),
                        1e-5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check signatures, run emulators")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checks", default="", help="comma list of check functions to run (default all)")
    ap.add_argument("--only", default=os.environ.get("K3_BENCH_ONLY", ""),
                    help="comma list of benchmark sections (kda_decode,kda_prefill,mla,mla_proj,mla_prefill,attn_res,moe,gemv); "
                         "default all")
    args = ap.parse_args()
    d = Device(args.dry_run)
    r = Results()
    missing = sorted(set(d.sigs) - set(EMU))
    r.exact("every kernel has an emulator", not missing, " ".join(missing))
    gen = torch.Generator().manual_seed(args.seed)
    if not args.dry_run:
        log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__} cupy {d.cp.__version__}")
    t0 = time.time()
    for fn in (check_pointwise, check_attnres, check_router_sampling, check_kda_decode, check_kda_verify, check_kda_prefill,
               check_vision, check_kda_prefill_scan, check_mla, check_mla_bf16, check_mla_bf16_products, check_mla_prefill,
               check_moe, check_moe_tc_shapes, check_moe_single_token, check_moe_few_tokens, check_moe_gemm,
               check_moe_wg, check_moe_wg_repeat, check_bf16_matmul, check_gemv_tc, check_kda_prefill_conv):
        try:
            if not args.checks or fn.__name__ in args.checks.split(","):
                fn(d, r, gen)
        except Exception as e:  # noqa: BLE001  a crash in one check must not hide the others
            r.exact(fn.__name__, False, f"raised {type(e).__name__}: {e}")
    log(f"checks: {len(r.checks)} run, {r.failed} failed, {time.time() - t0:.1f}s")
    if not args.dry_run and not args.no_bench:
        try:
            bench(d, r, args.quick, [x for x in args.only.split(",") if x])
        except Exception as e:  # noqa: BLE001
            log(f"bench raised {type(e).__name__}: {e}")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "device_check.json").write_text(json.dumps({"checks": r.checks, "bench": r.bench,
                                                               "failed": r.failed, "dry_run": args.dry_run}, indent=1))
    Path(args.out, "device_check.log").write_text("\n".join(LOG) + "\n")
    sys.exit(1 if r.failed else 0)


if __name__ == "__main__":
    main()
