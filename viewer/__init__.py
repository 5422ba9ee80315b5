"""gputrace's viewer: the cross-rank views Perfetto lacks, linked to the Perfetto timeline.

Takes: traces. Gives: `data.document()` (the views' numbers, computed by `gputrace.stats`),
`server.Viewer` (a local server for the page in `static/` and the embedded Perfetto UI) and
`report.html()` (one self-contained HTML file of the same views).
"""
