"""What `python -m bench.gpu_pd` prints of each phase's JSON, and its exit status."""

from __future__ import annotations


def _push(dev: str, r: dict) -> list[str]:
    lines = []
    for row in r["rows"]:
        mem = row["memory"]
        lines.append(
            f"[{dev}] KV push over NIXL, {mem} to {mem} between two processes, {row['shape']}: "
            f"{row['push_bytes'] / 2**20:.1f} MiB in {row['blocks']} scattered blocks, {row['chunks']} chunks: "
            f"{row['push_gbps']:.2f} GB/s (median of {len(row['push_ms'])}, last verified; first push "
            f"{row['first_push_ms']:.1f} ms); {row['copy']} of the same bytes {row['copy_gbps']:.2f} GB/s; "
            f"push/copy {row['push_over_copy']:.2f}x")
        lines += [f"[{dev}]     UCX: {w}" for w in row["ucx_writes"]] or [f"[{dev}]     UCX: no protocol report"]
    return lines


def _serve(dev: str, r: dict) -> list[str]:
    lines = []
    for m in r["models"]:
        g, c, t = m["generate"], m["completions"], m["transfer_metrics"]
        h = c["headers"]
        lines += [
            f"[{dev}] served {m['model']} float32 over a prefill and a decode worker: greedy tokens = CPU engine = "
            f"transformers on {m['device']}: {'yes' if m['tokens_match'] else 'NO (MISMATCH)'}; KV from the "
            f"prefill worker: {'yes' if m['kv_remote'] else 'NO'}",
            f"[{dev}]     Generate: {g['tokens']} (served {g['served']})",
            f"[{dev}]     /v1/completions: x-pdserve-prefill {h.get('x-pdserve-prefill')}, x-pdserve-kv-blocks "
            f"{h.get('x-pdserve-kv-blocks')}; text {c['text']!r} vs reference {c['reference_text']!r}",
            f"[{dev}]     prefill worker pushed {t['bytes']:.0f} bytes in {t['pushes']:.0f} pushes "
            f"({t['seconds'] * 1e3:.1f} ms in all)",
        ]
        if not m["tokens_match"]:
            lines += [f"[{dev}]     CPU engine {g['cpu_engine']} / {c['cpu_engine']}",
                      f"[{dev}]     transformers {g['transformers']} / {c['transformers']}"]
        lines += [f"[{dev}]     UCX: {w}" for w in m["ucx_writes"]]
    return lines


def _decode(dev: str, r: dict) -> list[str]:
    rates = r["rates"]
    lines = [f"[{dev}] decode step, {r['model']} {r['dtype']}, prompt {r['prompt_len']} tokens, mean over steps "
             "where all B decode",
             f"{'B':>5}{'steps':>7}{'context':>9}{'eager ms':>10}{'graphs ms':>11}{'roofline ms':>13}{'bound':>8}"
             f"{'eager/roof':>12}"]
    for row in r["rows"]:
        graphs = row["graphs"] if isinstance(row["graphs"], (int, float)) else "n/a"
        lines.append(f"{row['batch']:>5}{row['steps']:>7}{row['context']:>9.0f}{row['eager_ms']:>10.2f}{graphs:>11}"
                     f"{row['roofline_ms']:>13.3f}{row['bound']:>8}{row['eager_over_roofline']:>11.1f}x")
    notes = {row["graphs"] for row in r["rows"] if isinstance(row["graphs"], str)}
    lines += [f"graphs: {n}" for n in notes]
    lines.append(f"[{dev}] roofline = max(weights + KV bytes / {rates['bandwidth'] / 1e9:.0f} GB/s copy bandwidth "
                 f"measured here (read + write), flops / {rates['matmul_peak'] / 1e12:.1f} TFLOP/s {r['dtype']} "
                 "matmul measured here)")
    return lines


def _throughput(dev: str, r: dict) -> list[str]:
    return [f"[{dev}] offline throughput, {r['model']} {r['dtype']}, {r['requests']} ShareGPT-like requests "
            f"({r['prompt_tokens']} prompt, {r['output_tokens']} output tokens): pdserve {r['pdserve_output_tps']:.0f} "
            f"output tok/s ({r['pdserve_s']:.1f} s), transformers generate in static batches of {r['hf_batch']} "
            f"{r['transformers_output_tps']:.0f} ({r['transformers_s']:.1f} s): {r['ratio']:.2f}x"]


RENDER = {"push": _push, "serve": _serve, "decode": _decode, "throughput": _throughput}


def render(dev: str, phase: str, result: dict) -> str:
    if result["status"] != "ok":
        tail = result.get("error", "").strip().splitlines()[-12:]
        return "\n".join([f"[{dev}] phase {phase}: {result['status']}", *(f"    {line}" for line in tail)])
    return "\n".join(RENDER[phase](dev, result))


def verdict(report: dict) -> tuple[int, str]:
    """(exit status, why): 1 for wrong tokens or KV not from the prefill worker, 3 for a phase
    that did not finish, else 0."""
    serve = report["phases"].get("serve", {})
    for m in serve.get("models", ()):
        if not m["tokens_match"]:
            return 1, f"token mismatch on {m['model']}"
        if not m["kv_remote"]:
            return 1, f"{m['model']}: the KV did not come from the prefill worker"
    bad = [f"{p}: {r['status']}" for p, r in report["phases"].items() if r["status"] != "ok"]
    if bad:
        return 3, "phases that did not finish: " + "; ".join(bad)
    if "serve" not in report["phases"]:
        return 0, "every phase asked for ran (no serve phase: no tokens compared)"
    return 0, "every phase ran; tokens matched and the KV came from the prefill worker over NIXL"
