"""The pure/shell line, enforced by folder (issue 17): only `mitm/` (the addon's hooks, the attempt
engine, the HTTP driver) and `ws/` (the gated WebSocket) may import mitmproxy. Every other module
of the package, `core/` first, must import with mitmproxy unimportable; and `core/` does no I/O of
its own (no sockets, no asyncio servers, no files but the rules and pool files it is handed). Read
by AST: core/ imports only the standard library and core/ itself, and no module of the package is in
an import cycle (annotation-only imports counted)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "addon" / "codex_failover"
SHELL = {"mitm", "ws"}  # the folders that may import mitmproxy


def modules_outside_the_shell() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in SHELL or path.stem == "__init__":
            continue
        found.append(".".join(rel.with_suffix("").parts))
    return found


def test_only_mitm_and_ws_import_mitmproxy():
    modules = modules_outside_the_shell()
    code = ("import sys\n"
            "sys.modules['mitmproxy'] = None  # any `import mitmproxy...` now fails\n"
            f"sys.path.insert(0, {str(PACKAGE.parent)!r})\n"
            "import importlib\n"
            "failed = []\n"
            f"for name in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module('codex_failover.' + name)\n"
            "    except ImportError as exc:\n"
            "        failed.append(f'{name}: {exc}')\n"
            "print('\\n'.join(failed))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", "modules outside mitm/ and ws/ that need mitmproxy:\n" + done.stdout
    assert len([m for m in modules if m.startswith("core.")]) >= 20, modules


def test_core_imports_nothing_from_the_shell_or_the_network():
    """core/ is the decisions: it may use the standard library's pure parts and its own modules."""
    shell = ("from ..mitm", "from ..ws", "from ..net", "import mitmproxy", "from mitmproxy ", "import socket",
             "asyncio.start_server", "open_connection")
    offenders = []
    for path in sorted((PACKAGE / "core").glob("*.py")):
        code = [line for line in path.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))
                or "asyncio." in line or "open_connection" in line]
        offenders += [f"{path.name}: {needle}" for needle in shell for line in code if needle in line]
    assert offenders == [], offenders


def test_module_and_class_sizes_stay_readable():
    """A module over 400 lines or a class over 250 is worth a look: a warning, not a failure. A part is
    split where a responsibility ends, never to meet a line count."""
    import ast
    import warnings

    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            too_big.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                too_big.append(f"{path.relative_to(PACKAGE)}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    if too_big:
        warnings.warn("larger than the size caps (a warning; split by responsibility): " + "; ".join(too_big),
                      stacklevel=1)


SEAM = {"mitm/warm_conn.py", "mitm/held_layer.py"}  # the connections the addon makes itself; a proxy client's connection in its layers (the held stream's among them)


def test_only_the_seam_touches_mitmproxys_proxy_core():
    """mitmproxy's proxy core (`mitmproxy.proxy.*`, `mitmproxy.connection`) changes between releases;
    only the seam's modules may import it, everything else uses the public addon API and the
    seam's functions (docs/architecture.md#the-seam)."""
    import ast

    touching = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith(("mitmproxy.proxy", "mitmproxy.connection")) for n in names):
                touching.add(str(path.relative_to(PACKAGE)))
    assert touching == SEAM, sorted(touching)


# What belongs to mitmproxy's proxy core however it is reached (no import needed: an object handed over
# carries it): a connection handler's watchdog, hook dispatch, transports and layers; a layer's command
# bookkeeping; wsproto's state inside mitmproxy's WebSocket layer.
PROXY_CORE_INTERNALS = {"timeout_watchdog", "handle_hook", "_proto", "command_sources", "waiting_for_establishment",
                        "transports", "layers", "layer", "LegacyLogEvents",
                        "connections"}  # the proxy server's handlers by client (and an HttpLayer's connections)
NOT_PROXY_CORE = {
    # mitmproxy.log's handler that turns log records into the deprecated `add_log` addon event: made by
    # mitmproxy's Master (master.py), not by the proxy core, which never sees it; quiet_log.py only asks
    # whether a root-logger handler is one, to skip it while no addon listens
    # (tests/test_quiet_log.py::test_the_add_log_event_is_made_only_while_an_addon_listens).
    ("mitm/quiet_log.py", "LegacyLogEvents"),
}


def _internals_used(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each proxy-core internal a module names: as an attribute (`handler.transports`),
    a name or import (`LegacyLogEvents`), or a string for getattr and its kin (`getattr(ws, "_proto")`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PROXY_CORE_INTERNALS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in PROXY_CORE_INTERNALS:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, a.name) for a in node.names if a.name in PROXY_CORE_INTERNALS]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in PROXY_CORE_INTERNALS:
            found.append((node.lineno, str(node.args[1].value)))
    return found


