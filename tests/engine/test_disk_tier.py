"""The prefix cache's disk tier (engine/disk_tier.py): files bit-exact, bounded LRU, found
again after a restart, keyed by compatibility and salt, corrupt files never served; and
the whole engine on a tiny model: an evicted prefix comes back from disk with the same
greedy tokens as an engine without the tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.harness.tiny_models import write_tiny_checkpoint
from common.block_hash import block_hashes
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.disk_tier import DiskTier
from engine.private_folder import UnsafeFolder
from engine.kv_cache_manager import KVCacheManager
from engine.llm_engine import LLMEngine

SHAPE = (6, 2, 3, 4, 2, 8)  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def random_pool(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_comes_back_bit_exact(tmp_path, dtype):
    pool = random_pool(dtype)
    tier = DiskTier(tmp_path, "k", pool, 1 << 20)
    tier.save(h(1), 2)
    tier.flush()
    assert tier.path_of(h(1)).is_file()
    assert tier.load(h(1), 4)
    assert torch.equal(pool[4].view(torch.uint8), pool[2].view(torch.uint8))
    assert not tier.load(h(9), 0) and not tier.has(h(9))
    s = tier.stats()
    assert (s.entries, s.written, s.loaded, s.corrupt) == (1, 1, 1, 0)
    assert s.bytes == tier.file_bytes
    tier.close()


def test_the_bound_holds_and_the_least_recently_used_goes_first(tmp_path):
    pool = random_pool(torch.float32)
    probe = DiskTier(tmp_path / "probe", "k", pool, 1 << 20)
    tier = DiskTier(tmp_path, "k", pool, 3 * probe.file_bytes)
    for i in range(3):
        tier.save(h(i), i)
    tier.flush()
    assert tier.load(h(0), 5)  # a read is a use: 1 is now the least recently used
    tier.save(h(3), 3)
    tier.flush()
    assert [tier.has(h(i)) for i in range(4)] == [True, False, True, True]
    assert not tier.path_of(h(1)).exists()
    s = tier.stats()
    assert s.entries == 3 and s.bytes <= s.max_bytes
    assert len(list(tier.folder.glob("*.kvb"))) == 3
    tier.save(h(2), 2)  # kept already: a use, not a second write
    tier.flush()
    assert tier.stats().written == 4
    tier.close()
    probe.close()


def test_a_reopened_tier_finds_its_blocks_and_another_key_does_not(tmp_path):
    pool = random_pool(torch.bfloat16)
    tier = DiskTier(tmp_path, "model-a", pool, 1 << 20)
    for i in range(3):
        tier.save(h(i), i)
    tier.close()  # writes what is queued
    (tier.folder / "leftover.123.tmp").write_bytes(b"half a block")  # a killed writer's

    fresh = torch.zeros_like(pool)
    again = DiskTier(tmp_path, "model-a", fresh, 1 << 20)
    s = again.stats()
    assert (s.entries, s.bytes) == (3, 3 * again.file_bytes)
    assert not (again.folder / "leftover.123.tmp").exists()
    for i in range(3):
        assert again.load(h(i), i)
        assert torch.equal(fresh[i].view(torch.uint8), pool[i].view(torch.uint8))
    again.close()

    other = DiskTier(tmp_path, "model-b", torch.zeros_like(pool), 1 << 20)
    assert other.stats().entries == 0 and not any(other.has(h(i)) for i in range(3))
    other.close()


def test_a_reopened_tier_keeps_the_lru_order_of_mtimes(tmp_path):
    pool = random_pool(torch.float32)
    tier = DiskTier(tmp_path, "k", pool, 1 << 20)
    for i in range(3):
        tier.save(h(i), i)
    tier.close()
    for i, age in enumerate((10, 30, 20)):  # seconds since last used: 1 is the least recently used
        os.utime(tier.path_of(h(i)), (1_000_000 - age, 1_000_000 - age))
    again = DiskTier(tmp_path, "k", torch.zeros_like(pool), 2 * tier.file_bytes)  # one must go: the LRU one
    assert [again.has(h(i)) for i in range(3)] == [True, False, True]
    again.close()


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-7] ^= 0x10
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupt_file_is_deleted_counted_and_never_served(tmp_path, how):
    pool = random_pool(torch.float32)
    tier = DiskTier(tmp_path, "k", pool, 1 << 20)
    tier.save(h(1), 1)
    tier.flush()
    _corrupt(tier.path_of(h(1)), how)
    assert not tier.load(h(1), 5)
    assert not tier.path_of(h(1)).exists() and not tier.has(h(1))
    assert tier.stats().corrupt == 1 and tier.stats().loaded == 0
    tier.close()


def test_a_truncated_file_found_at_open_is_deleted_and_counted(tmp_path):
    pool = random_pool(torch.float32)
    tier = DiskTier(tmp_path, "k", pool, 1 << 20)
    tier.save(h(1), 1)
    tier.save(h(2), 2)
    tier.close()
    _corrupt(tier.path_of(h(2)), "truncate")
    again = DiskTier(tmp_path, "k", pool, 1 << 20)
    assert again.has(h(1)) and not again.has(h(2)) and again.stats().corrupt == 1
    assert not again.path_of(h(2)).exists()
    again.close()


# -------------------------------------------------------------- the KV manager's bringing-in

def _fill(kv: KVCacheManager, rid: str, tokens: list[int], salt: str = "") -> list[int]:
    computed, _ = kv.get_computed_blocks(tokens, salt)
    table = kv.allocate_slots(rid, len(tokens), computed)
    assert table is not None
    kv.cache_blocks(rid, tokens, len(tokens), salt)
    return table


def test_a_pool_that_cannot_spare_the_blocks_computes_instead(tmp_path):
    pool = torch.randn(5, 1, 2, 4, 1, 2)  # 4 usable blocks of 4 tokens, one scratch
    tier = DiskTier(tmp_path, "k", pool, 1 << 20)
    kv = KVCacheManager(4, 4)
    kv.use_lower_tier(tier)
    prompt = list(range(13))  # 3 full blocks before the last token
    _fill(kv, "a", prompt)
    kv.free("a")
    _fill(kv, "b", list(range(100, 116)))  # 4 blocks: every cached block of "a" is evicted to disk
    tier.flush()
    assert all(tier.has(x) for x in block_hashes(prompt, 4)[:3])
    assert kv.num_cached_tokens(prompt) == 12  # the disk's blocks counted, not read
    assert kv.get_computed_blocks(prompt) == ([], 0)  # no block is free: nothing brought in
    assert kv.lower_tier_tokens == 0
    kv.free("b")
    blocks, cached = kv.get_computed_blocks(prompt)
    assert cached == 12 and kv.lower_tier_tokens == 12
    assert kv.allocate_slots("a", len(prompt), blocks) is not None  # nothing allocated in between
    kv.check_invariants()
    kv.free("a")
    tier.close()


def test_one_run_is_brought_in_and_num_cached_tokens_says_so_beforehand(tmp_path):
    pool = torch.randn(9, 1, 2, 4, 1, 2)  # 8 usable blocks of 4 tokens, one scratch
    tier = DiskTier(tmp_path, "k", pool, 1 << 20)
    kv = KVCacheManager(8, 4)
    kv.use_lower_tier(tier)
    prompt = list(range(25))  # 6 full blocks before the last token, 7 blocks in all
    t = _fill(kv, "a", prompt)
    kv.free("a")  # free queue: the unused block, then t6 .. t0
    unused = next(b for b in range(8) if b not in t)
    keep = [unused, t[6], t[5], t[4], t[2], t[0]]
    kv.pool.touch(keep)  # leaves t3, t1 at the head of the free queue
    second = pool[t[1]].clone()
    taken = kv.pool.allocate(2)  # evicts them: to disk
    kv.pool.free(taken)
    kv.pool.free(keep)
    tier.flush()
    hashes = block_hashes(prompt, 4)
    assert [kv.pool.lookup(x) is None for x in hashes] == [False, True, False, True, False, False]
    # pool, disk, pool, then disk again: a second run is not brought in
    assert kv.num_cached_tokens(prompt) == 12
    blocks, cached = kv.get_computed_blocks(prompt)
    assert cached == 12 and kv.lower_tier_tokens == 4 and kv.pool.lookup(hashes[1]) == blocks[1]
    assert tier.stats().loaded == 1 and torch.equal(pool[blocks[1]], second)
    kv.check_invariants()
    tier.close()


# -------------------------------------------------------------- the engine on a tiny model

BLOCK = 16
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(80)]  # 5 blocks: 4 cacheable before the last token
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama-gqa", seed=7)


def make_engine(model: Path, disk: Path | None = None, num_blocks: int = 12, tp: int = 1) -> LLMEngine:
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, disk_dir=str(disk) if disk else None,
                        disk_bytes=1 << 26)
    return LLMEngine.from_folder(model, "float32", cache, SchedulerConfig(max_num_batched_tokens=64,
                                                                          max_model_len=512),
                                 tensor_parallel_size=tp, share_rank_pools=tp > 1)


def run(engine: LLMEngine, rid: str, prompt: list[int], salt: str = "") -> tuple[list[int], int]:
    """Greedy tokens of one request and the prompt tokens its prefix cache served."""
    engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
    tokens, cached = [], None
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.token_ids
            cached = d.num_cached_tokens if cached is None else cached
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    return tokens, cached


def evict(engine: LLMEngine, prompt: list[int], salt: str = "") -> None:
    """Run other prompts until none of `prompt`'s blocks is in the pool; wait for the writer."""
    for i in range(3):
        run(engine, f"other-{i}", [(11 * j + 5 * i + 1) % 300 + 3 for j in range(150)])
    assert all(engine.kv_manager.pool.lookup(x) is None for x in block_hashes(prompt, BLOCK, salt))
    engine.disk_tier.flush()


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    engine = make_engine(model, num_blocks=64)
    tokens, _ = run(engine, "ref", PROMPT)
    return tokens


