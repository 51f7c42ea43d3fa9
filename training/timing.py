"""How long this process has run: the start-up a user waits for before the first training step (Python and torch
imports, config, data loading, model build, CUDA context), which no timer inside the program can see begin."""

from __future__ import annotations

import os
import time

_IMPORTED = time.perf_counter()  # fallback origin where the OS does not tell the process start


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime), else since
    this module was imported (a lower bound)."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: split after it
        start_ticks = int(fields[19])  # field 22 (starttime) counted from field 3 (state)
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        return max(0.0, since_boot - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED
