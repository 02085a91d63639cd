"""The prefix cache's disk tier as Prometheus series (prefix pdserve_engine_kv_disk_), read
from the tier's own counters at each scrape (engine/disk_tier.py): what it holds, its bound,
and the blocks written, served, dropped as corrupt, and not saved because the writer was
behind. A worker without a disk tier exports none of them. The tokens it brought into the
pool are worker/metrics.py's pdserve_engine_prefix_tier_tokens_total{tier="disk"}."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.disk_tier import DiskTierStats
from worker.watched_collector import WatchedCollector


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


# The series' names for the registry come from a zero reading: describing reads no engine.
_COLLECTOR = WatchedCollector(_families, lambda: _families(DiskTierStats(0, 0, 0, 0, 0, 0, 0, 0)))
# watch(read): export the stats `read` returns (the engine's disk_tier_stats) from now on
watch = _COLLECTOR.watch
