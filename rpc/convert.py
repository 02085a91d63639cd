"""Between engine dataclasses and pdserve.proto messages (the only place that knows both)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.finish_reason import FinishReason
from common.grammar_spec import Grammar
from common.kv_events import KVEventsSince
from common.sampling_params import SamplingParams
from common.token_logprobs import TokenLogprobs
from rpc import pdserve_pb2 as pb

if TYPE_CHECKING:  # the gateway reads this module and never imports torch
    from common.engine_stats import EngineStats

_FINISH_TO_PB = {
    None: pb.FINISH_NONE,
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.ABORT: pb.ABORT,
    FinishReason.ERROR: pb.ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias, max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.grammar is not None:
        msg.grammar.CopyFrom(pb.Grammar(json_schema=p.grammar.json_schema, strict=p.grammar.strict))
    return msg


_DEFAULTS = SamplingParams()


def params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Engine params from a message; raises SamplingParamsError (a ValueError) naming a bad field."""

    def opt(name: str):  # unset optional fields take the engine default
        return getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)

    return SamplingParams(
        temperature=opt("temperature"), top_k=msg.top_k, top_p=opt("top_p"), min_p=msg.min_p,
        repetition_penalty=opt("repetition_penalty"), presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, logit_bias=dict(msg.logit_bias),
        seed=opt("seed"), max_tokens=opt("max_tokens"), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, logprobs=opt("logprobs"),
        grammar=Grammar(msg.grammar.json_schema, msg.grammar.strict) if msg.HasField("grammar") else None,
    )


def finish_to_pb(reason: FinishReason | None) -> int:
    return _FINISH_TO_PB[reason]


def finish_from_pb(value: int) -> FinishReason | None:
    return _FINISH_FROM_PB[value]


def logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                            top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def logprobs_from_pb(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, list(zip(msg.top_token_ids, msg.top_logprobs)))


def health_to_pb(worker: str, v) -> pb.HealthResponse:
    """A deep-health verdict (worker.liveness.Verdict) as the Worker service answers it."""
    return pb.HealthResponse(ok=v.ok, detail=v.detail, worker=worker, busy=v.busy, last_step_age_s=v.last_step_age_s,
                             stall_bound_s=v.stall_bound_s, longest_step_s=v.longest_step_s, queued=v.queued,
                             straggler=v.straggler)


def stats_to_pb(worker: str, e: EngineStats, step_seconds: float, kv_blocks_transferred: int,
                prefill_tokens_per_s: float, deep_probes: int) -> pb.StatsResponse:
    return pb.StatsResponse(
        worker=worker, waiting_requests=e.num_waiting, waiting_tokens=e.waiting_tokens,
        running_requests=e.num_running, free_blocks=e.free_blocks, total_blocks=e.total_blocks,
        prefix_cache_hit_rate=e.prefix_cache_hit_rate, step_seconds=step_seconds, preemptions=e.num_preemptions,
        kv_blocks_transferred=kv_blocks_transferred, block_size=e.block_size,
        prefill_tokens_per_s=prefill_tokens_per_s, deep_probes=deep_probes)


def kv_events_to_pb(e: KVEventsSince) -> pb.KVEvents:
    return pb.KVEvents(last=e.last, resync=e.resync, stored=e.stored, removed=e.removed, more=e.more,
                       resync_after=e.resync_after)


def kv_events_from_pb(msg: pb.KVEvents) -> KVEventsSince:
    return KVEventsSince(msg.last, msg.resync, list(msg.stored), list(msg.removed), msg.more, msg.resync_after)


def local_prefill_name(reason: int) -> str:
    """A LocalPrefill's name as the metrics, traces and the gateway's headers say it
    (LOCAL_PREFILL_BELOW_THRESHOLD: "below_threshold"; LOCAL_PREFILL_NONE: "none")."""
    return pb.LocalPrefill.Name(reason).removeprefix("LOCAL_PREFILL_").lower()
