"""`dtype="auto"` by measurement where the CPU has no native bf16 (kernels/dtype_choice.py,
kernels/dtype_calibration.py).

Nothing here depends on which dtype wins on this host: the decision is tested on given
rates, and the calibration (forced with `always`, so it runs on a host with native bf16
too) is tested for what it writes and reads, not for its verdict.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine.config import resolve_dtype
from kernels.dtype_calibration import Measurement, Rates, measure
from kernels.dtype_choice import CalibrationMode, Source, cache_key, choose, decide
from kernels.host import cpu


def _measurement(bf16: tuple[float, float], float32: tuple[float, float], median_ratio: float = 1.5) -> Measurement:
    return Measurement(bf16=Rates(*bf16), float32=Rates(*float32), seconds=0.5, median_ratio=median_ratio)


def test_the_faster_dtype_is_chosen_and_the_reason_names_both_rates_and_the_ratio():
    faster_bf16 = _measurement(bf16=(256.0, 2000.0), float32=(203.0, 1800.0))
    dtype, why = decide(faster_bf16)
    assert dtype == torch.bfloat16
    assert f"{faster_bf16.bf16.tokens_per_s:.0f}" in why and f"{faster_bf16.float32.tokens_per_s:.0f}" in why
    assert f"{faster_bf16.ratio:.2f}x" in why and faster_bf16.ratio > 1

    faster_f32 = _measurement(bf16=(30.0, 300.0), float32=(50.0, 500.0))
    dtype, why = decide(faster_f32)
    assert dtype == torch.float32 and f"{faster_f32.ratio:.2f}x" in why and faster_f32.ratio < 1


def test_one_rate_mixes_decode_and_prefill_tokens_one_to_one():
    rates = Rates(decode=100.0, prefill=1000.0)
    # As many prompt as output tokens: 1 s of decode per 100 tokens, 0.1 s of prefill.
    assert rates.tokens_per_s == pytest.approx(200 / 1.1)
    # Decode twice as fast in bf16, prefill the same: the mix is faster, by less than 2x.
    m = _measurement(bf16=(200.0, 1000.0), float32=(100.0, 1000.0))
    assert 1 < m.ratio < 2 and decide(m)[0] == torch.bfloat16


def test_a_verdict_the_median_repeats_contradict_is_used_but_not_cached(tmp_path):
    unsettled = _measurement(bf16=(256.0, 2000.0), float32=(203.0, 1800.0), median_ratio=0.9)
    settled = _measurement(bf16=(256.0, 2000.0), float32=(203.0, 1800.0), median_ratio=1.1)
    assert not unsettled.settled and settled.settled
    path = tmp_path / "dtype.json"
    choice = choose(CalibrationMode.ALWAYS, path, measurer=lambda: unsettled)
    assert choice.dtype == torch.bfloat16 and choice.source == Source.MEASURED and "not saved" in choice.reason
    assert not path.exists()
    assert choose(CalibrationMode.ALWAYS, path, measurer=lambda: settled).source == Source.MEASURED
    again = choose(CalibrationMode.ALWAYS, path, measurer=lambda: unsettled)
    assert again.source == Source.CACHED and again.measurement == settled


def test_a_measurement_runs_the_kernels_in_both_dtypes():
    m = measure()
    for rates in (m.bf16, m.float32):
        assert rates.decode > 0 and rates.prefill > 0 and rates.tokens_per_s > 0
    assert m.seconds > 0 and m.median_ratio > 0


class Counted:
    """A measurer returning a given measurement (settled: bf16 1.26x, the Zen 3 host's
    figures), counting its calls: the cache is under test here, not the host's speed."""

    def __init__(self) -> None:
        self.measurement = _measurement(bf16=(256.0, 2000.0), float32=(203.0, 1600.0), median_ratio=1.2)
        self.calls = 0

    def __call__(self) -> Measurement:
        self.calls += 1
        return self.measurement


def test_a_forced_calibration_is_cached_and_read_back_without_measuring(tmp_path):
    path, measurer = tmp_path / "dtype.json", Counted()
    first = choose(CalibrationMode.ALWAYS, path, measurer)
    assert first.source == Source.MEASURED and first.measurement == measurer.measurement and measurer.calls == 1
    assert first.dtype == decide(first.measurement)[0] and "saved to" in first.reason
    written = path.read_bytes()
    entries = json.loads(written)["entries"]
    assert list(entries) == [cache_key()]
    assert cpu().model_name in cache_key() and torch.__version__ in cache_key()
    assert f"{torch.get_num_threads()} threads" in cache_key()

    second = choose(CalibrationMode.ALWAYS, path, measurer)
    assert second.source == Source.CACHED and measurer.calls == 1
    assert second.measurement == first.measurement and second.dtype == first.dtype
    assert "cached" in second.reason
    assert path.read_bytes() == written  # read, not measured and written again


