"""Several gateway processes on one port: `python -m gateway ... --processes N`.

One gateway process (one event loop) serves less than one decode worker's output at GPU
rates, so the front end scales out on its host. The front process binds the client socket
and the admin socket once, makes a private shared folder, and starts N children that
inherit both listening sockets and all accept on them: the kernel hands each connection to
one child (the pre-fork model of gunicorn, and of uvicorn's own workers). The front process
serves nothing itself. With `--processes 1` (the default) there is no front process: the
one gateway process serves as it always has.

What the children share, in the folder (0700, under the cache folder's `run/`
(common/envs.py `run_dir`), not /tmp, whose cleaners would remove a file a child restarted
days later needs; removed when the front process ends, or at the next start on the host
when the front process was killed):

- `tenants.json`: the tenants file, read once by the front process and copied, so a child
  restarted later serves the same tenants, in the same rows of
- `tenants.counts`: every tenant's sequences and queued tokens, a column per child
  (gateway/tenant_table.py): the tenants' limits hold exactly across the children.
- `metrics/`: prometheus_client's multiprocess files (gateway/metrics.py): /metrics from any
  child counts what every child served.
- `membership.json`: the deploy controller's last push, which one child took and every child
  replays (gateway/shared_membership.py): they route to the same workers.
- `responses/`: the Responses API's stored answers, a file each
  (gateway/responses/folder_store.py): a `previous_response_id` any child stored is found
  by every child, within one byte bound and age for them all.

Each child keeps its own load shedding and KV accounting, a partition with an error bound:

- Admission (gateway/admission.py) predicts a request's wait from what this child admitted
  and measured: its queue q and its first-token rate r. A child taking a share f of the
  connections has q = fQ and r = fR of the whole queue Q and rate R, so it predicts
  (fQ + 1) / (fR) = (Q + 1/f) / R where one gateway predicts (Q + 1) / R: unbiased in the
  queue, plus about N - 1 requests' worth of wait ((N - 1) / R seconds, on the side of the
  bound: it sheds a little early). With connections landing at random, its queue's share
  varies around fQ by a relative sqrt((N - 1) / Q) (one standard deviation), so the error
  grows as the queue gets small: 8% at Q = 450 with N = 4, 30% at Q = 30. It matters only
  near the shedding point, Q = 0.75 x bound x R, and the 25% headroom under the bound holds
  it while Q > 16 (N - 1). A child with nothing queued admits, as one gateway does.
- KV room (gateway/routing/router.py): a child subtracts the prompts it sent to a worker since the
  worker's last Stats, not those the other children sent; a worker past its room refuses
  the request itself, and the child sends it to another.

A child that dies is restarted, its column of the tenant counts zeroed first, so a crash
leaks no slot; its metric files stay, so no counter goes backwards. A child that dies
within `START_GRACE_S` of its start counts as a failed start, and after
`FAILED_STARTS` of them in a row the front process stops the others and exits: a gateway
that cannot start fails as one process would. SIGTERM and SIGINT are forwarded to every
child (each in a session of its own, so a terminal's Ctrl-C reaches them once); the front
process ends when they all have, and ends with its host like a lone gateway
(common/parent_watch.py), while each child ends with the front process the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import envs
from common.parent_watch import ENV as PARENT_ENV
from common.parent_watch import watch_parent
from gateway.tenant_table import TenantTable
from gateway.tenants import Tenants

log = logging.getLogger("gateway")

START_GRACE_S = 10.0  # a child that dies sooner failed to start
FAILED_STARTS = 3  # in a row, for one child: the front process gives up
RESTART_PAUSE_S = 1.0  # after a failed start, before the next try
BACKLOG = 2048  # connections waiting for a child's accept (uvicorn's default backlog)


@dataclass(frozen=True)
class SharedFolder:
    """The front process's folder, which its children share (see the module's docstring)."""

    path: Path

    @property
    def tenants(self) -> Path:
        return self.path / "tenants.json"

    @property
    def counts(self) -> Path:
        return self.path / "tenants.counts"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics"

    @property
    def membership(self) -> Path:
        return self.path / "membership.json"

    @property
    def responses(self) -> Path:
        return self.path / "responses"


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen
    started: float
    failed_starts: int = 0  # before this one, in a row


class Front:
    """Starts `processes` children with `command(index)` and keeps them running until a
    signal; the listening sockets and the folder are its until it ends."""

    def __init__(self, processes: int, sockets: list[socket.socket], folder: SharedFolder, table: TenantTable,
                 command):
        self.processes, self.sockets, self.folder, self.table = processes, sockets, folder, table
        self.command = command  # index -> the child's argv
        self.children: dict[int, _Child] = {}
        self.stopping: int | None = None  # the signal being forwarded

    def _start(self, index: int, failed_starts: int = 0) -> None:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.folder.metrics), PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen(self.command(index), env=env, pass_fds=[s.fileno() for s in self.sockets],
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.children[index] = _Child(index, proc, time.monotonic(), failed_starts)
        log.info("gateway process %d started (pid %d)", index, proc.pid)
        if self.stopping is not None:  # the signal came while it was starting
            proc.send_signal(self.stopping)

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = signum
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.send_signal(signum)

    def run(self) -> int:
        """Until every child has ended after a signal, or one cannot start. Returns -signal
        when every child ended cleanly after it (0, or by the signal itself: uvicorn ends by
        the signal it caught, as a lone gateway does), else an exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))  # hosted by a Ray actor: end with it
        for index in range(self.processes):
            self._start(index)
        while True:
            running = False
            for index, child in list(self.children.items()):
                code = child.proc.poll()
                if code is None:
                    running = True
                elif self.stopping is None and not self._restart(child, code):
                    self._on_signal(signal.SIGTERM, None)
                    self._wait_all()
                    return _exit_code(code) or 1
            if self.stopping is not None and not running:
                codes = [c.proc.returncode for c in self.children.values()]
                failed = [c for c in codes if c not in (0, -self.stopping)]
                return _exit_code(failed[0]) if failed else -self.stopping
            time.sleep(0.1)

    def _restart(self, child: _Child, code: int) -> bool:
        """A dead child's tenant counts zeroed, then a new child in its place; False: it
        failed to start too often in a row."""
        failed = child.failed_starts + 1 if time.monotonic() - child.started < START_GRACE_S else 0
        self.table.zero_column(child.index)
        log.warning("gateway process %d (pid %d) exited with %s; its tenant counts are zeroed%s", child.index,
                    child.proc.pid, code, "" if failed < FAILED_STARTS else f"; it failed to start {failed} times "
                    "in a row: stopping")
        if failed >= FAILED_STARTS:
            return False
        if failed:
            time.sleep(RESTART_PAUSE_S)
        if self.stopping is None:  # a signal may have come during the pause
            self._start(child.index, failed)
        return True

    def _wait_all(self) -> None:
        for child in self.children.values():
            child.proc.wait()


