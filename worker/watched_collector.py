"""A Prometheus collector over what the worker's current engine reports, read at each scrape.

A role change builds a new engine: `watch` points the collector at the new one's reader. The
collector registers itself in this process's registry on the first `watch`, once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client import REGISTRY

T = TypeVar("T")


class WatchedCollector(Generic[T]):
    def __init__(self, families: Callable[[T], list], describe: Callable[[], list]):
        """`families`: the metric families of one reading; `describe`: the same series' names
        for the registry, without reading the engine (which may not be built yet)."""
        self.read: Callable[[], T | None] = lambda: None
        self._families, self._describe = families, describe
        self._registered = False
        self._lock = threading.Lock()

    def describe(self) -> list:
        return self._describe()

    def collect(self) -> list:
        value = self.read()
        return [] if value is None else self._families(value)

    def watch(self, read: Callable[[], T | None]) -> None:
        """Export what `read` returns from now on (None: nothing)."""
        with self._lock:
            self.read = read
            if not self._registered:
                REGISTRY.register(self)
                self._registered = True