@pytest.mark.parametrize("garbage", ["{not json", '{"version": 1, "entries": []}', '[1, 2]', b"\xff\xfe",
                                     '{"version": 1, "entries": {"KEY": {"bf16": "fast"}}}',
                                     '{"version": 1, "entries": {"KEY": {"bf16": {"decode": -1, "prefill": 1}}}}',
                                     '{"version": 1, "entries": {"KEY": {"bf16": {"decode": 1, "prefill": 1}, '
                                     '"float32": {"decode": 1, "prefill": 1}, "seconds": 1, "median_ratio": NaN}}}'])
def test_a_corrupt_cache_file_is_measured_again_and_rewritten(tmp_path, garbage):
    path, measurer = tmp_path / "dtype.json", Counted()
    if isinstance(garbage, str):
        garbage = garbage.replace("KEY", json.dumps(cache_key())[1:-1]).encode()
    path.write_bytes(garbage)
    choice = choose(CalibrationMode.ALWAYS, path, measurer)
    assert choice.source == Source.MEASURED and measurer.calls == 1
    assert list(json.loads(path.read_text())["entries"]) == [cache_key()]
    assert choose(CalibrationMode.ALWAYS, path, measurer).source == Source.CACHED and measurer.calls == 1


def test_other_hosts_entries_are_kept_and_a_new_thread_count_is_measured_apart(tmp_path):
    path, measurer = tmp_path / "dtype.json", Counted()
    other = {"bf16": {"decode": 1.0, "prefill": 2.0}, "float32": {"decode": 3.0, "prefill": 4.0}, "seconds": 0.1,
             "median_ratio": 0.5}
    path.write_text(json.dumps({"version": 1, "entries": {"another host": other}}))
    before = torch.get_num_threads()
    try:
        choose(CalibrationMode.ALWAYS, path, measurer)
        torch.set_num_threads(before + 1)
        assert choose(CalibrationMode.ALWAYS, path, measurer).source == Source.MEASURED and measurer.calls == 2
    finally:
        torch.set_num_threads(before)
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 3 and entries["another host"] == other


def test_native_bf16_keeps_bf16_with_no_measurement_and_off_keeps_the_capability_rule(tmp_path):
    path, measurer = tmp_path / "dtype.json", Counted()
    off = choose(CalibrationMode.OFF, path, measurer)
    assert off.source == Source.RULE and off.measurement is None and not path.exists()
    assert off.dtype == (torch.bfloat16 if cpu().native_bf16 else torch.float32)
    auto = choose(CalibrationMode.AUTO, path, measurer)
    if cpu().native_bf16:  # AMX / AVX512-BF16: bf16 at no start-up cost
        assert auto.dtype == torch.bfloat16 and auto.source == Source.RULE and not path.exists()
        assert measurer.calls == 0
    else:
        assert auto.source == Source.MEASURED and path.exists() and measurer.calls == 1


def test_the_setting_is_read_from_the_environment(monkeypatch):
    for value, mode in [("", CalibrationMode.AUTO), ("auto", CalibrationMode.AUTO), ("off", CalibrationMode.OFF),
                        ("0", CalibrationMode.OFF), ("always", CalibrationMode.ALWAYS)]:
        monkeypatch.setenv("PDSERVE_DTYPE_CALIBRATION", value)
        assert CalibrationMode.from_env() == mode
    monkeypatch.setenv("PDSERVE_DTYPE_CALIBRATION", "sometimes")
    with pytest.raises(ValueError, match="PDSERVE_DTYPE_CALIBRATION=.sometimes.: use one of auto, off, always"):
        CalibrationMode.from_env()


def test_resolve_dtype_auto_measures_once_and_logs_what_it_measured(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDSERVE_DTYPE_CALIBRATION", "always")
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO):
        dtype, why = resolve_dtype("auto")
    assert "measured" in why and "bf16" in why and "float32" in why and "x (decode" in why
    assert any(why in r.getMessage() for r in caplog.records)
    # A verdict that other work on the host decided is not saved (the host's load, not
    # this test, says which branch runs; both are checked).
    saved = (tmp_path / "pdserve" / "dtype_calibration.json").is_file()
    assert saved == ("saved to" in why)
    again, why_again = resolve_dtype("auto")
    assert ("cached" in why_again) == saved and "cached" not in why
    assert again == dtype or not saved
