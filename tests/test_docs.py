"""The docs and the code's own words name only files that exist: every path in README.md,
docs/*.md and the modules' docstrings and comments (a module, a page, a config) is found
from the repository's root or from the top-level folder the text is about (docs/kernels.md's
`csrc/...` is under kernels/), so a move or a split that forgets its docs fails here.
Outputs a benchmark writes (bench/results/...) are not looked for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_PATH = re.compile(r"(?<![\w/.-])((?:[A-Za-z_]+/)+[A-Za-z_0-9.-]+\.(?:py|md|proto|yaml|toml|cpp|h|json|txt))")
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
PACKAGES = ("common", "engine", "kernels", "transfer", "rpc", "worker", "prefill", "decode", "gateway", "deploy",
            "bench", "tests")
CODE = sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def _found(path: str) -> bool:
    if path.startswith("bench/results/"):
        return True
    roots = [REPO, *(p for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("."))]
    return any((root / path).exists() for root in roots)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_page_names_exists(doc):
    missing = sorted({m.group(1) for m in _PATH.finditer(doc.read_text()) if not _found(m.group(1))})
    assert not missing, f"{doc.relative_to(REPO)} names files that are not in the tree: {missing}"


def test_every_file_the_code_names_exists():
    missing = [f"{path.relative_to(REPO)}: {m.group(1)}" for path in CODE for m in _PATH.finditer(path.read_text())
               if not _found(m.group(1))]
    assert not missing, "\n".join(missing)