def test_an_evicted_prefix_comes_back_from_disk_with_the_same_tokens(model, reference, tmp_path):
    engine = make_engine(model, tmp_path)
    first, cached = run(engine, "p1", PROMPT)
    assert first == reference and cached == 0
    evict(engine, PROMPT)
    assert engine.num_cached_tokens(PROMPT) == 64  # counted on disk, not read
    before = engine.disk_tier_tokens
    again, cached = run(engine, "p2", PROMPT)
    assert again == reference
    assert cached == 64 and engine.disk_tier_tokens - before == 64  # only the last block was computed
    assert engine.disk_tier.stats().loaded >= 4
    engine.close()

    restarted = make_engine(model, tmp_path)  # the same folder: its blocks are found again
    assert restarted.disk_tier.stats().entries >= 4
    tokens, cached = run(restarted, "p3", PROMPT)
    assert tokens == reference and cached == 64 and restarted.disk_tier_tokens == 64
    restarted.close()


def test_a_corrupt_block_is_recomputed_from_there_on(model, reference, tmp_path):
    engine = make_engine(model, tmp_path)
    run(engine, "p1", PROMPT)
    evict(engine, PROMPT)
    third = block_hashes(PROMPT, BLOCK)[2]
    _corrupt(engine.disk_tier.path_of(third), "flip")
    tokens, cached = run(engine, "p2", PROMPT)
    assert tokens == reference
    assert cached == 32 and engine.disk_tier_tokens == 32  # blocks 0 and 1 read; 2 on computed
    assert engine.disk_tier.stats().corrupt == 1 and not engine.disk_tier.path_of(third).exists()
    engine.close()


