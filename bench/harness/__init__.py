"""Real processes of this project, started and stopped for the tests and the benchmarks.

One place for both, so a benchmark starts a worker the way the tests do (and bench never
imports tests/):

- worker_procs: `python -m prefill` / `python -m decode` on OS-chosen ports, optionally
  pinned to a core, waited on until ready; `free_port`, `wait_idle`, `wait_until`.
- gateway_procs: a `python -m gateway` over given workers (and one with an admin socket).
- deploy_procs: `pdserve serve` and `ray start` as processes, and the check that nothing
  they started outlives them (needs psutil, a dev dependency).
- transfer_peers: one real NIXL agent per spawned process, driven command by command,
  for the transfer tests.
- bandwidth_peers: a sender and a receiver pool for `python -m bench.transfer`.
- device_push, pd_request, device_decode, pd_report: the phases of `python -m bench.gpu_pd`
  (KV push between two processes' pools on one device; a request served end to end over a
  prefill and a decode worker and the gateway; decode steps and throughput on the device;
  what it prints and its exit status).
- tiny_models: tiny random-weight Llama-family checkpoints.
- conversations: seeded multi-turn chat conversations and their streaming client, for
  `python -m bench.prefix_reuse`.

Every wait here is bounded, and every process started here is stopped with its helper.
"""
