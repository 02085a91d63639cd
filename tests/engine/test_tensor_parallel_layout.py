"""The tensor-parallel layout: every rank's slices tile the model, and a degree the model's
counts do not allow is refused with the counts and the degrees that would work."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig, UnsupportedModelError
from engine.parallel.layout import TensorParallelLayout, check_degree, valid_degrees


def _cfg(heads: int, kv: int, ffn: int = 128, vocab: int = 320, head_dim: int = 16) -> ModelConfig:
    return ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=heads * head_dim,
                                      intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=heads,
                                      num_key_value_heads=kv, head_dim=head_dim))


@pytest.mark.parametrize("heads,kv,size", [(8, 8, 2), (8, 2, 2), (8, 4, 4), (8, 2, 4), (8, 1, 4), (4, 1, 2), (4, 2, 1)])
def test_ranks_tile_heads_columns_and_vocab(heads, kv, size):
    cfg = _cfg(heads, kv, vocab=321)
    layouts = [TensorParallelLayout.of(cfg, size, r) for r in range(size)]
    assert [h for lay in layouts for h in lay.q_heads] == list(range(heads))
    assert [c for lay in layouts for c in lay.intermediate] == list(range(cfg.intermediate_size))
    assert [v for lay in layouts for v in lay.vocab] == list(range(321))
    assert all(len(lay.vocab) <= lay.vocab_rows_max for lay in layouts)
    group = heads // kv
    for lay in layouts:
        # every query head a rank owns reads a KV head the same rank owns
        assert {h // group for h in lay.q_heads} <= set(lay.kv_heads)
        assert len(lay.kv_heads) == max(1, kv // size)
        assert lay.kv_replicas == max(1, size // kv)
    held = [h for lay in layouts for h in lay.kv_heads]
    assert sorted(set(held)) == list(range(kv))
    assert all(held.count(h) == max(1, size // kv) for h in range(kv))


def test_local_config_is_one_ranks_model():
    cfg = _cfg(8, 2)
    local = TensorParallelLayout.of(cfg, 4, 3).local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 32, 80)
    assert (local.head_dim, local.hidden_size) == (cfg.head_dim, cfg.hidden_size)


def test_a_degree_the_counts_do_not_allow_is_refused_with_the_degrees_that_work():
    cfg = _cfg(heads=9, kv=9, ffn=126, head_dim=8)
    with pytest.raises(UnsupportedModelError) as err:
        TensorParallelLayout.of(cfg, 2, 0)
    msg = str(err.value)
    assert "num_attention_heads=9" in msg and "num_key_value_heads=9" in msg and "tensor_parallel_size=2" in msg
    assert "intermediate_size" not in msg  # 126 divides by 2: only the counts that fail are named
    assert msg.endswith("degrees that divide every count: 1, 3, 9")
    assert valid_degrees(cfg) == [1, 3, 9]


def test_kv_heads_must_divide_or_be_divided():
    cfg = _cfg(heads=12, kv=3, ffn=120)
    check_degree(cfg, 6)  # 3 KV heads over 6 ranks: each on two ranks
    check_degree(cfg, 3)
    with pytest.raises(UnsupportedModelError, match=r"num_key_value_heads=3 is not divisible by tensor_parallel_size=4"):
        check_degree(cfg, 4)
    assert valid_degrees(cfg) == [1, 3, 6, 12]  # 2: 3 KV heads neither divide by nor divide 2


def test_rank_and_degree_are_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        check_degree(_cfg(4, 2), 0)
    with pytest.raises(ValueError, match=r"rank=2: must be in \[0, 2\)"):
        TensorParallelLayout.of(_cfg(4, 2), 2, 2)
