"""Which requests the proxy forwards: the OpenAI inference endpoints, plus an operator's list.

An agent's key authenticates it to Steward, not to the upstream's own API: SGLang's
`/update_weights_from_disk`, a server's debug or admin paths and anything else the upstream
exposes stay unreachable through the appliance (the proxy adds the upstream credential to what
it forwards). Forwarded by default:

    POST /v1/chat/completions, /v1/completions, /v1/responses   (captured)
    GET  /v1/models, /v1/models/<id>                            (passed through uncaptured)

`STEWARD_PROXY_ALLOWED_PATHS` adds paths, comma-separated, any method, passed through
uncaptured: `/v1/embeddings` matches that path exactly; `/v1/files/*` matches everything under
`/v1/files/`. Everything else is answered 404 in OpenAI's error shape before the body is read.

Matching is on the request target's path as sent (no query string), byte for byte: an encoded
or dotted spelling of an allowed path (`/v1/chat%2Fcompletions`, `/v1/x/../chat/completions`)
is not the allowed path. Under a `/*` entry, a remainder with a `.` or `..` segment, a
backslash or a control character (also percent-encoded) is refused, so a path cannot climb out
of the allowed subtree where the upstream normalises it.
"""

from __future__ import annotations

from urllib.parse import unquote

CAPTURED = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
ENV = "STEWARD_PROXY_ALLOWED_PATHS"


class PathPolicy:
    """`check(method, path)` -> (allowed, endpoint): the captured endpoint name, or None for
    an allowed path passed through uncaptured."""

    def __init__(self, extra: str = "") -> None:
        self.exact: set[str] = set()
        self.prefixes: list[str] = []
        for entry in (e.strip() for e in extra.split(",")):
            if not entry:
                continue
            if not entry.startswith("/") or any(c in entry for c in "?#\\ "):
                raise ValueError(f"{ENV}: {entry!r} is not a path (it must start with '/')")
            if entry.endswith("/*"):
                self.prefixes.append(entry[:-1])
            elif "*" in entry:
                raise ValueError(f"{ENV}: {entry!r}: '*' only as a final '/*'")
            else:
                self.exact.add(entry)

    def check(self, method: str, path: str) -> tuple[bool, str | None]:
        if method == "POST":
            endpoint = CAPTURED.get(path)
            if endpoint is not None:
                return True, endpoint
        if method == "GET" and (path == "/v1/models" or (
                path.startswith("/v1/models/") and _safe_rest(path[len("/v1/models/"):]))):
            return True, None
        if path in self.exact:
            return True, None
        for prefix in self.prefixes:
            if path.startswith(prefix) and _safe_rest(path[len(prefix):]):
                return True, None
        return False, None


def _safe_rest(rest: str) -> bool:
    decoded = unquote(rest)
    if not decoded or "\\" in decoded or any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        return False
    return not any(segment in (".", "..") for segment in decoded.split("/"))
