"""A busy worker beside `pdserve profile --siblings N`: its own engine, serving a steady mix
of prefills and decodes until it is stopped, so the profiled engine shares the machine's
cores, caches and memory bandwidth as a deployment's worker shares them with the others.

    python -m deploy.planner.profile_sibling --model smollm2 --dtype bfloat16 --threads 1

Prints "ready" once its engine is loaded, then steps until stdin closes (the profile's
end) or it is signalled.
"""

from __future__ import annotations

import argparse
import sys
import threading

BATCH = 8  # sequences in flight: a worker under moderate load
PROMPT, OUTPUT = 256, 64  # each finished request is replaced: prefill chunks keep mixing in


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.planner.profile_sibling", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    from common.model_source import resolve_model
    from engine import LLMEngine, SamplingParams
    from engine.config import CacheConfig

    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_folder(resolve_model(args.model), args.dtype, CacheConfig(memory_gib=0.5))
    vocab = engine.config.model.vocab_size
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    n = 0
    while not stop.is_set():
        while engine.stats().queued < BATCH:
            n += 1
            prompt = [(n * 7919 + i * 104729) % (vocab - 200) + 100 for i in range(PROMPT)]
            engine.add_request(f"sibling-{n}", prompt, SamplingParams(temperature=0.0, max_tokens=OUTPUT,
                                                                      ignore_eos=True))
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
