"""What a capture worker process remembers between batches of the sessions it builds, so that
a long session's next batch costs its new messages, not its whole history again (decision 45).

A session resends its history with every call. The conversation store keeps each message once,
but the step builder still re-derived, batch after batch, things that only grow: every
message's keyed digest, the chain digest of every prefix, the placeholder state (every delta
of the trajectory unpacked again), the content of every item of the history (read, unzipped,
parsed) and a lookup of every prefix among the stored steps. Profiled at 200 calls
(`tests/bench/step_cpu.py --profile`), that was about a third of the builder's time, and it
grows with the session.

Each memo here holds either a pure function's results or rows the database never changes, and
is used so that it cannot serve something stale:

- `digest`: the keyed digest of exact bytes, per tenant — a pure function (of the master key
  too, which does not change under a running worker: the shared detection cache derives its
  key from it once as well, governance/sanitizing.py).
- `chains`: chain digests (conversation.chain_digests) of a trajectory's last history; a new
  history that starts with it continues from its last link — a pure function of the digests.
- `content`: an item's sanitized content by primary key. An item row is never updated; a
  batch asks the database which items exist (ids only) and takes content here only for those
  ids, so a deleted item is never used.
- `take_state` / `keep_state`: a trajectory's placeholder state as committed, with its seq.
  A batch takes the entry out (it numbers new values into the state) and it is put back only
  when that batch's transaction commits, so a rolled-back batch's numbering is never kept.
  Deltas are append-only: those another process committed since are read on top.
- `parent_hint` / `keep_parent`: the history (length, digest) of the last step this process
  built of a trajectory. Parent lookups ask for that prefix and the longer ones only; when the
  database has none of them (the step was purged, or the history branched), the lookup asks
  for every prefix as before (conversation.known_histories).

Per process, bounded: trajectories least recently used first out; digests and content
emptied whole when over their bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cachetools import LRUCache

from governance.capture.conversation import chain_links
from governance.sanitizer.policy import PlaceholderState

# Bounds, per worker process (RecentBodies keeps 64 MB beside them): the trajectories whose
# last step is kept; the placeholder-state entries (labels and aliases, ~150 bytes each in
# memory: a PII-dense 200-call session numbers ~8,000) and history messages of chains (~200
# bytes each) kept, least recently used trajectories out first; the bytes of digests' inputs
# and of item content kept.
MAX_TRAJECTORIES = 512
MAX_STATE_ENTRIES = 300_000
MAX_CHAIN_MESSAGES = 200_000
MAX_DIGEST_BYTES = 16 * 1024 * 1024
MAX_CONTENT_BYTES = 32 * 1024 * 1024


class SessionMemo:
    def __init__(self, max_trajectories: int = MAX_TRAJECTORIES,
                 max_state_entries: int = MAX_STATE_ENTRIES,
                 max_chain_messages: int = MAX_CHAIN_MESSAGES,
                 max_digest_bytes: int = MAX_DIGEST_BYTES,
                 max_content_bytes: int = MAX_CONTENT_BYTES) -> None:
        # (tenant, bytes) -> digest, and item id -> content: plain dicts emptied whole when
        # full. A lookup here runs for every message of every call, and an LRU's bookkeeping
        # (cachetools' is Python) cost more than the dict itself; losing everything now and
        # then costs one batch its lookups.
        self._digests: dict[tuple[int, bytes], str] = {}
        self._digest_bytes, self._digest_held = max_digest_bytes, 0
        self._content: dict[int, bytes] = {}
        self._content_bytes, self._content_held = max_content_bytes, 0
        # Per trajectory: the last history's digests, its chain links (sha256 bytes) and their
        # hex prefixes.
        self._chains: LRUCache[Any, tuple[list[str], list[bytes], list[str]]] = LRUCache(
            max_chain_messages, getsizeof=lambda entry: len(entry[0]) + 1)
        self._states: LRUCache[Any, tuple[int, PlaceholderState]] = LRUCache(
            max_state_entries,
            getsizeof=lambda entry: len(entry[1].labels) + len(entry[1].aliases) + 1)
        self._parents: LRUCache[Any, tuple[str, int, str]] = LRUCache(max_trajectories)

    # --- digests ---------------------------------------------------------------------------

    def digest(self, tenant_id: int, keyed: Callable[[bytes], str]) -> Callable[[bytes], str]:
        """`keyed` (the tenant's content hasher) remembered by input bytes. An HMAC per
        message per call was most of history_of's time; a dict lookup is a fraction of it."""
        def digest(content: bytes) -> str:
            key = (tenant_id, content)
            out = self._digests.get(key)
            if out is None:
                out = keyed(content)
                self._digest_held += len(content) + 100
                if self._digest_held > self._digest_bytes:
                    self._digests.clear()
                    self._digest_held = len(content) + 100
                self._digests[key] = out
            return out

        return digest

    # --- chains ----------------------------------------------------------------------------

    def chains(self, trajectory: Any, digests: Sequence[str], hex_len: int) -> list[str]:
        """conversation.chain_digests(digests), continued from this trajectory's last history
        where `digests` starts with it."""
        last = self._chains.get(trajectory)
        start, prev = 0, b""
        out: list[str] = []
        links: list[bytes] = []
        if last is not None and last[2] and len(last[2][0]) == hex_len:
            old, old_links, old_hex = last
            n = min(len(old), len(digests))
            while start < n and old[start] == digests[start]:
                start += 1
            if start:
                links, out = old_links[:start], old_hex[:start]
                prev = links[-1]
        for link in chain_links(digests[start:], prev):
            links.append(link)
            out.append(link.hex()[:hex_len])
        entry = (list(digests), links, out)
        if self._chains.getsizeof(entry) <= self._chains.maxsize:
            self._chains[trajectory] = entry
        else:
            self._chains.pop(trajectory, None)
        return list(out)

    # --- item content ----------------------------------------------------------------------

    def content(self, item_id: int) -> bytes | None:
        return self._content.get(item_id)

    def keep_content(self, item_id: int, data: bytes) -> None:
        self._content_held += len(data) + 100
        if self._content_held > self._content_bytes:
            self._content.clear()
            self._content_held = len(data) + 100
        self._content[item_id] = data

    # --- placeholder states ----------------------------------------------------------------

    def take_state(self, trajectory: Any) -> tuple[int, PlaceholderState] | None:
        """The committed (seq, state), removed: the caller owns it until keep_state."""
        return self._states.pop(trajectory, None)

    def keep_state(self, trajectory: Any, seq: int, state: PlaceholderState) -> None:
        if self._states.getsizeof((seq, state)) <= self._states.maxsize:
            self._states[trajectory] = (seq, state)

    # --- parents ---------------------------------------------------------------------------

    def parent_hint(self, trajectory: Any, version: str) -> tuple[str, int] | None:
        """(history digest, history length) of the last step built here, under `version`."""
        hint = self._parents.get(trajectory)
        if hint is None or hint[2] != version:
            return None
        return hint[0], hint[1]

    def keep_parent(self, trajectory: Any, history_digest: str, length: int,
                    version: str) -> None:
        self._parents[trajectory] = (history_digest, length, version)

    def clear(self) -> None:
        for cache in (self._digests, self._chains, self._content, self._states,
                      self._parents):
            cache.clear()
        self._digest_held = self._content_held = 0


SESSION_MEMO = SessionMemo()
