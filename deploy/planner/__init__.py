"""The planner: how many prefill and decode workers serve a workload best, offline and online.

Its modules, each importing only those above it in this list (no circle):
- slo.py: the SLO maths (percentile, attainment, goodput), the serving benchmark's too;
- pools.py: a deployment's pool sizes and the splits of N workers;
- workload.py: request lengths and arrivals (the benchmark's and the simulator's);
- step_cost.py: what one engine step costs, fitted on measured steps;
- sim_worker.py: a worker made of the engine's own scheduler and KV manager, on no model;
- step_fit.py: what a deployment's steps cost beside each other, from its step logs;
- profile.py, profile_sibling.py: `pdserve profile` (the steps measured on this host);
- simulator.py: the pools on a virtual clock, priced by a profile;
- tune.py: `pdserve tune` (the best split, and the simulator checked on a measured run);
- online.py: the online planner's decision from one window of the live metrics.

The Ray runtime (deploy/planner_loop.py, in the controller) calls `online.Planner` each
window; nothing here imports the runtime. docs/planner.md walks through it."""
