"""`pdserve status` held open: one Ray driver for the life of a deployment, answering each
line on its stdin with the controller's status (what `pdserve status --json` prints) as one
JSON line on its stdout: {"status": ...}, or {"error": "..."}.

`pdserve status` joins the Ray cluster as a new driver on every call: about 3 s of CPU each
on a two-core host, where the scenarios ask for it dozens of times (every `settle`, every
wait for a replacement), taking that CPU from the workers under test. Joining once makes
each answer an actor call.

    python -m bench.chaos.status_feed RAY_ADDRESS
"""

from __future__ import annotations

import json
import logging
import sys


def main(address: str) -> int:
    import ray

    from deploy.serve import CONTROLLER, NAMESPACE

    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    for _ in sys.stdin:  # one line asked, one line answered; stdin closed: done
        try:
            answer = {"status": ray.get(controller.status.remote(), timeout=30)}
        except Exception as e:  # say why; the next question may be answered
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
