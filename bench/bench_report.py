"""The op benchmark's report: derived bandwidths and speed-ups, the targets checked, and the text/Markdown table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

MAX_REL_ERR = 1e-4  # fp32 forward vs the reference; above this a row's timing is of a wrong answer


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def derive(rows: list[dict], copy_gbps: float) -> None:
    """Adds bw ms, GB/s, % of copy bandwidth and the custom op's speed-up over every other variant."""
    for row in rows:
        fw, fwbw, bw_op = (row[k]["ms"] if row[k] else None for k in ("fw", "fwbw", "bw_op"))
        row["fw_ms"], row["fwbw_ms"] = fw, fwbw
        if bw_op is not None:
            row["bw_ms"], row["bw_source"] = bw_op, "op"
        elif fw is not None and fwbw is not None and fwbw > fw:
            row["bw_ms"], row["bw_source"] = fwbw - fw, "fwbw-fw"
        else:
            row["bw_ms"], row["bw_source"] = None, None
        for key, ms, nbytes in (
            ("fw", fw, row["bytes_fw"]),
            ("bw", row["bw_ms"], row["bytes_bw"]),
            ("fwbw", fwbw, row["bytes_fw"] + row["bytes_bw"]),
        ):
            gbps = nbytes / ms / 1e6 if ms else None
            row[f"{key}_GBps"] = gbps
            row[f"{key}_pct_copy"] = 100 * gbps / copy_gbps if gbps else None
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["op"], row["case"]), {})[row["variant"]] = row
    for group in by_case.values():
        custom = group.get("custom")
        for name, row in group.items():
            row["custom_speedup"] = (
                None
                if name == "custom"
                else {
                    key: _ratio(row[f"{key}_ms"], custom[f"{key}_ms"]) if custom else None
                    for key in ("fw", "fwbw", "bw")
                }
            )


# ----------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A goal from the issue, evaluated on this run's numbers only."""

    name: str
    device: str  # "cuda" or "cpu"
    op: str
    case: str
    value: Callable[[Callable[[str, str], Optional[float]]], Optional[float]]  # (variant, field) lookup -> number
    threshold: float
    at_least: bool = True
    unit: str = "x"
    sizes: tuple[str, ...] = ("full",)  # where the goal applies; elsewhere the result is indicative


TARGETS = (
    Target(
        "trilinear fw >= 85% of copy BW",
        "cuda",
        "trilinear",
        "grad=feats",
        lambda g: g("custom", "fw_pct_copy"),
        85,
        unit="%",
    ),
    Target(
        "trilinear bw >= 80% of copy BW (backward op alone)",
        "cuda",
        "trilinear",
        "grad=feats",
        lambda g: g("custom", "bw_pct_copy"),
        80,
        unit="%",
    ),
    Target(
        "grid_interpolate random fw >= 6x F.grid_sample",
        "cuda",
        "grid_interpolate",
        "random",
        lambda g: _ratio(g("builtin", "fw_ms"), g("custom", "fw_ms")),
        6,
    ),
    Target(
        "grid_interpolate random fwbw >= 6x F.grid_sample",
        "cuda",
        "grid_interpolate",
        "random",
        lambda g: _ratio(g("builtin", "fwbw_ms"), g("custom", "fwbw_ms")),
        6,
    ),
    Target(
        "upsample fwbw >= 1.5x F.interpolate",
        "cuda",
        "upsample",
        "x2",
        lambda g: _ratio(g("builtin", "fwbw_ms"), g("custom", "fwbw_ms")),
        1.5,
    ),
    Target(
        "gelu fw within 5% of F.gelu (time ratio)",
        "cuda",
        "gelu",
        "exact",
        lambda g: _ratio(g("custom", "fw_ms"), g("builtin", "fw_ms")),
        1.05,
        at_least=False,
    ),
    Target(
        "gelu fwbw within 5% of F.gelu (time ratio)",
        "cuda",
        "gelu",
        "exact",
        lambda g: _ratio(g("custom", "fwbw_ms"), g("builtin", "fwbw_ms")),
        1.05,
        at_least=False,
    ),
    *(
        Target(
            f"volume_render {phase} >= 60% of copy BW, C={c} B=1048576",
            "cuda",
            "volume_render",
            f"C={c} B=1048576",
            lambda g, phase=phase: g("custom", f"{phase}_pct_copy"),
            60,
            unit="%",
        )
        for c in (3, 12)
        for phase in ("fw", "bw")
    ),
    Target(
        "CPU grid_interpolate random fwbw >= 2x reference",
        "cpu",
        "grid_interpolate",
        "random",
        lambda g: _ratio(g("reference", "fwbw_ms"), g("custom", "fwbw_ms")),
        2,
        sizes=("small", "full"),
    ),
)


