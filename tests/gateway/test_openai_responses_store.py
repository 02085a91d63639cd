"""The Responses API's store of answers (gateway/responses/store.py and its folder
backing, gateway/responses/folder_store.py), without a gateway: tenants kept apart,
the age and byte bounds, a tenant's share of the bytes that another cannot take, the
folder shared by processes, and the event loop's reads and writes done on a thread."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from gateway.errors import APIError
from gateway.responses.folder_store import STALE_TEMP_S, FolderStore
from gateway.responses.store import MemoryStore
from gateway.completions.protocol import ChatMessage

BACKINGS = {"memory": lambda folder, clock, max_bytes=2000: MemoryStore(max_bytes, 60, clock),
            "folder": lambda folder, clock, max_bytes=2000: FolderStore(folder, max_bytes, 60, clock=clock)}
SAID = [ChatMessage(role="user", content="x" * 400)]


def _answer(rid: str) -> dict:
    return {"id": rid, "output": []}


@pytest.mark.parametrize("backing", BACKINGS)
def test_the_store_keeps_tenants_apart_and_bounds_age_and_size(backing, tmp_path):
    now = [0.0]
    store = BACKINGS[backing](tmp_path, lambda: now[0])
    for i in range(3):
        assert store.put("a", _answer(f"r{i}"), SAID)
        now[0] += 10
    assert store.get("b", "r0") is None and store.get("a", "r0").messages == tuple(SAID)
    with pytest.raises(APIError) as e:
        asyncio.run(store.history("b", "r0"))  # another tenant's id is one it cannot know of
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store.put("a", _answer("r3"), SAID * 2)  # past 2000 bytes: the oldest goes
    assert store.get("a", "r0") is None and store.get("a", "r1") is not None and store.size <= 2000
    assert not store.put("a", _answer("big"), SAID * 6)  # alone over the bound: not kept
    now[0] += 45  # r1 (stored at 10) is past 60 s old, r2 (at 20) is not
    assert store.get("a", "r1") is None and store.get("a", "r2") is not None


def test_a_store_that_is_off_says_so_for_a_chain_and_a_read_alike():
    off = MemoryStore(max_bytes=0)
    assert off.keeper("a", SAID) is None and asyncio.run(off.history("a", None)) == ()
    for call, param in ((off.history("a", "r2"), "previous_response_id"),
                        (off.find("a", "r2", "response_id"), "response_id")):
        with pytest.raises(APIError) as e:
            asyncio.run(call)
        assert e.value.status == 400 and e.value.param == param and "stores no responses" in e.value.message


@pytest.mark.parametrize("backing", BACKINGS)
def test_a_noisy_tenant_evicts_its_own_entries_not_a_quiet_ones(backing, tmp_path):
    """Tenant q keeps one entry; tenant n writes ten times the whole bound. n's oldest go,
    q's stays; and once n holds the most, a write of q's that passes the bound takes n's."""
    now = [1000.0]
    store = BACKINGS[backing](tmp_path, lambda: now[0], max_bytes=8000)
    assert store.put("q", _answer("quiet"), SAID)
    for i in range(200):
        now[0] += 0.1
        assert store.put("n", _answer(f"n{i}"), SAID)
    assert store.get("q", "quiet") is not None
    assert store.get("n", "n199") is not None and store.get("n", "n0") is None
    assert store.size <= 8000 * 9 / 8
    now[0] += 0.1
    assert store.put("q", _answer("quiet2"), SAID)  # q's second entry: the bytes go from n
    assert store.get("q", "quiet") is not None and store.get("q", "quiet2") is not None