def _exit_code(code: int) -> int:
    """A child's returncode as this process's exit code (killed by a signal: 128 + it)."""
    return 128 - code if code < 0 else code


FOLDER_PREFIX = "gateway-"  # then the front process's pid and a dash


def make_folder(tenants_file: str | None, processes: int) -> tuple[SharedFolder, TenantTable]:
    """The private shared folder: the tenants file's copy, a zeroed counts table (a row per
    tenant, the anonymous one included), empty metrics and responses folders. Folders left
    by front processes that no longer run (killed, so they never removed theirs) go first."""
    run = envs.run_dir()
    run.mkdir(mode=0o700, parents=True, exist_ok=True)
    _remove_orphans(run)
    folder = SharedFolder(Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=run)))  # 0700
    try:
        folder.metrics.mkdir()
        folder.responses.mkdir(mode=0o700)
        if tenants_file:
            shutil.copyfile(tenants_file, folder.tenants)
            folder.tenants.chmod(0o600)
        tenants = Tenants.from_file(folder.tenants) if tenants_file else Tenants()
        # a row per tenant, then the retry budget's (gateway/retry_budget.py)
        table = TenantTable.create(folder.counts, rows=len(tenants.all()) + 1, processes=processes)
    except BaseException:
        shutil.rmtree(folder.path, ignore_errors=True)
        raise
    return folder, table


def _remove_orphans(run: Path) -> None:
    for old in run.glob(f"{FOLDER_PREFIX}*-*"):
        pid = old.name.removeprefix(FOLDER_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def serve(processes: int, sockets: list[socket.socket], tenants_file: str | None, child_args) -> int:
    """The front process: `processes` children over `sockets` until a signal; returns the
    exit code, or ends by the signal, as a lone gateway does, once its children did.
    `child_args(folder, index, fds)`: a child's argv after `python -m gateway`."""
    folder, table = make_folder(tenants_file, processes)
    fds = [s.fileno() for s in sockets]
    try:
        front = Front(processes, sockets, folder, table,
                      lambda index: [sys.executable, "-m", "gateway", *child_args(folder, index, fds)])
        code = front.run()
    finally:
        table.close()
        shutil.rmtree(folder.path, ignore_errors=True)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.raise_signal(-code)
    return code
