"""One system's side of the vLLM peer benchmark (bench/peer_vllm.py), in its own process.

    python bench/peer_runner.py --system vllm JOB.json OUT.json      (in vLLM's venv)
    python -m bench.peer_runner --system pdserve JOB.json OUT.json   (in pdserve's)

Both systems get the same job (prompt token ids, output lengths, greedy with ignore_eos)
and are timed by the same code: one `generate` call over the whole workload, then the
decode step at batch B by difference, T(B prompts, `long` new tokens) - T(B other prompts,
`short` new tokens), over `long - short` steps (the median of a few such pairs), so prefill
and call overhead cancel: while
`short` is at least the steps the batch's prefill spans, the long run is the short one
with `long - short` steps of all B sequences decoding added.
Only the standard library is imported at the top: vLLM's venv has no pdserve, and
pdserve's has no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

# generate(prompts, max_tokens per prompt) -> the generated token ids, per prompt
Generate = Callable[[list[list[int]], list[int]], list[list[int]]]


def log(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_vllm(job: dict) -> Generate:
    """vLLM's offline `LLM` at the settings bench/peer_vllm.py passes (its best on this host)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], **job.get("vllm_args", {}))

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def load_pdserve(job: dict) -> Generate:
    """pdserve's offline `LLM`, at its defaults but for the job's limits and threads."""
    from engine import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], num_threads=job["threads"],
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
              **job.get("pdserve_args", {}))

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return [list(o.token_ids) for o in llm.generate(prompts, params)]

    return generate


def timed(generate: Generate, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = generate(prompts, max_tokens)
    seconds = time.perf_counter() - t0
    for out, n in zip(outs, max_tokens):
        if len(out) != n:
            raise RuntimeError(f"generated {len(out)} tokens where {n} were asked for")
    return seconds, outs


def run(job: dict, system: str) -> dict:
    t0 = time.perf_counter()
    generate = {"vllm": load_vllm, "pdserve": load_pdserve}[system](job)
    load_s = time.perf_counter() - t0
    log(f"{system}: loaded in {load_s:.1f}s; warming up")
    generate(job["warm_prompts"], [8] * len(job["warm_prompts"]))
    requests = job["requests"]
    log(f"{system}: generate({len(requests)} requests)")
    seconds, outs = timed(generate, [r["prompt"] for r in requests], [r["output_len"] for r in requests])
    log(f"{system}: {seconds:.1f}s, {sum(map(len, outs)) / seconds:.1f} output tok/s")
    decode = []
    for d in job["decode"]:
        b, short, long = d["batch"], d["short"], d["long"]
        steps = []
        for pair in d["pairs"]:  # repeats, each with prompts of its own; the median step is reported
            t_short, _ = timed(generate, pair["short"], [short] * b)
            t_long, _ = timed(generate, pair["long"], [long] * b)
            steps.append((t_long - t_short) / (long - short))
        step = statistics.median(steps)
        log(f"{system}: decode step at batch {b}: {step * 1e3:.1f} ms (median of "
            f"{', '.join(f'{s * 1e3:.1f}' for s in steps)})")
        decode.append(dict(batch=b, step_s=step, steps_s=steps))
    return dict(system=system, load_s=load_s, seconds=seconds, output_tokens=sum(map(len, outs)),
                token_ids=outs, decode=decode, pid=os.getpid())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=("vllm", "pdserve"), required=True)
    p.add_argument("job")
    p.add_argument("out")
    args = p.parse_args(argv)
    with open(args.job) as f:
        job = json.load(f)
    result = run(job, args.system)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
