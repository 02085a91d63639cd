"""Injected KV-transfer faults, read from the file PDSERVE_FAULT_TRANSFER_FILE names
(common/envs.py): the chaos suite and tests write it while a deployment runs.

    delay_s=1.5 error_rate=0.25 only=prefill-0

`delay_s` holds every write back that long after it was queued (`inf`: never posted, a
stuck link); `error_rate` fails that share of writes at posting, the way NIXL reports a
broken link; `only` limits the fault to agents named so or below (`prefill-1` is
`prefill-1-<incarnation>`, not `prefill-10-...`). No file (the
usual case), an empty file or an unreadable line: no fault. The file is re-read at most
every 0.1 s.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from common import envs

log = logging.getLogger(__name__)

_REREAD_S = 0.1


class InjectedTransferError(RuntimeError):
    """A write failed because a fault file said so."""


@dataclass(frozen=True)
class TransferFault:
    delay_s: float = 0.0
    error_rate: float = 0.0
    only: str = ""

    @classmethod
    def parse(cls, text: str) -> TransferFault:
        """`key=value` words; raises ValueError naming what is wrong."""
        fields: dict[str, object] = {}
        for word in text.split():
            key, sep, value = word.partition("=")
            if not sep or key not in ("delay_s", "error_rate", "only"):
                raise ValueError(f"{word!r}: expected delay_s=, error_rate= or only=")
            fields[key] = value if key == "only" else float(value)
        fault = cls(**fields)
        if not (fault.delay_s >= 0 and 0 <= fault.error_rate <= 1):
            raise ValueError(f"{text.strip()!r}: delay_s must be >= 0 and error_rate within [0, 1]")
        return fault

    def applies_to(self, agent_name: str) -> bool:
        return not self.only or agent_name == self.only or agent_name.startswith(self.only + "-")

    @property
    def stuck(self) -> bool:
        return math.isinf(self.delay_s)


class FaultFile:
    """The fault in force for one agent, from the file (None when there is none)."""

    def __init__(self, agent_name: str, path: Path | None = None):
        self.agent_name = agent_name
        self.path = path if path is not None else envs.fault_transfer_file()
        self._read_at = -math.inf
        self._fault: TransferFault | None = None
        self._bad = ""

    def current(self) -> TransferFault | None:
        if self.path is None:
            return None
        now = time.monotonic()
        if now - self._read_at >= _REREAD_S:
            self._read_at = now
            self._fault = self._read()
        return self._fault

    def _read(self) -> TransferFault | None:
        try:
            text = self.path.read_text()
        except OSError:  # no file: no fault
            return None
        try:
            fault = TransferFault.parse(text)
        except ValueError as e:
            if str(e) != self._bad:  # say it once, not every 0.1 s
                self._bad = str(e)
                log.warning("%s: ignored: %s", self.path, e)
            return None
        return fault if fault.applies_to(self.agent_name) and (fault.delay_s or fault.error_rate) else None
