"""The controller's health decisions (deploy/health.py), from host reports alone."""

from __future__ import annotations

from deploy.health import Action, judge_health, judge_report
from deploy.slot import HostReport, Slot, SlotState


def _slot(incarnation: int = 5) -> Slot:
    return Slot("decode", "0", pg=None, host=None, state=SlotState.READY, address="127.0.0.1:1", incarnation=incarnation)


def _report(incarnation: int = 5, address: str = "127.0.0.1:1", alive: bool = True, role: str = "decode",
            exit_code: int | None = None) -> HostReport:
    return HostReport(address, alive, 100, 99, incarnation, "node", "/log", role, "0", exit_code)


def test_each_report_leads_to_one_decision():
    assert judge_report(_slot(), None).action is Action.HOST_LOST
    assert judge_report(_slot(), _report()).action is Action.CHECK
    died = judge_report(_slot(), _report(alive=False, exit_code=-9))
    assert died.action is Action.RESTART and died.why == "its process exited (killed by signal 9)"
    rank = judge_report(_slot(), _report(alive=False, exit_code=70))
    assert rank.why == "its process exited (code 70: a tensor-parallel rank of the worker died)"
    assert judge_report(_slot(), _report(incarnation=6, address="")).action is Action.WAIT
    assert judge_report(_slot(), _report(incarnation=6, address="127.0.0.1:2")).action is Action.ADOPT
    again = judge_report(_slot(), _report(incarnation=6, address="", alive=False))
    assert again.action is Action.RESTART and "new process" in again.why
    # a worker that moved from prefill to decode, its host restarted by Ray: it starts as prefill again
    birth = judge_report(_slot(), _report(incarnation=6, address="127.0.0.1:2", role="prefill"))
    assert birth.action is Action.RESTORE_ROLE and "prefill" in birth.why
    assert judge_report(_slot(), _report(incarnation=6, address="", role="prefill")).action is Action.WAIT


def test_a_worker_is_replaced_only_after_unhealthy_after_failures_in_a_row():
    assert [judge_health(n, 3).action for n in (1, 2, 3, 4)] == [Action.NONE, Action.NONE, Action.RESTART,
                                                                 Action.RESTART]


def test_the_status_shows_states_as_their_names():
    slot = _slot()
    slot.report = _report()
    assert slot.public()["state"] == "ready" and slot.public()["pid"] == 100
    assert _slot().public()["pid"] is None


def test_a_move_is_in_place_only_between_pools_of_one_bundle():
    from pathlib import Path

    from deploy.config import DeployConfig
    from deploy.role_change import Moves, in_place_moves

    alike = DeployConfig()
    assert in_place_moves({"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1}, alike) == Moves("decode", "prefill", 1)
    assert in_place_moves({"prefill": 1, "decode": 1}, {"prefill": 0, "decode": 3}, alike) == Moves("prefill", "decode", 1)
    assert in_place_moves({"prefill": 1, "decode": 1}, {"prefill": None, "decode": 3}, alike) is None  # grows only
    assert in_place_moves({"prefill": 2, "decode": 2}, {"prefill": 1, "decode": 1}, alike) is None  # shrinks only
    off = DeployConfig.from_dict({"move_in_place": False})
    assert in_place_moves({"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1}, off) is None
    apart = DeployConfig.from_dict({"prefill": {"resources": {"prefill": 1}}})
    assert in_place_moves({"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1}, apart) is None
    parallel = DeployConfig.from_dict({"prefill": {"tp_size": 2}, "decode": {"tp_size": 2}})
    assert in_place_moves({"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1}, parallel) is None  # ranks stay
    configs = Path(__file__).resolve().parents[2] / "deploy" / "configs"
    gpu, multi = (DeployConfig.from_yaml(configs / f"{name}.yaml") for name in ("gpu-8x-node", "multi-node"))
    assert in_place_moves({"prefill": 4, "decode": 4}, {"prefill": 5, "decode": 3}, gpu) == Moves("decode", "prefill", 1)
    assert in_place_moves({"prefill": 4, "decode": 4}, {"prefill": 5, "decode": 3}, multi) is None  # nodes per pool