def evaluate_targets(rows: list[dict], device_type: str, size: str) -> list[dict]:
    index = {(r["op"], r["case"], r["variant"]): r for r in rows}
    out = []
    for t in TARGETS:
        if t.device != device_type or not any(r["op"] == t.op and r["case"] == t.case for r in rows):
            continue
        value = t.value(lambda variant, key: (index.get((t.op, t.case, variant)) or {}).get(key))
        met = value is not None and (value >= t.threshold if t.at_least else value <= t.threshold)
        status = "n/a" if value is None else "PASS" if met else "MISS"
        out.append(
            {
                "name": t.name,
                "value": value,
                "goal": f"{'>=' if t.at_least else '<='} {t.threshold}{t.unit}",
                "threshold": t.threshold,
                "unit": t.unit,
                "status": status,
                "note": "" if size in t.sizes else f"indicative only: the goal is for size {'/'.join(t.sizes)}",
            }
        )
    return out


# ----------------------------------------------------------------------------------------------- output


def _fmt(x: Optional[float], kind: str) -> str:
    if x is None:
        return "-"
    if kind == "ms":
        return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3f}"
    if kind == "x":
        return f"{x:.2f}x"
    if kind == "err":
        return f"{x:.1e}"
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


TABLE_HEADERS = [
    "op",
    "case",
    "variant",
    "fw ms",
    "fwbw ms",
    "bw ms",
    "fw GB/s",
    "fw %copy",
    "bw GB/s",
    "bw %copy",
    "err vs ref",
    "custom speed-up fw",
    "fwbw",
]


def table_rows(rows: list[dict], errors: list[dict]) -> list[list[str]]:
    failed = {(e["op"], e["case"], e["variant"], e["phase"]) for e in errors}
    out = []
    for r in rows:
        key = (r["op"], r["case"], r["variant"])

        def ms(phase: str, value: Optional[float]) -> str:
            return "error" if key + (phase,) in failed else _fmt(value, "ms")

        bw = _fmt(r["bw_ms"], "ms") + ("*" if r["bw_source"] == "op" else "") if r["bw_ms"] else ms("bw_op", None)
        speed = r["custom_speedup"] or {}
        err = r["rel_err_vs_reference"]
        err_text = _fmt(err, "err") + (" WRONG" if err is not None and not err <= MAX_REL_ERR else "")
        out.append(
            [
                r["op"],
                f"{r['case']} {r['shape']}",
                r["variant"],
                ms("fw", r["fw_ms"]),
                ms("fwbw", r["fwbw_ms"]),
                bw,
                _fmt(r["fw_GBps"], "n"),
                _fmt(r["fw_pct_copy"], "n"),
                _fmt(r["bw_GBps"], "n"),
                _fmt(r["bw_pct_copy"], "n"),
                err_text,
                _fmt(speed.get("fw"), "x"),
                _fmt(speed.get("fwbw"), "x"),
            ]
        )
    return out


def format_table(headers: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *body)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [headers, *body])


def render(report: dict, markdown: bool) -> str:
    dev, copy = report["device"], report["copy"]
    header = (
        f"{report['date']}  {dev['name']}  torch {report['torch']}  size={report['size']}  "
        f"copy bandwidth {copy['GBps']:.0f} GB/s (read+write, {copy['bytes'] >> 20} MiB)"
    )
    parts = [
        header,
        "",
        format_table(TABLE_HEADERS, table_rows(report["results"], report["errors"]), markdown),
        "",
        "bw ms: * = backward op timed alone, else fwbw - fw. custom speed-up = this row's time / custom's time. "
        f"err vs ref = ||out - reference|| / ||reference||, forward (WRONG above {MAX_REL_ERR:g}).",
    ]
    if report["targets"]:
        body = [
            [t["name"], _fmt(t["value"], "n" if t["unit"] == "%" else "x"), t["goal"], t["status"], t["note"]]
            for t in report["targets"]
        ]
        parts += ["", format_table(["target", "measured", "goal", "status", "note"], body, markdown)]
    if report["errors"]:
        parts += ["", "errors:"] + [
            f"- {e['op']}/{e['case']}/{e['variant']} {e['phase']}: {e['error'][:160]}" for e in report["errors"]
        ]
    return "\n".join(parts)
