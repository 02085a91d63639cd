"""The allocator setting that keeps a CPU step's large transient tensors from faulting in
their pages again every step (engine/host_memory.py), checked by the kernel's own count of
page faults in a fresh process (the setting is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The temperature-1 sampler at batch 32 over SmolLM2's vocabulary, 25 steps; prints the
# page faults of steps 5-24. Without the setting glibc faults the step's ~6100 pages in
# again every step (~120000 in all, measured); with it they are reused.
_SAMPLER_STEPS = textwrap.dedent("""
    import resource, sys, torch
    from engine.host_memory import keep_freed_memory
    from engine.sampler import Sampler, SamplingMetadata
    from common.sampling_params import SamplingParams
    assert keep_freed_memory() and keep_freed_memory()  # once, then idempotent
    V, B = 49152, 32
    logits = torch.randn(B, V, dtype=torch.bfloat16)
    meta = SamplingMetadata.build([SamplingParams(temperature=1.0)] * B, [[1]] * B, [[]] * B, V, "cpu")
    sampler = Sampler()
    faults = []
    for _ in range(25):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        sampler(logits, meta)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[5:]), faults)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and Linux fault counts")
def test_sampler_steps_reuse_freed_memory():
    out = subprocess.run([sys.executable, "-c", _SAMPLER_STEPS], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    total, per_step = out.stdout.split(" ", 1)
    # One step's pages: [32, 49152] float32 probabilities and copies, a float64 sum: ~6100.
    assert int(total) < 6000, f"page faults per sampler step {per_step}: freed step memory went back to the OS"
