"""Import-direction rules of the app (STYLE.md §2), checked on the source with ``ast``.

Module-level imports must follow the layering; an import inside a function is the documented
escape hatch for a lazy dependency and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1] / "workqueue"


def _modules() -> list[Path]:
    return sorted(p for p in APP.rglob("*.py") if "migrations" not in p.parts)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(APP.parent).with_suffix("").parts).removesuffix(".__init__")


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {name for name in found if name.startswith("workqueue")}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


FLOOR = {"types", "exceptions", "conf", "ids"}
FORBIDDEN = {
    # a layer: the layers it must not import at module level
    "driver": {"runtime", "operators", "publishing", "models", "api", "admin", "management"},
    "models": {"driver", "runtime", "operators", "publishing", "api", "admin", "management"},
    "publishing": {"runtime", "operators", "api", "admin", "management"},
    "transport": {"runtime", "operators", "api", "admin", "management"},
    "transports": {"runtime", "operators", "publishing", "api", "admin", "management"},
}


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_module_imports_respect_the_layering(path):
    module = _name(path)
    layer = _layer(module)
    imported_layers = {_layer(name) for name in _top_level_imports(path)}
    if layer in FLOOR:
        assert imported_layers <= FLOOR, f"{module} must import only types/exceptions/conf/ids"
    assert not imported_layers & FORBIDDEN.get(layer, set()), (
        f"{module} imports {sorted(imported_layers & FORBIDDEN[layer])} against the layering"
    )


def test_only_the_driver_package_reads_the_connection_vendor():
    offenders = []
    for path in _modules():
        if _name(path) == "workqueue.driver":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "vendor":
                offenders.append(f"{_name(path)}:{node.lineno}")
            if (
                isinstance(node, ast.Constant)
                and node.value in {"postgresql", "microsoft", "mssql"}
                and _layer(_name(path)) != "driver"
            ):
                offenders.append(f"{_name(path)}:{node.lineno} ({node.value!r})")
    assert offenders == []


def test_the_layering_check_detects_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from workqueue.runtime import host\n")
    assert _top_level_imports(bad) == {"workqueue.runtime"}
    assert _layer("workqueue.runtime") in FORBIDDEN["driver"]
