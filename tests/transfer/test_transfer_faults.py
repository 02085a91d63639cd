"""transfer/faults.py: the injected KV-transfer faults the chaos suite uses, on a KVPusher
over the fake NIXL of tests/transfer/fake_nixl.py (the real system runs them in tests/e2e/test_chaos.py)."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import REGISTRY

from common import envs
from tests.transfer.fake_nixl import fake_agent
from transfer.faults import FaultFile, TransferFault
from transfer.push import KVPusher, PushStatus


@pytest.mark.parametrize("text, fault", [
    ("", TransferFault()),
    ("delay_s=1.5", TransferFault(delay_s=1.5)),
    (" error_rate=0.25\n only=prefill-0 ", TransferFault(error_rate=0.25, only="prefill-0")),
    ("delay_s=inf", TransferFault(delay_s=math.inf)),
])
def test_parse(text, fault):
    assert TransferFault.parse(text) == fault


@pytest.mark.parametrize("text, words", [
    ("delay=1", "'delay=1'"), ("error_rate", "'error_rate'"), ("error_rate=2", "within [0, 1]"),
    ("delay_s=-1", "delay_s must be >= 0"), ("delay_s=soon", "could not convert"),
])
def test_parse_refuses(text, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        TransferFault.parse(text)


@pytest.fixture
def fault_file(tmp_path, monkeypatch):
    path = tmp_path / "transfer-fault"
    monkeypatch.setenv(envs.FAULT_TRANSFER_FILE, str(path))
    monkeypatch.setattr("transfer.faults._REREAD_S", 0.0)
    return path


def test_no_file_or_a_bad_one_is_no_fault(fault_file, caplog):
    faults = FaultFile("prefill-0-1")
    assert faults.path == fault_file and faults.current() is None
    fault_file.write_text("delay_s=often")
    assert faults.current() is None
    assert faults.current() is None
    assert caplog.text.count("ignored") == 1  # said once
    fault_file.write_text("delay_s=1 only=decode")
    assert faults.current() is None  # another worker's fault
    fault_file.write_text("delay_s=1 only=prefill-0-")
    assert faults.current() is None  # whole name parts only
    assert not TransferFault(only="prefill-1").applies_to("prefill-10-3")
    fault_file.write_text("delay_s=1 only=prefill-0")
    assert faults.current() == TransferFault(delay_s=1.0, only="prefill-0")


def test_an_injected_error_fails_the_push_like_a_broken_link(fault_file):
    fault_file.write_text("error_rate=1")
    agent = fake_agent()
    pusher = KVPusher(agent)
    label = {"reason": "InjectedTransferError"}
    before = REGISTRY.get_sample_value("pdserve_kv_transfer_failures_total", label) or 0
    pusher.start("r", "decode-0-1")
    pusher.push("r", [1, 2], [10, 11])
    pusher.push("r", [3], [12], last=True)  # the push already failed: ignored
    [failed] = pusher.poll()
    assert failed.status is PushStatus.FAILED and failed.reason.startswith("InjectedTransferError")
    assert failed.remote_blocks == (10, 11) and agent.nixl.made == [] and pusher.num_active == 0
    assert REGISTRY.get_sample_value("pdserve_kv_transfer_failures_total", label) == before + 1


def test_a_delay_holds_writes_back_and_a_stuck_link_ends_at_the_timeout(fault_file):
    agent = fake_agent()
    nixl, pusher = agent.nixl, KVPusher(agent)
    fault_file.write_text("delay_s=600")
    pusher.start("slow", "decode-0-1")
    pusher.push("slow", [1], [10], last=True)
    assert pusher.poll() == [] and nixl.made == []  # held back
    fault_file.write_text("delay_s=0.05")  # counted from when the write was queued
    time.sleep(0.1)
    assert pusher.poll() == [] and len(nixl.made) == 1  # posted once its delay is over
    nixl.made[0].state = "DONE"
    assert [e.status for e in pusher.poll()] == [PushStatus.DONE]

    fault_file.write_text("delay_s=inf")
    pusher.start("stuck", "decode-0-1", timeout_s=0.1)
    pusher.push("stuck", [1], [10], last=True)
    time.sleep(0.15)
    [failed] = pusher.poll()
    assert (failed.status, failed.reason, failed.remote_blocks) == (PushStatus.FAILED, "timeout", (10,))
    assert len(nixl.made) == 1  # the stuck write was never posted

    pusher.start("healed", "decode-0-1")
    pusher.push("healed", [2], [20], last=True)
    fault_file.unlink()  # the link heals: what waited goes at once
    assert pusher.poll() == [] and len(nixl.made) == 2
