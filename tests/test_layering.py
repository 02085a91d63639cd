"""Dependencies point down: gateway, deploy -> prefill, decode -> worker -> rpc, transfer ->
engine -> kernels (bench/ may use anything). Read from the source (every import statement,
at any depth, not only at module top), so a new arrow the wrong way fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each package may import of ours (besides itself).
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "transfer": {"engine", "kernels"},
    "rpc": {"engine", "kernels"},
    "worker": {"engine", "kernels", "rpc", "transfer"},
    "prefill": {"engine", "kernels", "rpc", "transfer", "worker"},
    "decode": {"engine", "kernels", "rpc", "transfer", "worker"},
    "gateway": {"engine", "kernels", "rpc", "worker"},
    "deploy": {"engine", "kernels", "rpc", "transfer", "worker", "gateway", "prefill", "decode"},
}
# `pdserve bench` is one of the command's subcommands: its dispatcher alone reaches bench/.
ENTRY_POINTS = {("deploy/cli.py", "bench")}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    ours = set(ALLOWED) | {"bench", "tests"}
    wrong = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for top in sorted(_imports(path) & ours - {package} - ALLOWED[package]):
            if (rel, top) not in ENTRY_POINTS:
                wrong.append(f"{rel} imports {top}")
    assert not wrong, "\n".join(wrong)


def test_the_engine_package_is_the_engine_only():
    """The gRPC contract and the worker process plumbing live outside engine/."""
    assert not (REPO / "engine" / "rpc").exists()
    names = {p.stem for p in (REPO / "engine").glob("*.py")}
    assert not names & {"worker_loop", "worker_process", "parent_watch", "liveness"}, names


INTERNALS = {"scheduler", "kv_manager", "model", "runner", "kv_cache"}


def test_nothing_outside_the_engine_reaches_into_it():
    """Workers, the gateway, deploy and the benchmarks use LLMEngine's methods, never its
    scheduler, KV manager, model, runner or KV cache objects (`<...>.engine.<internal>`)."""
    wrong = []
    for package in sorted(set(ALLOWED) - {"engine", "kernels"}) + ["bench"]:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
                    owner = node.value
                    if (isinstance(owner, ast.Name) and owner.id == "engine") or \
                            (isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                        wrong.append(f"{path.relative_to(REPO)}:{node.lineno} .engine.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_no_installed_distribution_claims_one_of_our_import_names():
    """Our top-level packages are import names on sys.path; an installed distribution with
    the same top-level name (Hugging Face's `kernels`, which transformers 5.25 requires and
    imports) would shadow one of them, or be shadowed, depending on sys.path order."""
    from importlib import metadata

    ours = set(ALLOWED) | {"bench"}
    claims = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name is None or name.lower() == "pdserve":
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        top += [f.parts[0] for f in (dist.files or []) if len(f.parts) > 1 and f.parts[1] == "__init__.py"]
        for package in ours & set(top):
            claims.setdefault(package, set()).add(name)
    assert not claims, f"installed distributions claim our import names: {claims} (pin them out in pyproject.toml)"
