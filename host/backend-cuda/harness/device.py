"""The GPU (or, with --dry-run, its stand-in) that the checks and benchmarks launch kernels on: NVRTC
compiles of kernels/*.cu through CuPy, launches checked against each kernel's parsed C signature,
CUDA-event and CUDA-graph timing, and the emulators of emulators.py in place of the GPU on a dry run;
plus the record of check results. Split from device_check.py so the check and benchmark modules
import it without importing the script that runs them."""
from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import numpy as np
import torch

from common import ROOT, event_times_ms, log
from emulators import EMU

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
        return float(np.median(event_times_ms(fn, reps)))

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
