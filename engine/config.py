"""Model and engine configuration: one small frozen dataclass per concern.

`ModelConfig` is what the model needs from a checkpoint's config.json; `CacheConfig`
sizes the paged KV pool; `SchedulerConfig` bounds one engine step. Each is validated on
construction so a bad value fails at start-up with a message that names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.models import find_family
from engine.models.family import UnsupportedModelError, yarn_mscale
from kernels.dtype_choice import auto_dtype
from kernels.host import log_choice

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

AUTO_DTYPE = "auto"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> tuple[torch.dtype, str]:
    """A dtype name as a torch dtype, with the reason for it (logged once). `auto` is bf16
    where this CPU computes it natively, elsewhere the faster of bf16 and float32 as measured
    on this host at the first start and cached (kernels/dtype_choice.py); the reason gives
    both rates and their ratio."""
    if isinstance(dtype, torch.dtype):
        resolved, why = dtype, "it was asked for"
    elif dtype == AUTO_DTYPE:
        resolved, why = auto_dtype(device)
    elif dtype in DTYPES:
        resolved, why = DTYPES[dtype], "it was asked for"
    else:
        raise ValueError(f"dtype {dtype!r} is not supported; use {AUTO_DTYPE!r} or one of {sorted(DTYPES)}")
    log_choice("dtype", str(resolved).removeprefix("torch."), why)
    return resolved, why


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return resolve_dtype(dtype)[0]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (engine/rotary.py): the ramp between interpolated and extrapolated frequencies, and
    # the factor cos and sin are scaled by (1 for every other type)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """What a mixture-of-experts family's config.json says about its experts (engine/moe.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize_top_k: bool  # renormalise the top-k weights to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts (the others are dense)
    held: tuple[int, int] | None = None  # [start, stop) of the experts one rank holds (None: all)
    # gpt-oss: the router's logits biased, its softmax over the top-k logits only; biased experts
    # whose activation is the clamped SwiGLU (alpha, limit) instead of SiLU(gate) * up
    router_bias: bool = False
    softmax_after_top_k: bool = False
    expert_bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None
    # DeepSeek-V3: sigmoid scores (softmax otherwise), a correction bias added to them to choose
    # (not to weigh), the top-k taken among the best `groups[1]` of `groups[0]` expert groups,
    # the weights scaled by `routed_scale`; and shared experts every token goes through (their
    # intermediate size; 0: none)
    sigmoid_scores: bool = False
    correction_bias: bool = False
    groups: tuple[int, int] | None = None
    # DeepSeek's float32 router that weighs the chosen experts by their own scores (V2: softmax
    # scores, a group's score its best expert's; V3: sigmoid, its two best summed)
    deepseek_router: bool = False
    group_by_max: bool = False
    routed_scale: float = 1.0
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k}: must be in [1, the {self.num_experts} experts]")

    @property
    def experts_held(self) -> range:
        return range(*self.held) if self.held is not None else range(self.num_experts)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, engine/mla.py): a token's KV is one latent
    of `kv_lora_rank` values (RMS-normed) and one rotary key of `qk_rope_head_dim`, the same for
    every head; queries come through a LoRA of `q_lora_rank` (None: one projection)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale squared where the config has one
    rope_interleave: bool  # the rotary dimensions in pairs (DeepSeek's checkpoints), not halves

    @property
    def entry_size(self) -> int:
        """Values a token's cache entry holds per layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one Llama-family checkpoint (Llama, Mistral, Qwen2, Qwen3, and the
    mixture-of-experts Qwen3-MoE and Mixtral)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMS norm over each q and k head before rotary
    moe: MoeConfig | None = None  # experts in place of the MLP on some layers
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    # layers whose attention reads only the last `sliding_window` positions (gpt-oss's
    # "sliding_attention" layers); the others read the whole context. Empty for the families
    # whose every layer has the window (Mistral): those serve up to the window, see max_model_len
    window_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in each softmax's denominator
    # DeepSeek: latent attention in place of q|k|v. The pool then holds one "KV head" whose K and
    # V planes are the two halves of a token's entry (num_kv_heads 1, head_dim entry_size / 2,
    # rounded up): every path that moves blocks moves the latent unchanged, no byte wasted
    mla: MlaConfig | None = None
    # DeepSeek-V3: multi-token-prediction layers past the decoder's (engine/mtp.py), loaded only when asked
    mtp_layers: int = 0
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. With a sliding window on every layer, full attention is exact
        only up to it; with windows on some layers, attention masks each to its window."""
        if self.sliding_window is not None and not self.window_layers:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """The dimensions a query or key head rotates (MLA: its rotary part only)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_size * dtype.itemsize

    def num_parameters(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if (m := self.mla) is not None:  # the query (through its LoRA), the latent's projection and norm, kv_b, o
            h, heads = self.hidden_size, self.num_heads
            query = h * heads * m.qk_head_dim if m.q_lora_rank is None else \
                m.q_lora_rank * (h + 1 + heads * m.qk_head_dim)
            attn = query + h * m.entry_size + m.kv_lora_rank * (1 + heads * (m.qk_nope_head_dim + m.v_head_dim)) \
                + heads * m.v_head_dim * h
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        total = self.num_layers * (attn + mlp + norms) + embed + head + self.hidden_size
        if self.moe is not None:  # those layers' experts and router instead of the dense MLP
            experts = self.moe.num_experts * (3 * self.hidden_size * self.moe.intermediate_size + self.hidden_size) \
                + 3 * self.hidden_size * self.moe.shared_intermediate_size
            total += len(self.moe.sparse_layers) * (experts - mlp)
        return total

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a model folder needs a Hugging Face config.json")
        return cls.from_dict(json.loads(file.read_text()), name=path.name)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """The shared fields read here; the family's own (biases, norms, experts, windows,
        sinks) by its module in the registry (engine/models/)."""
        family, arch = find_family(cfg.get("architectures") or [], cfg.get("model_type"))
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant is not None and quant not in family.quantization:
            loads = f"{family.name} loads {', '.join(family.quantization)}" if family.quantization else \
                f"{family.name} loads no quantized checkpoint"
            raise UnsupportedModelError(f"quantization_config quant_method={quant!r} is not supported ({loads}); "
                                        "serve the unquantized checkpoint")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        own = family.config_fields(cfg, arch)
        moe, mla = own.pop("moe", None), own.pop("mla", None)
        shared = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_config(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            moe=MoeConfig(**moe) if moe is not None else None,
            mla=MlaConfig(**mla) if mla is not None else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
        )
        return cls(**{**shared, **own})  # a family may set a shared field its own way (MLA's KV head)


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older
    # checkpoints have top-level `rope_theta` and an optional `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    fields = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
              if params.get(k) is not None}
    if rope_type == "yarn":
        fields.setdefault("factor", cfg["max_position_embeddings"] / params["original_max_position_embeddings"])
        fields["attention_factor"] = _yarn_attention_factor(cfg, params)
    return RopeConfig(theta=float(theta), type=rope_type, **fields)


def _yarn_attention_factor(cfg: dict[str, Any], params: dict[str, Any]) -> float:
    """What YaRN scales cos and sin by: the config's own, else 0.1 ln(factor) + 1 (with DeepSeek's
    mscale / mscale_all_dim, their ratio), as transformers computes it."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
    if params.get("mscale") and params.get("mscale_all_dim"):
        return yarn_mscale(factor, params["mscale"]) / yarn_mscale(factor, params["mscale_all_dim"])
    return yarn_mscale(factor)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens; with `disk_dir`, the
    prefix cache's disk tier there, at most `disk_bytes` (engine/disk_tier.py)."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from memory_gib
    memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks}: must be >= 1")
        if self.memory_gib <= 0:
            raise ValueError(f"memory_gib={self.memory_gib}: must be > 0")
        if self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes={self.disk_bytes}: must be > 0")
        if self.disk_dir is not None and not self.enable_prefix_caching:
            raise ValueError("a disk tier (disk_dir) needs prefix caching: its blocks are found by their hashes")

    def resolve_num_blocks(self, bytes_per_token: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, int(self.memory_gib * 2**30) // (bytes_per_token * self.block_size))


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds of one engine step: a token budget, a sequence cap and the context limit."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    max_waiting: int | None = None  # None: unbounded queue
    # A prefill chunk takes at most this many tokens before waiting requests are admitted;
    # what is left of the budget then tops it up. None: a quarter of the budget.
    long_prefill_token_threshold: int | None = None

    @property
    def prefill_chunk_cap(self) -> int:
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 4)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    model_path: Path
    dtype: torch.dtype
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    tensor_parallel_size: int = 1  # ranks the model is sharded over (engine/parallel/)
    # The other ranks' KV pools in memory shared with rank 0, so a transfer agent there can
    # register them (a P/D worker's); off, each rank's pool is its own, on huge pages where
    # the host allows, which shared memory gets only where shmem huge pages are enabled.
    share_rank_pools: bool = False
    # build and load the checkpoint's multi-token-prediction layers (engine/mtp.py; a
    # speculative decoder's); off, they are skipped at load and take no memory
    load_mtp: bool = False
