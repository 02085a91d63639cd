"""The controller's Prometheus metrics: pool sizes and targets, health verdicts, planner decisions.

They live in a registry of the controller's own (its Ray actor's process hosts nothing
else of ours) and reach the one scrape target, the gateway's /metrics, with every
membership push (gateway/app.py keeps the latest; gateway/scrape.py labels it
role="controller"). A scrape shows them as of the last push: one health round old at most.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

POOL_WORKERS = Gauge("pdserve_pool_workers", "Workers of each pool by state (starting, ready, restarting, draining)",
                     ["pool", "state"], registry=REGISTRY)
HEALTH_VERDICTS = Counter(
    "pdserve_health_verdicts", "The controller's verdict on a worker each health round: ok, unhealthy (a failed "
    "deep check), restart (replaced), host_lost (its Ray actor is gone), adopted (a new incarnation serves)",
    ["pool", "verdict"], registry=REGISTRY)
PLANNER_DECISIONS = Counter("pdserve_planner_decisions",
                            "The online planner's decisions: hold (the pools stay) or scale (a move to a new split)",
                            ["decision"], registry=REGISTRY)
POOL_TARGET = Gauge("pdserve_pool_target_workers",
                    "Workers per pool the last scale asked for (the planner's, `pdserve scale`'s or the config's)",
                    ["pool"], registry=REGISTRY)
DRAINS = Counter("pdserve_drains", "Workers drained out of a pool, by how the drain ended: empty (the worker "
                 "confirmed it holds nothing), gone (its process ended), wedged, bound (drain_timeout_s)",
                 ["pool", "end"], registry=REGISTRY)
DRAIN_SECONDS = Histogram("pdserve_drain_seconds", "From a worker's removal from the membership to its drain's end",
                          ["pool"], registry=REGISTRY, buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
SCALE_SECONDS = Histogram("pdserve_scale_seconds", "A scale from its decision to its end (new workers ready, "
                          "leaving ones drained and stopped), by kind: out, in, or move (one pool grows as the "
                          "other shrinks: the online planner's)", ["kind"], registry=REGISTRY,
                          buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
ROLE_CHANGES = Counter("pdserve_role_changes", "Workers that changed pool in place, their weights kept (a move "
                       "without a cold start), by outcome: done, failed (a cold start replaced it), restored (a "
                       "restarted host's process put back in the pool it had moved to)",
                       ["from_pool", "to_pool", "outcome"], registry=REGISTRY)
ROLE_CHANGE_SECONDS = Histogram("pdserve_role_change_seconds", "A role change from its ChangeRole call to the worker "
                                "ready in its new pool (drain not included)", ["to_pool"], registry=REGISTRY,
                                buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300))

STATES = ("starting", "ready", "restarting", "draining")
for _pool in ("prefill", "decode"):  # every series present from the first push, at 0
    for _state in STATES:
        POOL_WORKERS.labels(_pool, _state)
    for _verdict in ("ok", "unhealthy", "restart", "host_lost", "adopted"):
        HEALTH_VERDICTS.labels(_pool, _verdict)
    for _end in ("empty", "gone", "wedged", "bound"):
        DRAINS.labels(_pool, _end)
for _from, _to in (("prefill", "decode"), ("decode", "prefill")):
    ROLE_CHANGE_SECONDS.labels(_to)
    for _outcome in ("done", "failed", "restored"):
        ROLE_CHANGES.labels(_from, _to, _outcome)
for _kind in ("out", "in", "move"):
    SCALE_SECONDS.labels(_kind)
for _decision in ("hold", "scale"):
    PLANNER_DECISIONS.labels(_decision)


def set_pools(counts: dict[tuple[str, str], int]) -> None:
    """The pools now: {(pool, state): workers}; a pair not given is 0."""
    for pool in ("prefill", "decode"):
        for state in STATES:
            POOL_WORKERS.labels(pool, state).set(counts.get((pool, state), 0))


def exposition() -> str:
    return generate_latest(REGISTRY).decode()
