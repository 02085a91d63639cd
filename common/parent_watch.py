"""End a hosted process when its host dies.

A worker or gateway process started by a Ray actor gets PDSERVE_PARENT_PID in its
environment. If that actor process dies (killed, restarted by Ray), the child is re-parented
and `watch_parent` runs its callback, which shuts the child down cleanly, so no orphan keeps
a port, a NIXL agent or memory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from common import envs

ENV = envs.PARENT_PID


def watch_parent(on_orphaned: Callable[[], None], interval_s: float = 0.5) -> None:
    """Call on_orphaned once the parent named in PDSERVE_PARENT_PID is gone (no-op if unset)."""
    expected = envs.parent_pid()
    if expected is None:
        return

    def watch() -> None:
        while os.getppid() == expected:
            threading.Event().wait(interval_s)
        on_orphaned()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
