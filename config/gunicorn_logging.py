"""The web access log without query strings (gunicorn `--logger-class`, config/cli.py).

A query string can carry what the appliance promises to keep only as keyed hashes or digests: a
data subject typed into a hand-made `/trajectories/?subject=...` (the console's own search form
POSTs, governance/views/trajectories.py), the free-text reason of a raw read
(`.../raw/?reason=...`), or a login redirect's `next=` holding either. The access log is a plain
file that is rotated, shipped and read by people who may not see those, so it records the path
only — for every request, the request line, the query atom and the Referer alike. What was
searched is not needed to operate the web server; the audit log records what matters.

gunicorn only: imported by the gunicorn master, before Django is set up, so no Django here.
"""

from __future__ import annotations

from typing import Any

from gunicorn.glogging import Logger


def without_query(url: str) -> str:
    """`url` up to its query string (and fragment)."""
    for mark in ("?", "#"):
        url = url.split(mark, 1)[0]
    return url


class QuerylessAccessLogger(Logger):
    """gunicorn's logger whose access-log atoms never hold a query string: `%(r)s` is
    `METHOD /path PROTOCOL`, `%(q)s` is empty, `%(f)s` (and `%({referer}i)s`) is the referring
    address without its query; environ atoms (`%({raw_uri}e)s`, ...) get the same treatment."""

    def atoms(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any
              ) -> dict[str, Any]:
        clean = dict(environ)
        clean["RAW_URI"] = without_query(environ.get("RAW_URI") or environ.get("PATH_INFO", ""))
        clean["QUERY_STRING"] = ""
        if "HTTP_REFERER" in clean:
            clean["HTTP_REFERER"] = without_query(clean["HTTP_REFERER"])
        for key in ("REQUEST_URI",):  # set by some front ends
            if key in clean:
                clean[key] = without_query(clean[key])
        headers = getattr(req, "headers", req)
        if hasattr(headers, "items"):
            headers = headers.items()
        clean_headers = [(name, without_query(value) if name.lower() == "referer" else value)
                         for name, value in headers or []]
        return super().atoms(resp, clean_headers, clean, request_time)
