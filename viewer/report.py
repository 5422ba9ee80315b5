"""The exported report: the viewer's page as one self-contained HTML file.

Takes: a viewer document (`data.document`). Gives: HTML bytes holding the page's style, its
modules joined into one script, and the document itself, under a content security policy that
allows exactly that script and that style: the file makes no network request, so it can travel as
a CI artefact or an attachment. It has every view but the timeline, which needs the Perfetto UI.

The modules are joined by a deliberately small bundler: it understands only the two import forms
the viewer uses (`import { a, b } from "./m.js"` and `import * as m from "./m.js"`) and `export`
before a declaration, and refuses anything else, so a module written otherwise fails the tests
rather than the report.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

import orjson

from .server import static_assets

#: The modules in dependency order (each imports only modules before it).
MODULES = ("util", "state", "heatmap", "breakdown", "stats", "collectives", "compare", "timeline", "open", "app")
_IMPORT = re.compile(r'^import (?:(\{[^}]*\})|\* as (\w+)) from "\./(\w+)\.js";[ \t]*$', re.M)
_EXPORT = re.compile(r"^export (function|const|let|class) (\w+)", re.M)


def bundle(assets: dict[str, tuple[bytes, str]]) -> str:
    """The modules as one classic script: each becomes a function returning its exports."""
    parts = ["const gputraceModules = {};"]
    done: set[str] = set()
    for name in MODULES:
        src = assets[f"{name}.js"][0].decode()

        def replace(m: re.Match[str], name: str = name) -> str:
            dep = m.group(3)
            if dep not in done:
                raise ValueError(f"{name}.js imports {dep}.js, which is not bundled before it")
            return f"const {m.group(1) or m.group(2)} = gputraceModules.{dep};"

        body = _IMPORT.sub(replace, src)
        exports = [m.group(2) for m in _EXPORT.finditer(body)]
        body = _EXPORT.sub(lambda m: f"{m.group(1)} {m.group(2)}", body)
        if re.search(r"^\s*(import|export)\b", body, re.M):
            raise ValueError(f"{name}.js has an import or export form the report's bundler does not know")
        parts.append(f"gputraceModules.{name} = (() => {{\n{body}\nreturn {{ {', '.join(exports)} }};\n}})();")
        done.add(name)
    script = "\n".join(parts)
    if "</script" in script.lower() or "<!--" in script:
        raise ValueError("a viewer module contains '</script' or '<!--', which would end the inline script")
    return script


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def html(doc: dict[str, Any]) -> bytes:
    """The report for `doc` (its timeline part is dropped: the report embeds no Perfetto UI)."""
    assets = static_assets()
    doc = {**doc, "timeline": {**doc.get("timeline", {}), "ui": None}}
    style = assets["style.css"][0].decode()
    script = bundle(assets)
    # `<` never appears raw in the JSON, so no name in the trace can close the data block.
    payload = orjson.dumps(doc).replace(b"<", b"\\u003c").decode()
    csp = (
        f"default-src 'none'; script-src '{_sha256(script)}'; style-src '{_sha256(style)}'; img-src data:; "
        "base-uri 'none'; form-action 'none'"
    )
    page = assets["index.html"][0].decode()
    head, rest = page.split("<!--style-->", 1)
    _, rest = rest.split("<!--/style-->", 1)
    page = head + f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n<style>{style}</style>' + rest
    before, rest = page.split("<!--script-->", 1)
    _, after = rest.split("<!--/script-->", 1)
    page = (
        before
        + f'<script type="application/json" id="gputrace-data">{payload}</script>\n<script>{script}</script>'
        + after
    )
    return page.encode()
