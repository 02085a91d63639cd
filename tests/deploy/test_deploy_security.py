"""Who can reach an embedded `pdserve serve`: Ray runs with token auth (a client without the
token cannot attach, `pdserve status` on the same machine can), and every listener of every
process it starts is bound to loopback on a machine that has a routable address."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from bench.harness.deploy_procs import BIN, ENV, serving
from bench.harness.worker_procs import REPO, free_port

_UNAUTHENTICATED_CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR")
    print("CONNECTED")
except Exception as e:
    print("REFUSED", type(e).__name__)
"""


def test_the_embedded_ray_takes_no_call_without_its_token(smollm2_dir, tmp_path):
    """`pdserve serve` outside a test's sandbox runs Ray with token auth: a client without the
    token cannot attach to its cluster (so cannot run code on it), while `pdserve status` on
    the same machine finds the token and works. The other deployment tests disable auth in
    their own loopback sandbox, as the deployment docs allow only there."""
    port = free_port()
    token_env = {"RAY_AUTH_MODE": "token"}  # what serve sets when nothing is set
    with serving(tmp_path / "serve.log", "--dtype", "float32", "--port", str(port), "--prefill", "0",
                 "--num-cpus", "2", env=token_env) as (_, address):
        probe = subprocess.run([sys.executable, "-c", _UNAUTHENTICATED_CLIENT, address], env=ENV,  # auth disabled
                               capture_output=True, text=True, timeout=120)
        assert "REFUSED" in probe.stdout and "CONNECTED" not in probe.stdout, probe.stdout + probe.stderr[-2000:]
        status = subprocess.run([str(BIN / "pdserve"), "status", "--address", address, "--json"], cwd=REPO,
                                env={**ENV, **token_env}, capture_output=True, text=True, timeout=120)
        assert status.returncode == 0 and json.loads(status.stdout)["pools"]["decode"], status.stderr
        assert "WARNING: RAY_AUTH_MODE" not in (tmp_path / "serve.log").read_text()


# A network namespace of its own in which this machine also has a routable address
# (10.77.0.1, the default route's source), as a host on a real network has: whatever binds
# the node's address or every interface shows there, and nothing leaves the machine.
_ROUTABLE_NS = ("unshare", "-n", "--", "sh", "-c", "ip link set lo up && ip addr add 10.77.0.1/32 dev lo && "
                "ip route add default dev lo src 10.77.0.1 && exec \"$0\" \"$@\"")
_LOOPBACK = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")


def test_the_embedded_deployment_listens_on_loopback_only(smollm2_dir, tmp_path):
    """On a machine with a routable address, an embedded `pdserve serve` (gateway on its
    default 127.0.0.1) binds every listener of every process it starts, Ray's GCS, raylet,
    dashboard agent and workers included, to loopback: nobody on the network reaches Ray's
    APIs, a worker's gRPC or its KV transport."""
    port = free_port()
    with serving(tmp_path / "serve.log", "--dtype", "float32", "--port", str(port), "--num-cpus", "2",
                 prefix=_ROUTABLE_NS) as (proc, address):
        assert address.startswith("127.0.0.1:"), address
        inside = ["nsenter", "-t", str(proc.pid), "-n", "--"]
        listeners = subprocess.run([*inside, "ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
        sockets = [line.split() for line in listeners.splitlines() if line.strip()]
        assert sockets, listeners
        exposed = [f"{s[3]} {s[-1]}" for s in sockets if not _LOOPBACK.match(s[3])]
        assert not exposed, "\n".join(exposed)
        ask = ("import httpx, sys; r = httpx.post(sys.argv[1], json={'model': 'smollm2', 'max_tokens': 4, "
               "'messages': [{'role': 'user', 'content': 'Hi'}]}, timeout=120); print(r.status_code)")
        answer = subprocess.run([*inside, sys.executable, "-c", ask, f"http://127.0.0.1:{port}/v1/chat/completions"],
                                capture_output=True, text=True, timeout=180)
        assert answer.stdout.strip() == "200", answer.stdout + answer.stderr[-2000:]