def test_only_the_seam_reaches_into_mitmproxys_proxy_core_objects():
    """Not importing mitmproxy.proxy is not enough: an object the core hands over (a connection
    handler, a layer, a WebSocket connection) carries its internals with it. Outside the seam, no
    module reads them; what it needs is a public function of a seam module, pinned by a contract
    test (e.g. `WarmConnection.extensions` for the WebSocket layer's deflate state, tests/test_ws_layer_socket.py)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where in SEAM:
            continue
        found += [f"{where}:{line}: {name}" for line, name in _internals_used(ast.parse(path.read_text()))
                  if (where, name) not in NOT_PROXY_CORE]
    assert found == [], found


def test_the_internals_check_sees_each_way_in():
    code = ("from mitmproxy.log import LegacyLogEvents\n"
            "def f(handler, ws):\n    handler.timeout_watchdog.disarm(), getattr(ws, '_proto'), handler.layers\n")
    assert sorted(name for _, name in _internals_used(ast.parse(code))) == \
        ["LegacyLogEvents", "_proto", "layers", "timeout_watchdog"]


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of a module, in functions and under `if TYPE_CHECKING:` too: an import for
    annotations is knowledge of the other module all the same (the lower module calling back into
    the higher one's object), and a cycle it closes is a cycle in the design."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names an import statement may load: `from .x import y` in codex_failover.core
    gives codex_failover.core.x and codex_failover.core.x.y (y may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = _module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def test_core_imports_only_the_standard_library_and_core():
    """The decisions take their policy as data (core/policy.py, core/rules.py's parsed rules): no
    config loader, no YAML, no third-party library, nothing of the package outside core/."""
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    offenders = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for node in _imports(ast.parse(path.read_text())):
            for name in _imported(path, node)[:1] if isinstance(node, ast.ImportFrom) else _imported(path, node):
                inside = name == "codex_failover.core" or name.startswith("codex_failover.core.")
                if not inside and name.split(".")[0] not in allowed:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    assert offenders == [], offenders


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of its code, bar TYPE_CHECKING)."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps = set()
        for node in _imports(ast.parse(path.read_text())):
            for name in _imported(path, node):
                while name and name not in files:  # `from .x import y`: y a name in x, not a module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    deps.add(name)
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_the_packages_modules():
    """A cycle hides which module depends on which: a lazy import inside a function only hides it,
    and so does one under `if TYPE_CHECKING:` (both counted). The lower module knows what it needs of
    the higher one as a `typing.Protocol` of its own (mitm/carried.py, attempt.Connections,
    token_refresher.Owner), or is handed the values (attempt_maker.AttemptMaker), or the shared
    record moves down (story.AttemptLog); the held client stream's layers know it as `held_layer.Held`."""
    assert _cycles(_import_graph()) == [], "import cycles"


def test_the_import_graph_counts_what_only_annotations_import():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                     "def f():\n    from .c import C\n")
    assert [node.module for node in _imports(tree) if isinstance(node, ast.ImportFrom)] == ["typing", "b", "c"]


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _vocabulary_words() -> set[str]:
    from codex_failover.core import vocabulary

    words = {value for name, value in vars(vocabulary).items() if name.isupper() and isinstance(value, str)}
    return words | {verdict.value for verdict in vocabulary.Verdict}


