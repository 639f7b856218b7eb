"""The public names of ``zpath`` are pinned: a change to them is a decision."""
import ast
import pathlib
import subprocess
import sys

import zpath

ROOT = pathlib.Path(__file__).resolve().parent.parent

PUBLIC = {"init", "connect", "shutdown", "trace", "Cluster", "pmap", "jit", "program", "ProgramFunction", "Mesh",
          "P", "NamedSharding", "device_put", "make_virtual_device_set", "VirtualDeviceSet", "VirtualDevice", "Slice", "Future",
          "ZpathError", "ProtocolError", "RemoteError", "HostLost", "Closed", "Broken",
          "DeadlineExceeded", "ResourceError"}


def test_public_names_are_pinned():
    assert set(zpath.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(zpath, name) is not None, name


def test_unknown_name_is_an_attribute_error():
    try:
        zpath.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("zpath.no_such_name did not raise")


def _loaded(modules: str, which: str) -> str:
    """In a fresh interpreter, import ``modules`` and print the sorted names in
    sys.modules for which the expression ``which`` (over ``m``) holds."""
    code = f"import sys, {modules}\nprint(sorted(m for m in sys.modules if {which}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_controller_and_cluster_tools_do_not_import_jax():
    assert _loaded("zpath, zpath.controller.server, zpath.cluster.cli, zpath.cluster.launcher",
                   "m == 'jax' or m.startswith('jax.')") == "[]"


def test_the_cli_starts_without_the_wire_protocol():
    """`zpath down` and `zpath --help` import neither numpy nor the message
    records (most of a second to import)."""
    assert _loaded("zpath.cluster.cli", "m in ('numpy', 'zpath.net.messages', 'zpath.client.connection', "
                   "'zpath.cluster.launcher')") == "[]"


def test_client_and_cluster_tools_do_not_import_the_controller_or_the_workers():
    """The client library and the cluster tooling talk to the controller and
    the workers over the wire only (the CLI runs their main(), importing it then)."""
    assert _loaded("zpath.client.session, zpath.client.tracer, zpath.cluster.cli, zpath.cluster.ssh, "
                   "zpath.cluster.slurm, "
                   "zpath.cluster.remote, zpath.cluster.state, zpath.cluster.testing",
                   "m.startswith(('zpath.controller', 'zpath.worker'))") == "[]"


def _imports(path: pathlib.Path) -> tuple[set[str], list[tuple[int, str]]]:
    """The zpath modules ``path`` imports at module level, and every import
    inside a function (line, module)."""
    top: set[str] = set()
    inner: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    inner += [(sub.lineno, a.name) for a in sub.names]
                elif isinstance(sub, ast.ImportFrom):
                    inner.append((sub.lineno, sub.module or ""))
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name for a in node.names if a.name.startswith("zpath")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zpath"):
            top |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return top, inner


CLIENT_AND_CLUSTER = sorted(p for d in ("client", "cluster") for p in (ROOT / "zpath" / d).glob("*.py"))


def test_client_and_cluster_import_at_module_top():
    """No imports inside functions in zpath/client and zpath/cluster, but the
    CLI's: of the controller's, the worker's and the simulated worker's main()
    (run only by `zpath controller`/`zpath worker`: the worker's imports JAX), and of the launchers
    and the connection, only by the subcommands that use them (so that `zpath
    down` and `zpath --help` start fast: see test_the_cli_starts_without_the_wire_protocol)."""
    allowed = {("cli.py", "zpath.controller.server"), ("cli.py", "zpath.worker.server"),
               ("cli.py", "zpath.worker.simulate"),
               ("cli.py", "zpath.cluster.ssh"), ("cli.py", "zpath.cluster.slurm"),
               ("cli.py", "zpath.cluster.launcher"), ("cli.py", "zpath.client.trace"),
               ("cli.py", "zpath.client.connection"), ("cli.py", "zpath.net")}
    found = [(p.name, line, mod) for p in CLIENT_AND_CLUSTER for line, mod in _imports(p)[1]
             if (p.name, mod) not in allowed]
    assert not found


def test_client_and_cluster_modules_import_no_cycle():
    graph = {}
    for p in CLIENT_AND_CLUSTER:
        name = f"zpath.{p.parent.name}.{p.stem}"
        graph[name] = {m for m in _imports(p)[0] if m != name}
    modules = set(graph)
    edges = {a: {b for b in deps if b in modules} for a, deps in graph.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges[start]:
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False
    cycles = [m for m in modules if reaches(m, m, set())]
    assert not cycles


ALL_MODULES = sorted((ROOT / "zpath").rglob("*.py"))

# which packages a package may not import (ARCHITECTURE: the controller and the
# workers never import each other; net knows nothing of programs; neither the
# controller, the workers nor net import the client library or the cluster tooling)
FORBIDDEN = {
    "zpath.controller": ("zpath.worker", "zpath.client", "zpath.cluster"),
    "zpath.worker": ("zpath.controller", "zpath.client", "zpath.cluster"),
    "zpath.net": ("zpath.controller", "zpath.worker", "zpath.client", "zpath.cluster"),
    "zpath.client": ("zpath.controller", "zpath.worker"),
}


def _module_name(p: pathlib.Path) -> str:
    parts = p.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_packages_keep_their_boundaries():
    broken = []
    for p in ALL_MODULES:
        name = _module_name(p)
        for package, banned in FORBIDDEN.items():
            if name == package or name.startswith(package + "."):
                top, inner = _imports(p)
                for mod in top | {m for _, m in inner}:
                    if mod.startswith(banned):
                        broken.append((name, mod))
    assert not broken


def test_no_imports_inside_functions_outside_the_allowed_lazy_ones():
    """Imports sit at module top, except: the CLI's (see above), ml_dtypes in
    sharding.py (only dtypes numpy lacks need it) and the docstring examples."""
    allowed = {("zpath.sharding", "ml_dtypes")}
    found = []
    for p in ALL_MODULES:
        name = _module_name(p)
        if name == "zpath.cluster.cli":
            continue                      # test_client_and_cluster_import_at_module_top
        found += [(name, line, mod) for line, mod in _imports(p)[1] if (name, mod) not in allowed]
    assert not found


def test_zpath_modules_import_no_cycle():
    graph = {_module_name(p): {m for m in _imports(p)[0] if m != _module_name(p)} for p in ALL_MODULES}
    modules = set(graph)
    # "from zpath.net import messages" names zpath.net.messages: keep the names that are modules
    edges = {a: {b for b in deps if b in modules and not a.startswith(b + ".") and b != "zpath"}
             for a, deps in graph.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges[start]:
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False
    cycles = sorted(m for m in modules if reaches(m, m, set()))
    assert not cycles
