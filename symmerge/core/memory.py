"""How much memory the machine has free (for choices and guards that depend on it)."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where unknown)."""
    try:
        for row in Path("/proc/meminfo").read_text().splitlines():
            if row.startswith("MemAvailable:"):
                return int(row.split()[1]) * 1024
    except OSError:
        pass
    return None
