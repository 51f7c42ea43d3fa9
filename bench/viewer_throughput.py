"""What the live viewer costs training: the same run with the viewer off, then on with one browser connected.

    python bench/viewer_throughput.py --json OUT.json -- +experiment=blender data.root=PATH

Each run is ``python train.py OVERRIDES`` in its own folder, alone. For the "on" runs the viewer listens on a
free port of 127.0.0.1 and a simulated browser (bench/viewer_clients.SimulatedClient: viser's protocol, no
browser needed, so it runs on the GPU machines) connects as soon as the port opens: "still" keeps its camera
where it is (full-resolution frames, redrawn as training goes on), "moving" orbits it (previews at a quarter of
the side). The table gives each run's rays/s (metrics.json, training time only) and its drop against "off";
the issue's bar is a drop of at most 10%. Needs viser (``pip install -e ".[viewer]"``).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from viewer_clients import SimulatedClient  # noqa: E402  (beside this file)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def connect_client(port: int, viewer: str) -> SimulatedClient | None:
    """A simulated browser on the viewer at ``port`` (orbiting for "moving"), or None when the server closed the
    connection first (a run that ended, or is still starting up: the caller retries while the run lives)."""
    from websockets.exceptions import ConnectionClosed  # viser's dependency

    try:
        client = SimulatedClient(f"http://127.0.0.1:{port}")
    except (OSError, ConnectionClosed):
        return None
    if viewer == "moving":
        client.orbit(seconds_per_turn=10.0)
    return client


def run(name: str, overrides: list[str], runs: Path, viewer: str | None, timeout: float) -> dict:
    """One training run; ``viewer``: None (off), "still" or "moving" (on, one simulated browser)."""
    run_dir = runs / name
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}", "train.turntable_frames=0"]
    port = free_port()
    if viewer is not None:
        command += ["train.viewer=true", f"train.viewer_port={port}"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = None
    deadline = time.monotonic() + timeout
    try:
        while viewer is not None and client is None and process.poll() is None and time.monotonic() < deadline:
            if port_open(port):
                client = connect_client(port, viewer)
            if client is None:
                time.sleep(0.05)
        output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if client is not None:
            client.close()
        if process.poll() is None:
            process.kill()
    result = {"run": name, "viewer": viewer or "off", "returncode": process.returncode}
    metrics_path = run_dir / "metrics.json"
    if process.returncode != 0 or not metrics_path.is_file():
        return result | {"error": output[-1500:]}
    metrics = json.loads(metrics_path.read_text())
    frames = client.messages_received if client is not None else 0
    return result | {k: metrics[k] for k in ("rays_per_second", "train_seconds", "psnr")} | {"messages": frames}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=None, help="run folders (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args()
    runs = args.runs or Path(tempfile.mkdtemp(prefix="viewer_throughput_"))
    results = [
        run(name, args.overrides, runs, viewer, args.timeout)
        for name, viewer in (("off", None), ("still", "still"), ("moving", "moving"))
    ]
    base = results[0].get("rays_per_second")
    print(f"{'viewer':<8} {'rays/s':>12} {'drop':>7} {'train s':>8} {'messages':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['viewer']:<8} failed (exit {r['returncode']}): {r['error'][-300:]}")
            continue
        r["drop"] = 1.0 - r["rays_per_second"] / base if base else None
        drop = f"{100 * r['drop']:6.1f}%" if r["drop"] is not None else "-"
        print(f"{r['viewer']:<8} {r['rays_per_second']:12,.0f} {drop:>7} {r['train_seconds']:8.1f} {r['messages']:9d}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d"), "overrides": args.overrides, "results": results}, indent=1)
    )
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
