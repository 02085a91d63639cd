"""How much CPU the host took from this machine during a run: a VM's steal time.

On a shared virtual machine the hypervisor runs other guests on the same physical cores;
the time this guest wanted a core and did not get it is "steal" in /proc/stat. A serving
run during which the host stole a few percent is slower for reasons outside the system
under test, so the benchmarks record it beside their figures (None where the kernel does
not report it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTicks:
    steal: int
    total: int


def read() -> CpuTicks | None:
    """The machine's CPU ticks since boot (all cores), or None without /proc/stat."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:]]
    return CpuTicks(steal=ticks[7], total=sum(ticks[:8]))  # guest time is counted in user already


def fraction(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """The share of CPU time the host stole between two readings."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
