"""The prefix cache's disk tier as Prometheus series (prefix pdserve_engine_kv_disk_), read
from the tier's own counters at each scrape (engine/disk_tier.py): what it holds, its bound,
and the blocks written, served, dropped as corrupt, and not saved because the writer was
behind. A worker without a disk tier exports none of them. The tokens it brought into the
pool are worker/metrics.py's pdserve_engine_prefix_tier_tokens_total{tier="disk"}."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.disk_tier import DiskTierStats


class DiskTierCollector:
    """The prometheus collector over the current engine's disk tier (a role change makes a
    new engine: `watch` points it there)."""

    def __init__(self) -> None:
        self.read: Callable[[], DiskTierStats | None] = lambda: None

    def describe(self):
        """The series' names, for the registry, without reading the engine (which may not
        be built yet, or a stand-in without a tier)."""
        return _families(DiskTierStats(0, 0, 0, 0, 0, 0, 0, 0))

    def collect(self):
        s = self.read()
        return [] if s is None else _families(s)


def _families(s: DiskTierStats) -> list:
    gauges = [("bytes", "Bytes of KV blocks in the disk tier's files", s.bytes),
              ("max_bytes", "The disk tier's bound in bytes", s.max_bytes),
              ("entries", "KV blocks in the disk tier", s.entries)]
    counters = [("blocks_written", "KV blocks written to the disk tier", s.written),
                ("blocks_loaded", "KV blocks read back from the disk tier into the pool", s.loaded),
                ("corrupt_blocks", "Disk tier files that failed their header or checksum check "
                                   "(deleted, their blocks recomputed)", s.corrupt),
                ("dropped_saves", "Evicted KV blocks not saved because the disk writer was behind", s.dropped),
                ("failed_writes", "Disk tier writes that failed (disk full, permissions)", s.failed_writes)]
    return ([GaugeMetricFamily(f"pdserve_engine_kv_disk_{name}", doc, value=v) for name, doc, v in gauges]
            + [CounterMetricFamily(f"pdserve_engine_kv_disk_{name}", doc, value=v) for name, doc, v in counters])


_COLLECTOR = DiskTierCollector()
_registered = False
_lock = threading.Lock()


def watch(read: Callable[[], DiskTierStats | None]) -> None:
    """Export the stats `read` returns (the engine's disk_tier_stats) from now on; registered
    in this process's registry on first use."""
    global _registered
    with _lock:
        _COLLECTOR.read = read
        if not _registered:
            REGISTRY.register(_COLLECTOR)
            _registered = True