def test_another_salt_does_not_hit_the_disk_entries(model, reference, tmp_path):
    engine = make_engine(model, tmp_path)
    run(engine, "a1", PROMPT, salt="tenant:a")
    evict(engine, PROMPT, salt="tenant:a")
    assert engine.num_cached_tokens(PROMPT, "tenant:a") == 64
    assert engine.num_cached_tokens(PROMPT, "tenant:b") == 0 and engine.num_cached_tokens(PROMPT) == 0
    tokens, cached = run(engine, "b1", PROMPT, salt="tenant:b")
    assert tokens == reference and cached == 0 and engine.disk_tier_tokens == 0
    tokens, cached = run(engine, "a2", PROMPT, salt="tenant:a")
    assert tokens == reference and cached == 64 and engine.disk_tier_tokens == 64
    engine.close()


def test_another_dtype_does_not_read_the_blocks(model, tmp_path):
    engine = make_engine(model, tmp_path)
    run(engine, "p1", PROMPT)
    evict(engine, PROMPT)
    engine.close()
    cache = CacheConfig(block_size=BLOCK, num_blocks=12, disk_dir=str(tmp_path))
    other = LLMEngine.from_folder(model, "float64", cache, SchedulerConfig(max_num_batched_tokens=64,
                                                                           max_model_len=512))
    assert other.disk_tier.folder != engine.disk_tier.folder and other.disk_tier.stats().entries == 0
    assert other.num_cached_tokens(PROMPT) == 0
    other.close()


