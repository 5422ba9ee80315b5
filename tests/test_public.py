"""The public names: one list for run time and type checkers, and each one documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gputrace

ROOT = Path(__file__).resolve().parent.parent


def _type_checking_imports() -> dict[str, str]:
    """name -> module, from the `if TYPE_CHECKING:` block of gputrace/__init__.py."""
    tree = ast.parse((ROOT / "gputrace" / "__init__.py").read_text())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name}: re-export as itself"
                    names[alias.name] = imp.module
    return names


def test_type_checkers_and_the_lazy_import_see_the_same_names() -> None:
    assert _type_checking_imports() == gputrace._EXPORTS
    assert sorted(gputrace.__all__) == sorted([*gputrace._EXPORTS, "__version__"])
    for name in gputrace.__all__:
        assert getattr(gputrace, name) is not None


def test_every_public_name_is_in_the_api_reference() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    headings = set(re.findall(r"^#+ .*?`(?:gputrace\.)?([A-Za-z_]+)", doc, re.M))
    missing = sorted(set(gputrace.__all__) - headings - {"__version__"})
    assert not missing, f"docs/api.md has no section for {missing}"
    options = set(re.findall(r"^\| `([a-z_]+)` \|", doc, re.M))
    fields = set(gputrace.Config.__dataclass_fields__)
    assert fields <= options, f"docs/api.md does not describe the options {sorted(fields - options)}"
