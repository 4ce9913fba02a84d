"""The shape of the package: who may import whom (docs/architecture.md draws it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "django_outbox"
APP = "django_outbox"

pytestmark = pytest.mark.once

# docs/architecture.md, "Who may import whom", row by row. A name is a module ("stats"), or
# with ".*" a package and every module in it ("relay.*"); the package's own __init__.py is
# "__init__". A module may always import the modules of its own package.

#: Import nothing of the app but each other.
FOUNDATION = {
    "__init__",
    "states",
    "conf",
    "exceptions",
    "masking",
    "message",
    "formats",
    "db",
    "notify",
    "worker",
    "retry",
    "_compat.*",
    "tracing",
    "transports",
}
#: The models and the row's lifecycle: the foundation and each other only.
DATA = {"ordering", "querysets", "schedule", "models", "gauges", "partitions", "counting"}
#: Each row: its modules, and what of the app they may import (None: anything).
RULES: dict[str, tuple[set[str], set[str] | None]] = {
    "the foundation": (FOUNDATION, FOUNDATION),
    "the data layer": (DATA, FOUNDATION | DATA),
    # models only for types (under TYPE_CHECKING, which the graph leaves out).
    "the backends": ({"backends.*"}, FOUNDATION | {"checks"}),
    "the relay": (
        {"relay.*"},
        FOUNDATION | DATA | {"backends", "backends.base", "metrics", "alerts"},
    ),
    "the services": (
        {"consumer.*", "outbox", "purge", "requeue", "stats", "metrics", "alerts"},
        FOUNDATION | DATA,
    ),
    "the top": (
        {
            "admin",
            "dashboard",
            "templatetags.*",
            "checks",
            "tasks",
            "tasks_backend",
            "tasks_worker",
            "tasks_admin",
            "celery",
            "testing",
            "apps",
            "management.*",
        },
        None,
    ),
}
#: Where each broker or task library may be imported.
LIBRARIES = {
    # The Celery backend publishes through the pika backend's machinery (pipelined confirms).
    "pika": {"backends.pika", "backends.celery", "_compat.pika", "consumer.amqp"},
    "celery": {"backends.celery", "_compat.celery", "celery", "tasks"},
    # What the Celery backend asks of kombu rests on Celery's internals (_compat/celery.py).
    "kombu": {"_compat.celery"},
    # The nats extra: the relay backend and the consumer transport only.
    "nats": {"backends.nats", "consumer.nats"},
    # The redis extra: the relay backend, the consumer transport and what they share.
    "redis": {"backends.redis", "consumer.redis", "_compat.redis"},
    # The otel extra: emit(), the relay and the consumers call tracing, which alone imports it.
    "opentelemetry": {"tracing"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_files() -> dict[str, Path]:
    return {
        _module_name(path): path
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.relative_to(PACKAGE).parts
    }


def _import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, inside functions too; ``if TYPE_CHECKING:`` blocks left out."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped
    ]


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph() -> dict[str, set[str]]:
    """Each module of django_outbox -> the modules of django_outbox it imports."""
    files = _package_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in _import_nodes(path):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in files)
                continue
            target = _absolute(name, path, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in files:  # from . import ordering
                    deps.add(f"{target}.{alias.name}")
                elif target in files:  # from .models import OutboxEvent
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def external_imports() -> dict[str, set[str]]:
    """Each module of django_outbox -> the top-level names of other packages it imports."""
    found: dict[str, set[str]] = {}
    for name, path in _package_files().items():
        tops = set()
        for node in _import_nodes(path):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif not node.level and node.module:
                tops.add(node.module.split(".")[0])
        found[name] = tops - {APP}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _short(module: str) -> str:
    return "__init__" if module == APP else module.removeprefix(f"{APP}.")


def _matches(module: str, names: set[str]) -> bool:
    """Whether the short name ``module`` is one of ``names`` (see RULES)."""
    return any(
        module == name or (name.endswith(".*") and (module + ".").startswith(name[:-1]))
        for name in names
    )


def _package(module: str) -> str:
    return module.split(".")[0]


def violations(graph: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    """(row, module, what it imports) for each import that RULES does not allow."""
    wrong = set()
    for module, deps in graph.items():
        name = _short(module)
        for row, (members, allowed) in RULES.items():
            if not _matches(name, members) or allowed is None:
                continue
            for dep in map(_short, deps):
                own = _package(dep) == _package(name)
                if not own and not _matches(dep, allowed):
                    wrong.add((row, name, dep))
    return wrong


def test_no_import_cycle_inside_the_package():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_graph_counts_imports_inside_functions():
    # apps.py imports checks inside AppConfig.ready(), not at the top.
    assert "django_outbox.checks" in import_graph()["django_outbox.apps"]


def test_every_module_is_in_one_row_of_the_table():
    rows = {
        _short(module): [
            row for row, (members, _) in RULES.items() if _matches(_short(module), members)
        ]
        for module in import_graph()
    }
    assert {module: found for module, found in rows.items() if len(found) != 1} == {}


def test_every_module_imports_only_what_its_row_allows():
    assert violations(import_graph()) == set()


@pytest.mark.parametrize(
    ("module", "dep", "row"),
    [
        ("outbox", "relay.wake", "the services"),
        ("metrics", "stats", "the services"),
        ("db", "models", "the foundation"),
        ("querysets", "admin", "the data layer"),
        ("backends.pika", "relay.engine", "the backends"),
        ("relay.engine", "backends.pika", "the relay"),
        ("consumer.amqp", "backends.pika", "the services"),
    ],
)
def test_the_rules_catch_a_forbidden_import(module, dep, row):
    graph = {f"{APP}.{module}": {f"{APP}.{dep}"}}
    assert violations(graph) == {(row, module, dep)}


def test_a_package_imports_its_own_modules_and_the_top_anything():
    assert violations({f"{APP}.consumer.amqp": {f"{APP}.consumer.dispatch"}}) == set()
    assert violations({f"{APP}.relay.engine": {f"{APP}.relay.batch"}}) == set()
    assert violations({f"{APP}.admin": {f"{APP}.relay.engine", f"{APP}.stats"}}) == set()


def test_the_message_codec_builds_on_nothing_of_the_formats():
    # formats.py (CloudEvents) builds on message.py, never the reverse.
    assert "django_outbox.formats" not in import_graph()["django_outbox.message"]


def test_querysets_never_import_the_models_at_run_time():
    # models.py builds its managers from querysets.py.
    assert "django_outbox.models" not in import_graph()["django_outbox.querysets"]


def test_the_status_is_defined_once_and_imports_nothing_of_the_app():
    assert import_graph()["django_outbox.states"] == set()


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_broker_and_task_libraries_are_imported_only_where_they_are_used(library):
    users = {_short(m) for m, tops in external_imports().items() if library in tops}
    assert {user for user in users if not _matches(user, LIBRARIES[library])} == set()


#: A module past this many lines holds more than one job: split it by job (issue 27).
MAX_MODULE_LINES = 800


def test_no_module_is_over_800_lines():
    long = {
        name: lines
        for name, path in _package_files().items()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, "split these by job (docs/architecture.md): " + ", ".join(long)
