"""Which slice of a model each tensor-parallel rank owns, as plain data.

With degree N, rank r owns a contiguous run of attention heads, the KV heads those query
heads read (sharded when N divides the KV head count, replicated when N is a multiple of
it: each KV head then lives on N / num_kv_heads ranks), a contiguous run of the MLP's
intermediate columns and a contiguous run of vocabulary rows (ceil(vocab / N) each, the
last rank's shorter when N does not divide the vocabulary), and of a mixture of experts, a
contiguous run of whole experts (expert parallelism: attention stays split by heads). A model whose head or
intermediate counts do not fit N is refused with the counts and the degrees that would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import ModelConfig, UnsupportedModelError


def _fits(cfg: ModelConfig, size: int) -> list[str]:
    """The counts of `cfg` that degree `size` does not divide, as `name=value` phrases."""
    bad = []
    if cfg.num_heads % size:
        bad.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        bad.append(f"num_key_value_heads={cfg.num_kv_heads}")
    if cfg.intermediate_size % size:
        bad.append(f"intermediate_size={cfg.intermediate_size}")
    return bad


def valid_degrees(cfg: ModelConfig) -> list[int]:
    """Every tensor-parallel degree this model's counts allow (1 always)."""
    return [n for n in range(1, cfg.num_heads + 1) if not _fits(cfg, n)]


def check_degree(cfg: ModelConfig, size: int) -> None:
    """Raises UnsupportedModelError naming the counts `size` does not divide and the
    degrees that divide every count."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size}: must be >= 1")
    bad = _fits(cfg, size)
    if bad:
        degrees = ", ".join(map(str, valid_degrees(cfg)))
        raise UnsupportedModelError(
            f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by tensor_parallel_size={size} "
            "(KV heads may instead divide it: they are then replicated); "
            f"degrees that divide every count: {degrees}"
        )


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank `rank` of `size`: the half-open ranges of the full model it owns."""

    size: int
    rank: int
    q_heads: range  # query heads (and o_proj's input columns, head by head)
    kv_heads: range  # KV heads: those q_heads read (GQA groups never straddle ranks)
    intermediate: range  # gate / up rows, down_proj's input columns
    vocab: range  # embedding and LM head rows
    vocab_rows_max: int  # the longest rank's vocab run: every rank's logits padded to it to gather
    kv_replicas: int  # ranks holding each of this rank's KV heads (1: sharded, not replicated)
    experts: range = range(0)  # a mixture of experts' experts this rank holds, whole (expert parallelism)

    @classmethod
    def of(cls, cfg: ModelConfig, size: int, rank: int) -> TensorParallelLayout:
        check_degree(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank}: must be in [0, {size})")
        q = cfg.num_heads // size
        if cfg.num_kv_heads >= size:
            kv = cfg.num_kv_heads // size
            kv_start, replicas = rank * kv, 1
        else:  # fewer KV heads than ranks: each is replicated on size / num_kv_heads ranks
            kv, replicas = 1, size // cfg.num_kv_heads
            kv_start = rank // replicas
        ffn = cfg.intermediate_size // size
        per = -(-cfg.vocab_size // size)
        vocab_start = min(rank * per, cfg.vocab_size)
        experts = cfg.moe.num_experts if cfg.moe is not None else 0
        return cls(size, rank, range(rank * q, (rank + 1) * q), range(kv_start, kv_start + kv),
                   range(rank * ffn, (rank + 1) * ffn), range(vocab_start, min(vocab_start + per, cfg.vocab_size)),
                   per, replicas, range(rank * experts // size, (rank + 1) * experts // size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model one rank computes: its heads, KV heads, intermediate columns, vocab rows
        and experts (head_dim fixed explicitly: it no longer follows hidden / heads)."""
        moe = None
        if cfg.moe is not None:  # shared experts on rank 0 only: the group's all-reduce adds them once
            moe = replace(cfg.moe, held=(self.experts.start, self.experts.stop),
                          shared_intermediate_size=cfg.moe.shared_intermediate_size if self.rank == 0 else 0)
        return replace(cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate), vocab_size=len(self.vocab), head_dim=cfg.head_dim,
                       moe=moe)
