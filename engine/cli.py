"""`pdserve chat`: an interactive or one-shot chat through the offline engine, in this
process. The `pdserve` command itself (serve, scale, status, chat) lives in deploy/cli.py."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def add_chat_command(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with a model in this process (offline engine, no server)")
    chat.add_argument("--model", default="smollm2",
                      help="'smollm2' (default), a Hugging Face checkpoint folder, or a .gguf file")
    chat.add_argument("--dtype", default="auto",
                      help="auto (default: bfloat16 where this CPU computes it natively, else float32), "
                           "bfloat16 or float32")
    chat.add_argument("--prompt", "-p", help="ask one question and exit (default: interactive)")
    chat.add_argument("--system", help="system prompt (default: the model's own)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    chat.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from common.sampling_params import SamplingParamsError
    from engine import LLM, SamplingParams
    from engine.scheduler import RequestRejected

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except SamplingParamsError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    print(f"ready in {time.perf_counter() - t0:.1f}s: {llm.dtype_choice}", file=sys.stderr, flush=True)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.prompt is None
    if interactive:
        print("type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        if interactive:
            try:
                question = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not question:
                return 0
        else:
            question = args.prompt
        history.append({"role": "user", "content": question})
        reply = []
        try:
            for piece in llm.stream(llm.chat_prompt_ids(history), params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            pass
        except RequestRejected as e:  # e.g. the conversation outgrew the context
            print(f"pdserve: {e}", file=sys.stderr)
            history.pop()
            if not interactive:
                return 1
            continue
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
        if not interactive:
            return 0

