"""deploy/process_log.py: a hosted process's log is private to its owner and bounded in size,
copied from a real child process's output."""

from __future__ import annotations

import stat
import subprocess
import sys

from deploy.process_log import RotatingLog


def test_a_childs_log_is_private_and_rotated_by_size(tmp_path):
    path = tmp_path / "logs" / "deployment" / "decode-0-1.log"
    log = RotatingLog(path, max_bytes=10_000, backups=2)
    child = subprocess.Popen([sys.executable, "-c", "for i in range(3000): print(f'line {i:05d}', flush=True)"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.follow(child.stdout).join(timeout=60)
    assert child.wait(30) == 0
    files = sorted(path.parent.glob("decode-0-1.log*"))
    assert [f.name for f in files] == ["decode-0-1.log", "decode-0-1.log.1", "decode-0-1.log.2"]
    assert all(f.stat().st_size <= 10_000 for f in files)
    assert path.read_text().splitlines()[-1] == "line 02999"  # the newest lines are in the live file
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