def test_a_folder_store_is_shared_by_processes_within_one_bound(tmp_path):
    """Two processes' stores over one folder (as two gateway processes have): each finds
    what the other stored, for its tenant only, in files of this user alone; an id is no
    path out of the folder; and however the writes alternate, the folder stays within the
    bound plus an eighth (each process looking over it on a thread), the oldest gone first."""
    folder = tmp_path / "responses"
    folder.mkdir()
    first, second = (FolderStore(folder, 20_000, 60, processes=2) for _ in range(2))
    said = [ChatMessage(role="user", content="y" * 300)]
    assert first.put("a", _answer("r0"), said)
    assert second.get("a", "r0").messages == tuple(said)
    assert asyncio.run(second.history("a", "r0")) == tuple(said)
    assert second.get("b", "r0") is None and first.get("b", "r0") is None
    (name,) = os.listdir(folder)
    assert (folder / name).stat().st_mode & 0o777 == 0o600 and "r0" not in name
    for escape in ("../r0", "/etc/passwd", "..", "r0/../r0"):
        assert first.put("a", _answer(escape), said) and first.get("a", escape) is not None
    assert sorted(p.parent for p in tmp_path.rglob("*") if p.is_file()) == [folder] * 5
    sizes = []

    async def serving():  # as in a gateway process: each write on a thread, each look on another
        for i in range(200):
            store = (first, second)[i % 2]
            assert await store.store("a", _answer(f"n{i}"), said)
            while store._looking:
                await asyncio.sleep(0.001)
            sizes.append(first.size)

    asyncio.run(serving())
    entry = first.get("a", "n199").size
    assert max(sizes) <= 20_000 * 9 / 8 + entry and sizes[-1] <= 20_000 * 9 / 8, max(sizes)
    assert first.get("a", "n199") and second.get("a", "n198") and first.get("a", "n100") is None
    assert second.get("a", "r0") is None  # the oldest went first


def test_a_look_over_the_folder_leaves_another_process_s_write_under_way(tmp_path):
    """A temporary file another process is still writing (older than every entry: a slow
    write) is not the oldest entry to remove, so its rename still lands; one left by a
    process that died mid-write (older than STALE_TEMP_S) is removed."""
    now = [10_000.0]
    store = FolderStore(tmp_path, 2000, 600, clock=lambda: now[0])
    writing = tmp_path / ".somebody-else.json.4242"
    writing.write_bytes(b"{" * 1500)
    os.utime(writing, (now[0] - 30, now[0] - 30))
    for i in range(4):
        now[0] += 1
        assert store.put("a", _answer(f"r{i}"), SAID)  # past 2000 bytes with the temporary file: a look
    assert writing.exists()
    os.replace(writing, tmp_path / "somebody-else.json")  # the other process's rename
    os.utime(tmp_path / "somebody-else.json", (now[0], now[0]))
    left = tmp_path / ".died-mid-write.json.4343"
    left.write_bytes(b"{")
    os.utime(left, (now[0] - STALE_TEMP_S - 1,) * 2)
    store._evict()
    assert not left.exists() and store.get("a", "r3") is not None


def test_the_event_loop_reads_and_writes_a_folder_on_a_thread(tmp_path):
    """`store`, `fetch`, `history` and the keeper do the folder's file I/O off the loop's
    thread, and an awaited keep has written the entry when it returns."""

    class Watched(FolderStore):
        def __init__(self, *args):
            super().__init__(*args)
            self.threads: set[int] = set()

        def get(self, *args):
            self.threads.add(threading.get_ident())
            return super().get(*args)

        def _write(self, *args):
            self.threads.add(threading.get_ident())
            return super()._write(*args)

    store = Watched(tmp_path, 1 << 20, 60)

    async def serving() -> int:
        keep = store.keeper("a", SAID)
        await keep({"id": "r0", "object": "response", "output": [
            {"type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]}]})
        assert [n for n in os.listdir(tmp_path) if not n.startswith(".")]  # written before keep returned
        assert [m.text() for m in await store.history("a", "r0")] == ["x" * 400, "Hi."]
        assert (await store.fetch("a", "r0")).response["id"] == "r0"
        assert await store.store("a", _answer("r1"), SAID)
        return threading.get_ident()

    loop_thread = asyncio.run(serving())
    assert store.threads and loop_thread not in store.threads