def test_each_reason_and_verdict_is_defined_once_and_named_not_spelt():
    """One vocabulary (core/vocabulary.py): no other module defines a reason or verdict constant,
    lists them as literals, or compares a value against one spelt out."""
    words, found = _vocabulary_words(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "vocabulary.py":
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE)
        spelt = lambda node: isinstance(node, ast.Constant) and node.value in words  # noqa: E731
        for node in tree.body:  # module level: a constant, or a family of them (a set)
            if not isinstance(node, ast.Assign):
                continue
            value = node.value.args[0] if isinstance(node.value, ast.Call) and node.value.args else node.value
            members = value.elts if isinstance(value, ast.Set) else [value]
            if any(spelt(n) for n in members):
                found.append(f"{where}:{node.lineno}: defines {ast.unparse(node)[:60]}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(spelt(n) for c in node.comparators for n in ast.walk(c)):
                found.append(f"{where}:{node.lineno}: compares with {ast.unparse(node)[:60]}")
            if isinstance(node, ast.ClassDef) and node.name == "Verdict":
                found.append(f"{where}:{node.lineno}: a second Verdict")
    assert found == [], found


def test_a_name_means_one_thing():
    """The types the parts exchange are defined once: one Decision (the classifier's), one Message
    (a WebSocket message), one Rejection, one Verdict."""
    defined: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [node.name] if isinstance(node, ast.ClassDef) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            for name in names:
                defined.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    for name in ("Decision", "Message", "Rejection", "Verdict", "Step", "Scope", "Shared"):
        assert len(defined.get(name, [])) == 1, (name, defined.get(name))


# Private names of other projects that have no public way to do the same, each pinned by a test:
PRIVATE_REACHES = {
    # wsproto's Connection keeps its extensions (the deflate state) only as `_proto.extensions`: the seam
    # bounds the inflate of the WebSocket layers mitmproxy runs (tests/test_ws_layer_socket.py; a passed-through
    # socket's, held_layer.py's `bound_websocket`, tests/test_e2e_closed_doors.py); both are seam modules
    # (docs/architecture.md#the-seam).
    ("mitm/warm_conn.py", "_proto"),
    # ...and the held stream's inside WebSocket layer speaks uncompressed after its 101 (held_layer.py's
    # `StreamWire.ws_started`, tests/test_e2e_ws_client_hop.py); a mode layer hands its events on through a
    # bound `_handle_event`, the only way down to a flow's stream (`_children`); h2 keeps the streams it
    # closed only in `_closed_streams`, how a reset stream is told from one never opened (`stream_reset`,
    # tests/test_e2e_closed_doors.py). All in the seam.
    ("mitm/held_layer.py", "_proto"), ("mitm/held_layer.py", "_handle_event"), ("mitm/held_layer.py", "_closed_streams"),
    # pyOpenSSL refuses to change a context once used, and has no call to add a trust store then: OpenSSL's
    # own function on the context, as mitmproxy's tlsconfig calls it (docs/mitmproxy-12.3.1-replay-notes.md
    # §8; tests/test_e2e_machine_proxy.py::test_upstream_tls_trusts_the_system_store).
    ("net/trust.py", "_lib"), ("net/trust.py", "_ffi"), ("net/trust.py", "_context"),
}
_ATTR_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_used_across_modules(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, name, how) for each private name the module takes from another: `from x import _y`,
    `x._y` (a module or any object but its own: `self`, `cls`, `super()`, its own classes and the
    objects it makes of them), and `getattr(x, "_y")` and its kin."""
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)} | {"self", "cls"}
    for node in ast.walk(tree):  # `conn = cls(...)`, `keeper = StateKeeper(...)`: objects of its own classes
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id in own:
            own |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def foreign(obj: ast.expr) -> bool:
        if isinstance(obj, ast.Name):
            return obj.id not in own
        return not (isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, a.name, f"from {node.module} import") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and foreign(node.value):
            found.append((node.lineno, node.attr, ast.unparse(node.value)[:40]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) and foreign(node.args[0]):
            found.append((node.lineno, node.args[1].value, f"{node.func.id}({ast.unparse(node.args[0])[:40]})"))
    return found


def test_no_private_name_is_used_across_modules():
    """A name with a leading underscore is its module's own: another module neither imports it nor
    reads or calls it on the module's objects. What is shared gets a public name (a part that needs
    another's insides is one part, or has a seam)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        found += [f"{where}:{line}: {how} {name}" for line, name, how in _private_names_used_across_modules(ast.parse(path.read_text()))
                  if (where, name) not in PRIVATE_REACHES]
    assert found == [], found


def test_hooks_go_through_mitmproxys_own_dispatch():
    """No copy of mitmproxy's AddonManager dispatch and no patched connection handler: nothing sets a
    handler's `handle_hook`, reads its `timeout_watchdog` or cuts a traceback as the dispatch does."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "handle_hook" for t in targets):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: sets handle_hook")
            name = getattr(node, "attr", getattr(node, "id", getattr(node, "name", None)))
            if isinstance(node, (ast.Attribute, ast.Name, ast.alias)) and name in ("timeout_watchdog", "cut_traceback"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    assert found == [], found


def test_the_private_name_check_sees_each_way_in():
    code = ("from .a import _x, y\nimport b\nclass Own:\n    def f(self, other):\n"
            "        self._mine, Own._too, super()._base()\n        b._helper(), other._inside, getattr(other, '_z')\n"
            "        made = Own()\n        made._fine\n    @classmethod\n    def g(cls):\n        cls._ok\n")
    assert {(name, how) for _, name, how in _private_names_used_across_modules(ast.parse(code))} == \
        {("_x", "from a import"), ("_helper", "b"), ("_inside", "other"), ("_z", "getattr(other)")}


def test_mypy_checks_the_shell_and_the_core_strictly():
    """mypy (scripts/test) reads every function body of the shell and holds core/ to strict's flags;
    no module is left out."""
    import tomllib

    config = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["check_untyped_defs"] is True and config["files"] == ["addon/codex_failover"]
    overrides = config.get("overrides", [])
    ignored = {m for o in overrides if o.get("ignore_errors") for m in o["module"]}
    assert ignored == set(), ignored
    core = next(o for o in overrides if o["module"] == ["codex_failover.core.*"])
    assert all(core.get(flag) is True for flag in ("disallow_untyped_defs", "disallow_any_generics", "warn_return_any",
                                                   "disallow_untyped_calls", "strict_equality", "no_implicit_reexport"))
