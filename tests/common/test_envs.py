"""common/envs.py: each variable typed, its default, and a clear error for a bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import envs


def test_the_cache_folder_follows_pdserve_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert envs.cache_dir() == Path.home() / ".cache" / "pdserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_dir() == tmp_path / "xdg" / "pdserve"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert envs.cache_dir() == tmp_path / "mine"
    assert envs.log_dir() == tmp_path / "mine" / "logs"


@pytest.mark.parametrize("value, expected", [("", "auto"), ("Native", "native"), (" torch ", "torch")])
def test_the_kernel_choice_is_one_of_four(monkeypatch, value, expected):
    monkeypatch.setenv("PDSERVE_KERNELS", value)
    assert envs.kernels() == expected


def test_a_wrong_kernel_choice_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"PDSERVE_KERNELS='cuda': use one of auto, torch, triton, native"):
        envs.kernels()


@pytest.mark.parametrize("value, expected", [("", "auto"), ("0", "off"), ("no", "off"), ("ALWAYS", "always")])
def test_dtype_calibration_takes_the_usual_spellings_of_off(monkeypatch, value, expected):
    monkeypatch.setenv("PDSERVE_DTYPE_CALIBRATION", value)
    assert envs.dtype_calibration() == expected


def test_flags_refuse_what_is_neither_on_nor_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_TRACE", "maybe")
    with pytest.raises(ValueError, match="PDSERVE_TRACE='maybe'"):
        envs.trace_enabled()
    monkeypatch.setenv("PDSERVE_TRACE", "off")
    assert envs.trace_enabled() is False


def test_the_parent_pid_is_a_number_or_nothing(monkeypatch):
    monkeypatch.delenv(envs.PARENT_PID, raising=False)
    assert envs.parent_pid() is None
    monkeypatch.setenv(envs.PARENT_PID, "4242")
    assert envs.parent_pid() == 4242
    monkeypatch.setenv(envs.INTERNAL_TOKEN, "")
    assert envs.internal_token() is None
