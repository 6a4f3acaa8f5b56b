#!/usr/bin/env python3
"""Measure the GPU's two roofline ceilings with torch: bf16 matmul TFLOP/s and copy GB/s.

    python3 ceilings.py OUT.json

matmul: 8192x8192x8192 bf16 on random normal data (not zeros), 3 warm-ups, 20 timed products
with CUDA events, median; FLOPs = 2*M*N*K. copy: device-to-device copy_ of a 4 GiB bf16
tensor, counting bytes read + bytes written, 3 warm-ups, 20 timed, median. Nothing about the
card's settings is changed.
"""
import json
import statistics
import sys

import torch


def timed(fn, warm=3, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts), ts


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "ceilings.json"
    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    t_mm, ts_mm = timed(lambda: torch.matmul(a, b, out=c))
    tflops = 2 * n ** 3 / t_mm / 1e12
    del a, b, c
    elems = 2 * 1024 ** 3  # 4 GiB of bf16
    x = torch.randn(elems, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_cp, ts_cp = timed(lambda: y.copy_(x))
    gbs = 2 * x.numel() * x.element_size() / t_cp / 1e9
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bf16_matmul_tflops": round(tflops, 1),
        "bf16_matmul_tflops_min_max": [round(2 * n ** 3 / max(ts_mm) / 1e12, 1), round(2 * n ** 3 / min(ts_mm) / 1e12, 1)],
        "copy_gbs": round(gbs, 1),
        "copy_gbs_min_max": [round(2 * x.numel() * 2 / max(ts_cp) / 1e9, 1), round(2 * x.numel() * 2 / min(ts_cp) / 1e9, 1)],
        "method": "matmul 8192^3 bf16 random, copy_ 4 GiB bf16 (read+write bytes); median of 20 after 3 warm-ups",
    }
    print(json.dumps(res))
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
