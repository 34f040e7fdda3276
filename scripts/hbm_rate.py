"""The GPU's HBM rates, for byte rooflines on a device other than the one docs/performance.md uses
(4.25 TB/s, the H200's SM copy rate): an SM copy (torch.mul, read + write) and a read (torch.sum) of
1 GiB, best of `--reps`, timed with CUDA events. Prints one line per rate.
    python3 scripts/hbm_rate.py [--reps 20]"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host/backend-cuda/harness"))
from common import event_times_ms  # noqa: E402  the harness's timer


def best_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    return min(event_times_ms(fn, reps))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    src = torch.empty(1 << 28, device="cuda")
    dst, one = torch.empty_like(src), torch.empty((), device="cuda")
    nbytes = src.numel() * 4
    copy_ms = best_ms(lambda: torch.mul(src, 1.0, out=dst), args.reps)
    read_ms = best_ms(lambda: torch.sum(src, dim=0, out=one), args.reps)
    print(f"device {torch.cuda.get_device_name()}")
    print(f"copy rate {2 * nbytes / copy_ms / 1e9:.3f} TB/s (read + write of {nbytes >> 20} MiB, {copy_ms:.3f} ms)")
    print(f"read rate {nbytes / read_ms / 1e9:.3f} TB/s ({read_ms:.3f} ms)")


if __name__ == "__main__":
    main()
