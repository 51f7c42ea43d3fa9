"""Host time of the per-sample decoder's GEMMs when the row count changes every call (as the shaded sample count
does every training step) against a row count padded to few sizes (models.decoder.padded_rows) or fixed.

    python bench/experiments/gemm_shapes.py --json OUT.json      # on a GPU

bf16 GEMMs of the capture preset's decoder (128 wide; the 12-wide first layer; the 3-wide last one), ~1 M rows.
Each measurement issues 60 calls without a sync in between (the launch queue does not fill) and divides the
host's wall time by 60: what a call costs the Python thread, not the GPU. Four repeats per row; the first
includes cuBLAS's first sight of the shapes. On 2026-11-27 (H100 host; that run rounded the counts up to multiples
of 8192, this script now uses padded_rows): 330-380 us a 128x128 mm with a new row count every call against ~25 us
rounded or fixed, 150-210 us against ~30 us an addmm (bench/results/2026-11-27-session28-capture-runs.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models.decoder import padded_rows  # noqa: E402

BASE, SPREAD, CALLS = 1_000_000, 60_000, 60


def issue(kind: str, sizes: list[int], t: dict) -> float:
    """Microseconds of host time a call over ``sizes`` row counts."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for n in sizes:
        if kind == "mm":
            t["x"][:n] @ t["w"].t()
        elif kind == "addmm":
            torch.addmm(t["b"], t["x"][:n], t["w"].t())
        elif kind == "linear3":
            torch.nn.functional.linear(t["x"][:n], t["w3"])
        else:  # mm12: the first layer's per-sample part
            t["f"][:n] @ t["w12"]
    host_us = (time.perf_counter() - start) / len(sizes) * 1e6
    torch.cuda.synchronize()
    return host_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py needs a CUDA device (it measures cuBLAS's host cost)")
    kw = dict(device="cuda", dtype=torch.bfloat16)
    t = {
        "x": torch.randn(BASE + SPREAD + 8192, 128, **kw),
        "f": torch.randn(BASE + SPREAD + 8192, 12, **kw),
        "w": torch.randn(128, 128, **kw),
        "b": torch.randn(128, **kw),
        "w3": torch.randn(3, 128, **kw),
        "w12": torch.randn(12, 128, **kw),
    }
    generator = torch.Generator().manual_seed(1)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_us_per_call": {}}
    for kind in ("mm", "addmm", "linear3", "mm12"):
        for label in ("varying", "padded", "fixed"):
            times = []
            for _ in range(4):
                sizes = [BASE + v for v in torch.randint(0, SPREAD, (CALLS,), generator=generator).tolist()]
                sizes = {"varying": sizes, "padded": [padded_rows(n) for n in sizes], "fixed": [BASE] * CALLS}[label]
                times.append(issue(kind, sizes, t))
            report["host_us_per_call"][f"{kind}/{label}"] = times
            print(f"{kind:8s} {label:8s} host us a call: " + " ".join(f"{v:7.1f}" for v in times), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
