"""What `dtype="auto"` means on this host, and the small cache that keeps a measured answer.

Where the CPU computes bf16 natively (AMX-BF16 or AVX512-BF16) `auto` is bf16 at no start-up
cost: nothing is measured. Elsewhere (AVX2-only, AVX-512 without bf16) the native kernels
run bf16 on float32 FMA tiles over half the bytes, and which dtype is faster differs by
host (bf16 was 1.26x float32 on an AMD Zen 3 host, bench/RESULTS.md), so a short
calibration (kernels/dtype_calibration.py, under a second) measures both at the first
start and the faster one is chosen. The measurement is cached per (CPU model, ISA, torch
version, thread count, kernel setting and sources) in `dtype_calibration.json` under
$PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve; written
atomically under a lock, so workers starting together measure once. A file that cannot
be read back is measured again and rewritten.

PDSERVE_DTYPE_CALIBRATION (read here and nowhere else): `auto` (the default, as above),
`off` (no measurement: float32 where bf16 is not native) or `always` (measure on hosts
with native bf16 too: benchmarks and tests of this path).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import torch

import kernels
from common import envs
from kernels import native
from kernels.dtype_calibration import Measurement, Rates, measure
from kernels.host import auto_dtype as capability_dtype
from kernels.host import cpu

log = logging.getLogger(__name__)

ENV = "PDSERVE_DTYPE_CALIBRATION"
CACHE_FILE = "dtype_calibration.json"
CACHE_VERSION = 1


class CalibrationMode(Enum):
    AUTO = "auto"  # measure only where the CPU has no native bf16
    OFF = "off"  # never measure: the capability rule
    ALWAYS = "always"  # measure (or read the cache) on every host

    @classmethod
    def from_env(cls) -> CalibrationMode:
        """PDSERVE_DTYPE_CALIBRATION: auto (default), off (also 0/false/no) or always."""
        return cls(envs.dtype_calibration())


class Source(Enum):
    RULE = "rule"  # by what the CPU can do, nothing measured
    MEASURED = "measured"  # measured in this call (and cached)
    CACHED = "cached"  # read back from an earlier measurement on this host


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    source: Source
    measurement: Measurement | None = None


def decide(m: Measurement) -> tuple[torch.dtype, str]:
    """The faster dtype by the measurement (bf16 on a tie: half the memory), and why."""
    dtype = torch.bfloat16 if m.ratio >= 1 else torch.float32
    why = (f"bf16 {m.bf16.tokens_per_s:.0f} tok/s, float32 {m.float32.tokens_per_s:.0f} tok/s: bf16/float32 "
           f"{m.ratio:.2f}x (decode {m.bf16.decode / m.float32.decode:.2f}x, prefill "
           f"{m.bf16.prefill / m.float32.prefill:.2f}x; SmolLM2-135M-shaped steps, {torch.get_num_threads()} threads)")
    return dtype, why


def auto_dtype(device: str = "cpu") -> tuple[torch.dtype, str]:
    """The dtype `auto` means for `device` on this host, and why (engine/config.py logs it)."""
    if device != "cpu":
        return capability_dtype(device)
    choice = choose()
    return choice.dtype, choice.reason


def choose(mode: CalibrationMode | None = None, path: Path | None = None,
           measurer: Callable[[], Measurement] = measure) -> DtypeChoice:
    """`auto` on this CPU: by capability, or measured by `measurer` (`path`: the cache
    file, default cache_path()). `mode` defaults to PDSERVE_DTYPE_CALIBRATION."""
    mode = mode or CalibrationMode.from_env()
    if mode == CalibrationMode.OFF or (mode == CalibrationMode.AUTO and cpu().native_bf16):
        dtype, why = capability_dtype()
        return DtypeChoice(dtype, why + (f" ({ENV}=off: not measured)" if mode == CalibrationMode.OFF else ""),
                           Source.RULE)
    if kernels.kernel_choice() == "triton":  # Triton's interpreter on CPU: far too slow to measure
        dtype, why = capability_dtype()
        return DtypeChoice(dtype, why + " (PDSERVE_KERNELS=triton: not measured)", Source.RULE)
    path = path or cache_path()
    key = cache_key()
    with _locked(path):
        entries = _read(path)
        cached = _measurement(entries.get(key))
        if cached is not None:
            dtype, why = decide(cached)
            return DtypeChoice(dtype, f"a calibration on this CPU, cached in {path}: {why}", Source.CACHED, cached)
        log.info("measuring bf16 and float32 on this CPU for dtype auto (%s)", key)
        m = measurer()
        if m.settled:
            entries[key] = asdict(m)
            _write(path, entries)
            saved = f"saved to {path}"
        else:
            saved = (f"not saved: the median repeats gave bf16/float32 {m.median_ratio:.2f}x, other work on "
                     f"the host decided it; the next start measures again")
            log.warning("dtype calibration unsettled: %s", saved)
    dtype, why = decide(m)
    return DtypeChoice(dtype, f"measured on this CPU just now ({m.seconds:.1f} s, {saved}): {why}",
                       Source.MEASURED, m)


def cache_path() -> Path:
    """CACHE_FILE in pdserve's cache folder (common/envs.py: cache_dir)."""
    return envs.cache_dir() / CACHE_FILE


def cache_key() -> str:
    """What a measurement holds for: this CPU, torch, its threads now, the kernels."""
    caps = cpu()
    onednn = ", oneDNN bf16" if caps.onednn_bf16 else ""
    return (f"{caps.model_name} | {caps.isa} (torch {caps.torch_isa}{onednn}) | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads | kernels {kernels.kernel_choice()} {_sources_hash()}")


@functools.cache
def _sources_hash() -> str:
    """The native kernels' and the calibration's sources: a new version measures again."""
    files = [*native.SOURCES, *native.HEADERS, Path(__file__).with_name("dtype_calibration.py")]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time measures (two at once would share the cores and both be wrong).
    Where the cache's folder cannot be written this process measures unlocked."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")
    except OSError as e:
        log.warning("dtype calibration cache %s cannot be written (%s): measuring without it", path, e)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read(path: Path) -> dict[str, object]:
    """The cache's entries; {} where there is no file or it cannot be read back (logged)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("dtype calibration cache %s is unreadable (%s): measuring again", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        log.warning("dtype calibration cache %s is not version %d's format: measuring again", path, CACHE_VERSION)
        return {}
    return data["entries"]


def _measurement(entry: object) -> Measurement | None:
    """A cache entry as a Measurement, or None where it is missing or malformed."""
    try:
        def rates(d: dict) -> Rates:
            r = Rates(float(d["decode"]), float(d["prefill"]))
            if not all(math.isfinite(v) and v > 0 for v in (r.decode, r.prefill)):
                raise ValueError("rates must be positive")
            return r

        m = Measurement(rates(entry["bf16"]), rates(entry["float32"]), float(entry["seconds"]),
                        float(entry["median_ratio"]))
        if not (math.isfinite(m.median_ratio) and m.median_ratio > 0):
            raise ValueError("median_ratio must be positive")
        return m
    except (TypeError, KeyError, ValueError):
        if entry is not None:
            log.warning("a malformed dtype calibration entry (%r): measuring again", entry)
        return None


def _write(path: Path, entries: dict[str, object]) -> None:
    """Atomically: a reader finds the old file or the new one, never a part."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
        tmp.replace(path)
    except OSError as e:
        log.warning("dtype calibration cache %s not written (%s): the next start measures again", path, e)
