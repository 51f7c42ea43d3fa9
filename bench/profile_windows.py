"""Profiles' 100-step windows side by side: where in a run several GPUs gain on one, and where they do not.

    python bench/profile_windows.py ONE/profile.json SPLIT/profile.json [SPLIT/profile_rank1.json ...]

Each argument is a ``profile.json`` of ``train.profile`` (training.profiler: its ``windows``), the first the
reference (one GPU). Prints a markdown table: each window's mean step (ms) in every profile and the first's over each
other's, then each profile's parts in the window where it gains least. Under ``train.profile=true`` the timers
synchronise the device around every part, so the steps are slower than an unprofiled run's: compare such profiles
with each other, not with run times. Under ``train.profile=host`` the steps run at their own pace and a part is the
host's time in it, waits included: the windows are the run's, and a part that waits for the device holds the wait.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: Path) -> list[dict]:
    windows = json.loads(path.read_text()).get("windows")
    if not windows:
        raise SystemExit(f"{path}: no 'windows' (a profile.json written before they were added, or no profiled steps)")
    return windows


def table(names: list[str], profiles: list[list[dict]]) -> str:
    """The markdown table of the windows' steps (ms) and the first profile's over the others'."""
    reference = profiles[0]
    head = ["steps", *[f"{n} (ms)" for n in names], *[f"{names[0]} / {n}" for n in names[1:]]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, window in enumerate(reference):
        first, last = window["steps"]
        row = [f"{first}-{last}"]
        steps = [p[i]["step_ms"] if i < len(p) and p[i]["steps"] == window["steps"] else None for p in profiles]
        row += ["" if s is None else f"{s:.2f}" for s in steps]
        row += ["" if s is None or not s else f"{steps[0] / s:.2f}x" for s in steps[1:]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def slowest_parts(names: list[str], profiles: list[list[dict]]) -> str:
    """Each profile's parts (ms a step) in the window where the second profile gains least on the first."""
    if len(profiles) < 2:
        return ""
    pairs = [(a["step_ms"] / b["step_ms"], i) for i, (a, b) in enumerate(zip(profiles[0], profiles[1])) if b["step_ms"]]
    if not pairs:
        return ""
    _, worst = min(pairs)
    first, last = profiles[0][worst]["steps"]
    lines = [f"\nsteps {first}-{last}, where {names[1]} gains least, by part (ms a step):"]
    parts = list(profiles[0][worst]["per_step_ms"])
    lines.append("| part | " + " | ".join(names) + " |")
    lines.append("| --- |" + " --- |" * len(names))
    for part in parts:
        values = [p[worst]["per_step_ms"].get(part, 0.0) if worst < len(p) else 0.0 for p in profiles]
        lines.append(f"| {part} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", type=Path, help="profile.json files; the first is the reference")
    args = parser.parse_args(argv)
    names = [f"{p.parent.name}/{p.stem}" for p in args.profiles]
    profiles = [load(p) for p in args.profiles]
    print(table(names, profiles))
    print(slowest_parts(names, profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
