"""Dependencies point down: bench -> deploy -> gateway, prefill, decode -> worker -> rpc,
transfer -> engine -> kernels -> common, where common is the torch-free layer everything
shares (the gateway and rpc import nothing else below them, so they never load torch); inside deploy, the Ray runtime -> the planner (deploy/planner/)
-> the log readers (deploy/observe/), never the other way; tests may use anything, and
nothing but bench and tests imports bench. No two modules import each other, however long
the way round. Read from the source (every import statement, at any depth, not only at
module top), so a new arrow the wrong way fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each package may import of ours (besides itself).
ALLOWED = {
    "common": set(),
    "kernels": {"common"},
    "engine": {"common", "kernels"},
    "transfer": {"common", "engine", "kernels"},
    "rpc": {"common"},
    "worker": {"common", "engine", "kernels", "rpc", "transfer"},
    "prefill": {"common", "engine", "kernels", "rpc", "transfer", "worker"},
    "decode": {"common", "engine", "kernels", "rpc", "transfer", "worker"},
    "gateway": {"common", "rpc"},
    "deploy": {"common", "engine", "kernels", "rpc", "transfer", "worker", "gateway", "prefill", "decode"},
}
# Inside deploy: what each subpackage may import of deploy besides itself (the rest of deploy
# is the Ray runtime, which may import them).
DEPLOY_INSIDE = {"deploy.observe": set(), "deploy.planner": {"deploy.observe"}}


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
            wrong.append(f"{rel} imports {top}")
    assert not wrong, "\n".join(wrong)


def test_the_benchmarks_import_nothing_of_the_tests():
    """bench/ is installed with the package (`pdserve bench` runs it); the harness both use is
    bench/harness/, so nothing under bench/ may need tests/."""
    wrong = [str(p.relative_to(REPO)) for p in sorted((REPO / "bench").rglob("*.py")) if "tests" in _imports(p)]
    assert not wrong, wrong


def _modules() -> dict[str, Path]:
    """Every module of ours by its dotted name (a package by its __init__)."""
    found = {}
    for package in sorted(set(ALLOWED) | {"bench", "tests"}):
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at any depth (`from a import b` is a.b where
    a.b is a module, else a; relative imports resolved)."""
    modules = _modules()

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {ours(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets |= {ours(f"{base}.{a.name}") for a in node.names}
        graph[name] = targets - {None, name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_round_a_circle():
    """Function-level imports count: a circle hidden in a function is still a circle."""
    circles = _circles(_import_graph())
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(DEPLOY_INSIDE))
def test_the_planner_and_the_log_readers_import_nothing_of_the_ray_runtime(package):
    """deploy/planner/ (profile, simulator, tuning, the online planner's decision) and
    deploy/observe/ (reading the logs back) serve the runtime and bench, and reach neither."""
    assert (REPO / package.replace(".", "/") / "__init__.py").exists()
    graph = _import_graph()
    allowed = DEPLOY_INSIDE[package] | {package}
    wrong = [f"{m} imports {t}" for m in sorted(graph) if _within(m, package) for t in sorted(graph[m])
             if t.split(".")[0] in ("deploy", "bench") and not any(_within(t, a) for a in allowed)]
    assert not wrong, "\n".join(wrong)


def test_the_gateway_and_rpc_load_no_torch():
    """What the gateway process imports (its app, the router, rpc's conversions) runs on
    common/ alone: torch is not loaded, even indirectly."""
    import subprocess
    import sys

    code = ("import sys, gateway.app, gateway.__main__, gateway.routing.router, rpc.convert, common.model_source; "
            "print(sorted(m for m in ('torch', 'engine', 'kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_environment_variable_is_read_in_common_envs():
    """One typed module reads the environment (a write for a child process or a library,
    such as Ray's or Triton's variables, may happen where it is needed)."""
    wrong = []
    for package in sorted(ALLOWED):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "common" / "envs.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                read = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("get", "getenv") and "environ" in ast.unparse(node.func.value)
                        or isinstance(node, ast.Call) and ast.unparse(node.func) == "os.getenv"
                        or isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ"
                        and isinstance(node.ctx, ast.Load))
                if read:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
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
