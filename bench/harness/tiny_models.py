"""Tiny random-weight Llama-family checkpoints written with transformers' save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320

KINDS = {
    # name: (config class name, overrides)
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                            tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=4096)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # head_dim apart from hidden / heads (32, not 16), as Qwen3's own sizes have it
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    # 8 experts, top 2: the routing spreads a prompt's tokens over most of them; layer 0 dense
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                                         mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2)),
    # windows of 8 on alternate layers (shorter than most prompts), sinks, YaRN, biased experts
    # whose SwiGLU clamp bites at this weight scale (limit 1.5), MXFP4-sized experts (64)
    "gpt-oss": ("GptOssConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                     num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.5,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 128})),
    # latent attention (q LoRA, rotary pairs, DeepSeek's YaRN with its softmax correction), 8 routed
    # experts in 4 groups (top 2 of them), a shared expert, layer 0 dense; 4 heads whose values
    # (24) are wider than their keys' parts
    "deepseek-v3": ("DeepseekV3Config", dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                                             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                             v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8,
                                             num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                             first_k_dense_replace=1, routed_scaling_factor=2.5,
                                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                              "original_max_position_embeddings": 128,
                                                              "rope_theta": 10000.0})),
    # DeepSeek-V2 with V2-Lite's attention (no q LoRA): softmax scores, the top-k among the best 2
    # of 4 groups (a group's score its best expert's), two shared experts
    "deepseek-v2": ("DeepseekV2Config", dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                                             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             n_shared_experts=2, first_k_dense_replace=1,
                                             routed_scaling_factor=1.5)),
}


def write_tiny_checkpoint(folder: Path, kind: str, seed: int = 0, max_positions: int = 512,
                          vocab: int = VOCAB, **config) -> Path:
    """A `kind` checkpoint (KINDS) with random weights in `folder`; `vocab` 49152 matches
    SmolLM2's tokenizer, whose chat template then renders prompts the model takes; `config`:
    fields of the kind's config to set otherwise."""
    import transformers

    cls_name, overrides = KINDS[kind]
    config_cls = getattr(transformers, cls_name)
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = config_cls(**{**base, **overrides, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def load_hf(folder: Path, dtype=torch.float64):
    import transformers

    # experts (MoE families) by transformers' eager loop over experts, the reference: its
    # grouped-matmul path takes no float64
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager")
    return model.eval()


# SmolLM2-135M's shape (hidden, layers, MLP, vocabulary, context, rope, tied embeddings):
# a model of its size with other head counts, for a benchmark whose degree SmolLM2's 9
# query / 3 KV heads do not allow.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152,
                     max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def write_sized_checkpoint(folder: Path, num_heads: int, num_kv_heads: int, head_dim: int, seed: int = 0,
                           **shape) -> Path:
    """A random-weight Llama checkpoint of SMOLLM2_SHAPE (each key overridable), with the
    given heads. transformers' own initialisation (normal, std 0.02): activations stay in
    float range at any depth, no denormals to slow a timing down. For timing, not for text."""
    import transformers

    cfg = transformers.LlamaConfig(**{**SMOLLM2_SHAPE, **shape}, num_attention_heads=num_heads,
                                   num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