def test_a_tensor_parallel_engine_refuses_the_tier(model, tmp_path):
    with pytest.raises(ValueError, match="disk tier .* not supported with tensor parallelism"):
        LLMEngine.from_folder(model, "float32", CacheConfig(num_blocks=12, disk_dir=str(tmp_path)),
                              tensor_parallel_size=2)


# ------------------------------------------------------------------- who may read and plant

def test_folders_and_files_are_private_and_names_say_nothing_of_the_block(tmp_path):
    root = tmp_path / "kv"
    tier = DiskTier(root, "k", random_pool(torch.float32), 1 << 20)
    tier.save(h(1), 1)
    tier.flush()
    for folder in (root, root / "k"):
        assert folder.stat().st_mode & 0o777 == 0o700, oct(folder.stat().st_mode)
    files = list((root / "k").iterdir())
    assert [f.stat().st_mode & 0o777 for f in files] == [0o600] and (root / "secret").stat().st_mode & 0o777 == 0o600
    assert files[0].stem != h(1).hex()  # a tenant's salted hash cannot be looked for by name
    tier.close()


@pytest.mark.parametrize("how", ["another user's", "group-writable"])
def test_a_folder_someone_else_could_have_planted_is_refused(tmp_path, how, monkeypatch):
    folder = tmp_path / "shared" / "decode-0"
    folder.mkdir(parents=True, mode=0o700)
    if how == "group-writable":
        folder.chmod(0o775)
    else:  # the folder is this process's, so to the tier's eyes another user made it
        monkeypatch.setattr(os, "getuid", lambda: os.stat(folder).st_uid + 1)
    with pytest.raises(UnsafeFolder, match="another user made it first" if how == "another user's" else
                       "writable by others"):
        DiskTier(folder, "k", random_pool(torch.float32), 1 << 20)


def test_a_block_written_without_the_secret_is_never_served(tmp_path):
    """A forged file under the right name (an attacker who could write there, or another
    deployment's tier): its checksum is not keyed with this tier's secret, so it fails."""
    pool = random_pool(torch.float32)
    other = DiskTier(tmp_path / "other", "k", pool, 1 << 20)
    other.save(h(1), 1)
    other.close()
    tier = DiskTier(tmp_path / "mine", "k", torch.zeros_like(pool), 1 << 20)
    forged = tier.path_of(h(1))
    forged.write_bytes(other.path_of(h(1)).read_bytes())
    tier.close()
    mine = torch.zeros_like(pool)
    again = DiskTier(tmp_path / "mine", "k", mine, 1 << 20)
    assert again.has(h(1)) and not again.load(h(1), 0)
    assert again.stats().corrupt == 1 and not forged.exists() and torch.count_nonzero(mine[0]) == 0
    again.close()


def test_a_latent_models_blocks_come_back_from_disk_with_the_same_tokens(tmp_path):
    """A DeepSeek model's pool holds latents (one entry a token a layer, halved over the K and V
    planes): its blocks go to disk and come back exactly like per-head K/V; at tensor-parallel
    degree 2 too, whose ranks share one pool (engine/parallel/rank_group.py): what the tier
    reads back into it every rank attends over."""
    latent = write_tiny_checkpoint(tmp_path / "deepseek", "deepseek-v3", seed=7)
    want, _ = run(make_engine(latent, num_blocks=64), "ref", PROMPT)
    engine = make_engine(latent, tmp_path / "disk")
    assert run(engine, "p1", PROMPT) == (want, 0)
    evict(engine, PROMPT)
    assert run(engine, "p2", PROMPT) == (want, 64) and engine.disk_tier.stats().loaded >= 4
    engine.close()
    engine = make_engine(latent, tmp_path / "disk", tp=2)  # the tier's blocks, written at one rank, read at two
    assert run(engine, "p3", PROMPT) == (want, 64) and engine.disk_tier.stats().loaded >= 4
    engine.close()
