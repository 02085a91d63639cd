"""The host's CPU as lscpu names it: every benchmark's figures carry it (they differ by CPU kind)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class HostCPU:
    name: str  # lscpu's "Model name" ("unknown" where lscpu is missing or silent)
    family: str  # "CPU family" ("" if not given)
    model: str  # "Model" ("" if not given)

    def describe(self) -> str:
        """e.g. "AMD EPYC (family 25, model 17)"."""
        return f"{self.name} (family {self.family or '?'}, model {self.model or '?'})"


def host_cpu() -> HostCPU:
    """This host's CPU, read from lscpu."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}
    return HostCPU(fields.get("Model name") or "unknown", fields.get("CPU family", ""), fields.get("Model", ""))
