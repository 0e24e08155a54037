"""Raw payload encryption at rest: which data key a payload uses, how it is sealed and opened.

One AES-256-GCM data key per (tenant, subject hash) — per tenant when the call named no subject
(`subject_hash` ""). The data key is stored only wrapped by the master key, with the tenant and
subject hash as associated data, so a wrapped key copied to another row does not open. A raw
payload is sealed under its data key with the flow id as associated data, so a ciphertext copied
to another interaction does not open either. Destroying the DataKey row's key (erasure) makes
every payload it sealed unreadable, wherever copies of it live (crypto-shredding).

The plaintext is the exchange exactly as the proxy spooled it: request and response headers and
the exact body bytes. Format 3 (`pack_raw`) is zlib over a JSON header and the bodies as raw bytes
(compressed before it is sealed: AES-GCM output does not compress, and agent traffic is JSON that
shrinks 3-6x). Format 5 is format 3 of a request delta compressed against its base call: the
base's bodies and its headers (`delta_dictionary`). Format 4 (the same without the headers)
and formats 1 and 2 (JSON with the bodies as base64) are still opened.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib
from typing import Any

import orjson
from cachetools import LRUCache
from django.db import connection

from governance.keyring import unwrap_data_key, wrap_data_key
from governance.models import DataKey, Interaction
from wire.crypto import new_data_key, open_sealed, seal
from wire.spool import json_form

# `routing`: the canary route/arm and context updates the proxy applied (proxy/routing.py);
# the step builder copies it into the step's `versions`.
RAW_FIELDS = ("method", "path", "request_headers", "request_body", "request_is_json",
              "response_status", "response_headers", "response_body", "is_stream", "error",
              "routing", "response_truncated")


INSERT_CHUNK = 1000


class RawPayloadUnavailable(RuntimeError):
    """The payload cannot be opened: no ciphertext (expired/purged) or the key is destroyed."""


def data_key_aad(tenant_id: int, subject_hash: str) -> bytes:
    return f"steward-datakey-v1:{tenant_id}:{subject_hash}".encode()


def raw_aad(flow_id: str) -> bytes:
    return f"steward-raw-v1:{flow_id}".encode()


def raw_plaintext(record: dict[str, Any], delta: dict[str, Any] | None = None,
                  zdict: bytes | None = None) -> bytes:
    """The exchange part of a spool record (no routing metadata), packed (`pack_raw`, format
    3). With a `delta` (request_delta), the request body is stored as that delta against the
    body of the interaction `delta["base"]` names — and with `zdict` (`delta_dictionary` of
    that base), compressed against it (format 4)."""
    if delta is None:
        return pack_raw({"v": 1, **{k: record.get(k) for k in RAW_FIELDS}})
    fields = {k: record.get(k) for k in RAW_FIELDS if k != "request_body"}
    return pack_raw({"v": 2, **fields, "request_delta": delta}, zdict)


# Format 3 starts with a byte no JSON document starts with (formats 1 and 2 are JSON objects).
RAW3_MAGIC = b"\x00stw-raw3"
# Format 4: MAGIC, the base's flow id (u8 length, ASCII) in the clear of the plaintext (the
# dictionary must be known before the rest inflates; the whole is sealed all the same), then
# format 3's zlib stream made with `delta_dictionary(base)` as its preset dictionary. Opened,
# no longer written (decision 41).
RAW4_MAGIC = b"\x00stw-raw4"
# Format 5: format 4's layout, the dictionary also holding the base's `exchange_head`.
RAW5_MAGIC = b"\x00stw-raw5"
DELTA_MAGICS = (RAW4_MAGIC, RAW5_MAGIC)
# What of a raw document `exchange_head` keeps: the parts a session's next call repeats almost
# byte for byte (the client's headers, the upstream's), and nothing a format changes.
EXCHANGE_FIELDS = ("method", "path", "request_headers", "response_status", "response_headers")
# zlib's window: a preset dictionary is only ever used up to its last 32 KB.
DICTIONARY_WINDOW = 32 * 1024
RAW3_LEVEL = 6  # zlib: level 9 saves ~2 % more for 2-3x the time
BODY_FIELDS = ("request_body", "response_body")


def _blob(value: Any) -> bytes | None:
    """A body as bytes: bytes as they are, base64 text (format-1 spool lines, `json_form`)
    decoded; None for anything else (kept in the header as it came)."""
    if not isinstance(value, str | bytes | bytearray | memoryview):
        return None
    try:
        return decode_body(value)
    except ValueError:
        return None


def delta_dictionary(base_request: bytes, base_response: bytes | None,
                     base_head: bytes | None = None) -> bytes:
    """What a request delta is compressed against: the end of its base call's request body,
    then that call's response body, then (format 5) the base's `exchange_head`. The delta is
    the messages the agent appended since: the base's reply again (the assistant message,
    re-serialized by the client) and tool output shaped like the base's last tool output (the
    same field names, the same punctuation), which zlib alone finds only within the few KB of
    one call. Measured on the long-session bench's raw payloads: 2.26 KB a call as format 3,
    1.55 KB as format 4 (decision 39). The headers come last, nearest to the packed document
    that starts with its own: a call's client and upstream headers differ from its base's in
    a length, a date and ids, and were the larger part of a format-4 delta when calls add
    little (decision 41: 876 to 339 bytes a call at 200 calls of 0.6 KB)."""
    tail = base_request[-DICTIONARY_WINDOW:] + (base_response or b"") + (base_head or b"")
    return tail[-DICTIONARY_WINDOW:]


def response_bytes(doc: dict[str, Any]) -> bytes:
    """The response body of a spool record or an opened raw document as `delta_dictionary`
    takes it: the same bytes from either (a value that is not a body counts as none)."""
    return _blob(doc.get("response_body")) or b""


def exchange_head(doc: dict[str, Any]) -> bytes:
    """The headers part of a spool record or of an opened raw document, as bytes that are the
    same from either and whatever format the document was sealed in (format 5's dictionary
    is rebuilt from the opened base, which may have been sealed again since in another)."""
    return orjson.dumps(json_form({k: doc.get(k) for k in EXCHANGE_FIELDS}))


def packed_base(plaintext: bytes) -> str | None:
    """The flow id of the base a format-4 or 5 plaintext was compressed against; None for any
    other format (which opens without a dictionary)."""
    if not plaintext.startswith(DELTA_MAGICS):
        return None
    n = plaintext[len(RAW4_MAGIC)]  # RAW5_MAGIC is as long
    return plaintext[len(RAW4_MAGIC) + 1:len(RAW4_MAGIC) + 1 + n].decode("ascii")


def needs_head(plaintext: bytes) -> bool:
    """Whether this plaintext's dictionary holds its base's `exchange_head` (format 5)."""
    return plaintext.startswith(RAW5_MAGIC)


def pack_raw(doc: dict[str, Any], zdict: bytes | None = None) -> bytes:
    """A raw document of format 1 or 2 shape (bodies and a delta's `middle` as bytes or base64
    text) as format 3: MAGIC, then zlib of (u32 header length, header JSON, blobs). The header
    is the document with each body replaced by its blob's length (`{"blob": n}`). With `zdict`
    (`delta_dictionary` of the base, with its head) and a request delta, format 5 (RAW5_MAGIC):
    the same compressed against `zdict`."""
    header = dict(doc)
    blobs: list[bytes] = []

    def take(value: Any) -> Any:
        blob = _blob(value)
        if blob is None:
            return value
        blobs.append(blob)
        return {"blob": len(blob)}

    for name in BODY_FIELDS:
        if name in header:
            header[name] = take(header[name])
    if isinstance(header.get("request_delta"), dict):
        header["request_delta"] = {**header["request_delta"]}
        header["request_delta"]["middle"] = take(header["request_delta"].get("middle"))
    head = orjson.dumps(json_form(header))  # any other bytes value: base64, as format 1
    payload = struct.pack(">I", len(head)) + head + b"".join(blobs)
    base = str((doc.get("request_delta") or {}).get("base") or "").encode("ascii")
    if zdict is None or not base or len(base) > 255:
        return RAW3_MAGIC + zlib.compress(payload, RAW3_LEVEL)
    packer = zlib.compressobj(RAW3_LEVEL, zdict=zdict)
    return (RAW5_MAGIC + bytes([len(base)]) + base + packer.compress(payload)
            + packer.flush())


def unpack_raw(plaintext: bytes, zdict: bytes | None = None) -> dict[str, Any]:
    """The raw document in format 1/2 shape (bodies and a delta's middle as base64 text),
    whatever format it was sealed in. Formats 4 and 5 need the `delta_dictionary` of the base
    that `packed_base` names (format 5's with the base's head: `needs_head`)."""
    base = packed_base(plaintext)
    if base is not None:
        if zdict is None:
            raise ValueError("a delta raw payload opens only with its base's dictionary")
        inflater = zlib.decompressobj(zdict=zdict)
        data = inflater.decompress(plaintext[len(RAW4_MAGIC) + 1 + len(base):])
        if not inflater.eof:
            raise ValueError("raw payload is truncated")
    elif not plaintext.startswith(RAW3_MAGIC):
        return orjson.loads(plaintext)
    else:
        data = zlib.decompress(plaintext[len(RAW3_MAGIC):])
    (head_len,) = struct.unpack_from(">I", data)
    doc = orjson.loads(data[4:4 + head_len])
    pos = 4 + head_len

    def give(value: Any) -> Any:
        nonlocal pos
        if isinstance(value, dict) and set(value) == {"blob"}:
            n = int(value["blob"])
            blob = data[pos:pos + n]
            pos += n
            return base64.b64encode(blob).decode("ascii")
        return value

    for name in BODY_FIELDS:
        if name in doc:
            doc[name] = give(doc[name])
    if isinstance(doc.get("request_delta"), dict):
        doc["request_delta"]["middle"] = give(doc["request_delta"].get("middle"))
    if pos != len(data):
        raise ValueError("raw payload blobs do not add up to the header")
    if base is not None and (doc.get("request_delta") or {}).get("base") != base:
        raise ValueError("raw payload names another base than its delta")
    return doc


def decode_body(value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return base64.b64decode(value, validate=True)


# --- request bodies as deltas (issue 16) ------------------------------------------------------
#
# An agent resends its whole conversation with every call, so the raw request of a session's
# n-th call is the (n-1)-th one with a few messages inserted before its closing `]` (and the
# tools, params after it). Each raw request is kept as its delta against the previous one of
# the trajectory sealed under the same data key: the common prefix and suffix lengths and the
# bytes between, with the whole body's SHA-256 to check the rebuild. A chain restarts with a
# full copy when it would grow past DELTA_CHAIN_MAX links or DELTA_REBUILD_MAX bytes rebuilt:
# opening a call decrypts and inflates each link (small: a delta is a call's new messages),
# then rebuilds and hashes every body of the chain, so what it costs is the sum of the
# chain's body lengths, not its length; one query finds the chain (`delta_bases`). A full
# copy is a session's largest payload, the whole conversation so far: the fixed 64 links of
# decision 37 (16 before) cost 0.27 KB of every call's 1.2 KB of raw bytes at 200 calls of
# 0.6 KB, and more the longer the session (decision 41 measured the bound's open time).
# Crypto-shredding is unchanged (a delta and its base share the data key); retention and
# suppression re-seal the dependents of a payload whole before they destroy it
# (`rebase_dependents`).

DELTA_CHAIN_MAX = 256
DELTA_REBUILD_MAX = 16 * 1024 * 1024
# A delta is kept only when it is at most this share of the whole body.
DELTA_MAX_SHARE = 0.5


def _common_prefix(a: bytes, b: bytes, limit: int) -> int:
    """Length of the longest common prefix: a binary search over slice compares. On bytes a
    compare is a memcmp (the slices are copies, still ~0.2 ms for two 200 KB bodies); the same
    search over memoryviews compared element by element, ~3 ms a session call in the shipper."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Copies from the base inside a delta's middle (decision 48): blocks shorter than this are
# left in the literal (a copy costs ~15 bytes of header JSON, and short matches fragment it);
# ANCHOR is the probe of the new body looked up in the base; at most COPY_PROBES probes a
# delta.
COPY_MIN = 256
ANCHOR = 64
COPY_PROBES = 64


def _common_suffix(a: bytes, b: bytes, limit: int) -> int:
    """Length of the longest common suffix of at most `limit` bytes (as _common_prefix)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _copies(old: bytes, new: bytes) -> tuple[bytes, list[list[int]]]:
    """`new` as literal bytes plus copies of blocks of `old`: (literal, [[at, start, length]])
    — a copy of old[start:start + length] goes in at offset `at` of the literal. Greedy, in
    the order of `new`: take ANCHOR bytes of `new` where its unmatched part starts, find them
    in `old` (bytes.find: C; after the last copy first, then before it), keep the place when
    the COPY_MIN bytes from there match too, and grow the copy both ways (binary searches over
    slice compares). What it is for: a session whose first message changes at every call (a
    system prompt with the time or a memory block in it) sends the conversation again after
    a change near its start, and one common prefix and suffix leave all of it in the middle;
    so do agents that drop their oldest turns to stay within a context budget, or clear old
    tool results in place.

    Walking `new`, not `old` (decision 49): a block of `old` the body no longer has (a
    dropped turn, a cleared tool result) costs no probe, whatever its size — stepping through
    `old` a probe at a time passed 4 KB at most, so a 10 KB turn dropped sealed every payload
    whole. Where `new` has bytes `old` lacks (the new turn, a marker), the next probe is twice
    as far on as the last; one that lands past the start of the next copyable block grows back
    to it."""
    literal = bytearray()
    copies: list[list[int]] = []
    i = 0  # the first byte of new not covered yet
    p = 0  # where the next probe of new starts
    j = 0  # the end of the last copy in old
    stride = ANCHOR
    probes = 0
    while p + COPY_MIN <= len(new) and probes < COPY_PROBES:
        probes += 1
        q = _find_block(old, new, p, j)
        if q < 0:
            p += stride
            stride *= 2
            continue
        stride = ANCHOR
        back = _common_suffix(old[:q], new[:p], min(q, p - i))
        forward = COPY_MIN + _common_prefix(old[q + COPY_MIN:], new[p + COPY_MIN:],
                                            min(len(old) - q, len(new) - p) - COPY_MIN)
        start, length, at = q - back, back + forward, p - back
        literal += new[i:at]
        copies.append([len(literal), start, length])
        i = p = at + length
        j = start + length
    literal += new[i:]
    return bytes(literal), copies


# Places of a probe tried before it counts as not found (boilerplate such as
# `{"role":"assistant","content":null,"tool_calls":[{"id":"call_` recurs at every turn).
FIND_TRIES = 4


def _find_block(old: bytes, new: bytes, p: int, after: int) -> int:
    """Where in `old` the COPY_MIN bytes of `new` from `p` are, looked for after `after` (the
    end of the last copy: conversations keep their order) and then from the start; -1 when
    neither finds them in FIND_TRIES places of their first ANCHOR bytes."""
    probe, block = new[p:p + ANCHOR], new[p:p + COPY_MIN]
    # (start, end) of each search: places from `after` on, then those before it only.
    for lo, hi in ((after, len(old)), (0, after + ANCHOR - 1)) if after else ((0, len(old)),):
        q = old.find(probe, lo, hi)
        for _ in range(FIND_TRIES):
            if q < 0:
                break
            if old[q:q + COPY_MIN] == block:
                return q
            q = old.find(probe, q + 1, hi)
    return -1


def request_delta(base: bytes, body: bytes) -> dict[str, Any] | None:
    """`body` as {prefix, suffix, middle (base64), sha256} against `base` — and `copies` when
    blocks of the base's middle reappear in the body's (`_copies`: the body's middle is then
    the literal `middle` with those copies put in) — or None when that saves less than half
    of it (a different conversation, a short body)."""
    a, b = bytes(base), bytes(body)  # (bytes already: the same objects, no copy)
    limit = min(len(a), len(b))
    prefix = _common_prefix(a, b, limit)
    suffix = _common_suffix(a, b, limit - prefix)  # not overlapping the prefix
    middle = b[prefix:len(b) - suffix]
    copies: list[list[int]] = []
    if len(middle) > DELTA_MAX_SHARE * len(b):
        middle, copies = _copies(a[prefix:len(a) - suffix], middle)
        for copy in copies:
            copy[1] += prefix  # offsets into the whole base
        if len(middle) > DELTA_MAX_SHARE * len(b):
            return None
    delta: dict[str, Any] = {"prefix": prefix, "suffix": suffix,
                             "middle": base64.b64encode(middle).decode("ascii"),
                             "sha256": hashlib.sha256(body).hexdigest()}
    if copies:
        delta["copies"] = copies
    return delta


def apply_delta(base: bytes, delta: dict[str, Any]) -> bytes:
    prefix, suffix = int(delta["prefix"]), int(delta["suffix"])
    if prefix + suffix > len(base):
        raise ValueError("request delta does not fit its base")
    literal = base64.b64decode(delta["middle"], validate=True)
    pieces = [base[:prefix]]
    pos = 0
    for at, start, length in delta.get("copies") or ():
        at, start, length = int(at), int(start), int(length)
        if not (pos <= at <= len(literal) and 0 <= start and length > 0
                and start + length <= len(base)):
            raise ValueError("request delta does not fit its base")
        pieces += [literal[pos:at], base[start:start + length]]
        pos = at
    pieces += [literal[pos:], base[len(base) - suffix:] if suffix else b""]
    body = b"".join(pieces)
    if hashlib.sha256(body).hexdigest() != delta.get("sha256"):
        raise ValueError("request delta does not rebuild the body it was made from")
    return body


def data_keys_for(pairs: set[tuple[int, str]]) -> dict[tuple[int, str], DataKey]:
    """The DataKey rows of these (tenant, subject hash) pairs, creating the missing ones.
    Concurrent shippers may race: INSERT ... ON CONFLICT DO NOTHING, then read back, so both
    end up with the one row that won."""
    if not pairs:
        return {}

    def fetch() -> dict[tuple[int, str], DataKey]:
        from django.db.models import Q

        q = Q()
        for tenant_id, subject in pairs:
            q |= Q(tenant_id=tenant_id, subject_hash=subject)
        return {(k.tenant_id, k.subject_hash): k for k in DataKey.objects.filter(q)}

    found = fetch()
    missing = [p for p in pairs if p not in found]
    if missing:
        DataKey.objects.bulk_create(
            [DataKey(tenant_id=t, subject_hash=s,
                     wrapped_key=wrap_data_key(new_data_key(), data_key_aad(t, s)))
             for t, s in missing],
            ignore_conflicts=True,
        )
        found = fetch()
    return found


def key_is_destroyed(key: DataKey | None) -> bool:
    return key is None or key.destroyed_at is not None or not key.wrapped_key


def unwrap(key: DataKey) -> bytes:
    if key_is_destroyed(key):
        raise RawPayloadUnavailable("the data key is destroyed (subject erased)")
    return unwrap_data_key(bytes(key.wrapped_key), data_key_aad(key.tenant_id, key.subject_hash))


def seal_raw(plain_key: bytes, flow_id: str, plaintext: bytes) -> bytes:
    return seal(plain_key, plaintext, raw_aad(flow_id))


def dead_letter_aad(tenant_id: int, flow_id: str) -> bytes:
    return f"steward-deadletter-v1:{tenant_id}:{flow_id}".encode()


def seal_dead_letter(plain_key: bytes, tenant_id: int, flow_id: str, record_json: bytes) -> bytes:
    """A dead-lettered spool record (governance.models.DeadLetter), sealed like a raw payload
    under its subject's data key; the tenant and flow id bind it to its row."""
    return seal(plain_key, record_json, dead_letter_aad(tenant_id, flow_id))


def open_dead_letter(dead_letter: Any) -> dict[str, Any]:
    """The spool record of a DeadLetter row (callers showing it to a person audit the read)."""
    if dead_letter.record_ciphertext is None or dead_letter.data_key is None:
        raise RawPayloadUnavailable("no record stored (expired, purged or subject erased)")
    plain_key = unwrap(dead_letter.data_key)
    return orjson.loads(open_sealed(plain_key, bytes(dead_letter.record_ciphertext),
                                    dead_letter_aad(dead_letter.tenant_id, dead_letter.flow_id)))


class RecentBodies:
    """Per trajectory, the last call the step builder opened: its rebuilt request body,
    response body and exchange head, kept in this worker process (at most MAX_BYTES, least
    recently used dropped first). A batch's delta chains then end at it (`delta_bases`'s
    `known`, `open_raw`'s `bodies`) instead of at the last whole copy: opening a batch of a
    long session's calls costs its own links, not the chain's (decision 41). As the shipper's
    RawBases, it holds what this process has just had in the clear; nothing is read for it.
    Opening a call still unwraps that call's own data key first, so an erased subject's
    cached body opens nothing; `forget` drops a trajectory whose call did not open."""

    MAX_BYTES = 64 * 1024 * 1024

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        # (flow id, request body, response body, exchange head) by trajectory.
        self._last: LRUCache[Any, tuple[str, bytes, bytes, bytes]] = LRUCache(
            max_bytes, getsizeof=lambda entry: sum(len(part) for part in entry[1:]))

    def seed(self, trajectory_ids: set[Any]) -> dict[str, bytes]:
        """`open_raw`'s `bodies` for a batch of these trajectories ((tenant id, trajectory
        id) pairs, as everywhere here): what is kept of them."""
        bodies: dict[str, bytes] = {}
        for tid in trajectory_ids:
            entry = self._last.get(tid)
            if entry is not None:
                flow, request, response, head = entry
                bodies.update({flow: request, _response_key(flow): response,
                               _head_key(flow): head})
        return bodies

    def remember(self, trajectory_id: Any, flow_id: str, bodies: dict[str, bytes]) -> None:
        """Keep the call `flow_id` (opened into `bodies`) as its trajectory's last."""
        self.forget(trajectory_id)
        if not _opened(bodies, flow_id):
            return
        entry = (flow_id, bodies[flow_id], bodies[_response_key(flow_id)],
                 bodies[_head_key(flow_id)])
        if self._last.getsizeof(entry) <= self._last.maxsize:
            self._last[trajectory_id] = entry  # least recently used ones dropped for room

    def forget(self, trajectory_id: Any) -> None:
        self._last.pop(trajectory_id, None)


def known_flows(bodies: dict[str, bytes]) -> set[str]:
    """The flow ids whose request bodies `bodies` holds (not its response and head entries)."""
    return {k for k in bodies if "#" not in k}


def delta_bases(interactions: list[Interaction], known: set[str] | None = None
                ) -> dict[str, Interaction]:
    """The interactions the request deltas among `interactions` are rebuilt from — their
    bases, the bases' bases, up to the whole copies — by flow id, with their data keys: two
    queries whatever the chains' depth (a recursive walk of the chains, then the rows), not
    one per base. For `open_raw` (`bases`): a batch of a long session's calls used to look
    each link of a chain up alone. Run in the interactions' tenant scope (as open_raw looks
    bases up; row-level security applies to every step of the walk); for each flow id the
    row open_raw's own lookup would take (the first by primary key). `known`: flows already
    opened (`RecentBodies`), where a walk stops too."""
    have = {ia.flow_id for ia in interactions} | (known or set())
    wanted = {ia.raw_base_flow for ia in interactions if ia.raw_base_flow} - have
    if not wanted:
        return {}
    table = connection.ops.quote_name(Interaction._meta.db_table)
    with connection.cursor() as cur:
        # The walk stops at a whole copy (no base), at a call of the batch itself (opened
        # from the batch), and at a base that is gone (open_raw then says so).
        cur.execute(
            f"WITH RECURSIVE chain(flow_id, base) AS ("  # noqa: S608
            f"SELECT flow_id, raw_base_flow FROM {table} WHERE flow_id = ANY(%s) "
            f"UNION SELECT i.flow_id, i.raw_base_flow FROM {table} i JOIN chain c "
            "ON i.flow_id = c.base WHERE c.base <> '' AND NOT c.base = ANY(%s)"
            ") SELECT DISTINCT flow_id FROM chain", [sorted(wanted), sorted(have)])
        chain = {row[0] for row in cur.fetchall()} - have
    found: dict[str, Interaction] = {}
    for row in (Interaction.objects.filter(flow_id__in=chain).select_related("data_key")
                .order_by("pk")):
        found.setdefault(row.flow_id, row)
    return found


def _response_key(flow_id: str) -> str:
    # open_raw's `bodies` also holds each opened call's response body and exchange head, which
    # a format-4/5 delta of it needs (delta_dictionary); flow ids never contain "#".
    return f"{flow_id}#response"


def _head_key(flow_id: str) -> str:
    return f"{flow_id}#head"


def _find_base(interaction: Interaction, base_flow: str,
               bases: dict[str, Interaction] | None) -> Interaction:
    base = (bases or {}).get(base_flow)
    if base is None or base.tenant_id != interaction.tenant_id:
        from governance.tenancy import tenant_context

        # The base is the interaction's own tenant's (its trajectory's previous call).
        with tenant_context(interaction.tenant_id):
            base = (Interaction.objects.filter(flow_id=base_flow)
                    .select_related("data_key").first())
    if base is None:
        raise RawPayloadUnavailable(f"the base payload of this delta ({base_flow}) is gone")
    return base


def _opened(bodies: dict[str, bytes], flow_id: str) -> bool:
    return flow_id in bodies and _head_key(flow_id) in bodies


def _base_bodies(interaction: Interaction, base_flow: str, bodies: dict[str, bytes],
                 bases: dict[str, Interaction] | None) -> tuple[bytes, bytes, bytes]:
    """The request body, response body and exchange head of a delta's base, opened (and
    cached in `bodies`) when not opened yet."""
    if not _opened(bodies, base_flow):
        open_raw(_find_base(interaction, base_flow, bases), bodies, bases)
    return bodies[base_flow], bodies[_response_key(base_flow)], bodies[_head_key(base_flow)]


def _open_chain_below(interaction: Interaction, bodies: dict[str, bytes],
                      bases: dict[str, Interaction] | None) -> None:
    """Open the links under this call that `bodies` lacks, oldest first, so that each finds
    its base opened: a loop, not recursion, as a chain may be longer than Python's recursion
    limit (DELTA_CHAIN_MAX links, three frames each)."""
    below: list[Interaction] = []
    link = interaction
    while link.raw_base_flow and not _opened(bodies, link.raw_base_flow):
        link = _find_base(link, link.raw_base_flow, bases)
        below.append(link)
        if len(below) > 2 * DELTA_CHAIN_MAX:  # a loop of bases: damaged rows
            raise ValueError("raw payload's chain of bases does not end")
    for link in reversed(below):
        _open_one(link, bodies, bases)


def open_raw(interaction: Interaction, bodies: dict[str, bytes] | None = None,
             bases: dict[str, Interaction] | None = None) -> dict[str, Any]:
    """Decrypt an interaction's raw payload, its request body rebuilt when it is stored as a
    delta (formats 2, 4 and 5, always returned as format 1: `request_body` base64). `bodies`:
    request bodies already rebuilt, by flow id (a batch opening a session's calls passes one
    dict, so each base is decrypted once). `bases`: base interactions read beforehand
    (`delta_bases`); a base not in it is looked up. Callers that show it to a person must
    audit the read (governance.audit.record_event "raw.read"); the step builder reads it as
    the system."""
    bodies = {} if bodies is None else bodies
    _open_chain_below(interaction, bodies, bases)
    return _open_one(interaction, bodies, bases)


def _open_one(interaction: Interaction, bodies: dict[str, bytes],
              bases: dict[str, Interaction] | None) -> dict[str, Any]:
    """open_raw of one call whose base (if any) `bodies` holds or that is looked up."""
    if interaction.raw_ciphertext is None:
        raise RawPayloadUnavailable("no raw payload stored (expired or purged)")
    key = interaction.data_key
    if key is None:
        raise RawPayloadUnavailable("the data key is gone (subject erased)")
    plain_key = unwrap(key)
    plaintext = open_sealed(plain_key, bytes(interaction.raw_ciphertext),
                            raw_aad(interaction.flow_id))
    zdict = None
    packed_against = packed_base(plaintext)
    if packed_against is not None:
        request, response, head = _base_bodies(interaction, packed_against, bodies, bases)
        zdict = delta_dictionary(request, response, head if needs_head(plaintext) else None)
    raw = unpack_raw(plaintext, zdict)
    bodies[_response_key(interaction.flow_id)] = response_bytes(raw)
    bodies[_head_key(interaction.flow_id)] = exchange_head(raw)
    delta = raw.pop("request_delta", None)
    if delta is None:
        bodies[interaction.flow_id] = decode_body(raw.get("request_body")) or b""
        return raw
    base_body, _, _ = _base_bodies(interaction, str(delta.get("base") or ""), bodies, bases)
    body = apply_delta(base_body, delta)
    bodies[interaction.flow_id] = body
    raw["v"] = 1
    raw["request_body"] = base64.b64encode(body).decode("ascii")
    return raw


def rebase_dependents(flow_ids: list[str]) -> int:
    """Before the payloads of these flows are destroyed or their rows deleted: every live
    payload stored as a delta against one of them is sealed whole again (its data key, its
    flow id as associated data, as the shipper does). Returns how many."""
    doomed = set(flow_ids)
    if not doomed:
        return 0
    # A delta's base is an earlier call of its own trajectory: look within the doomed flows'
    # trajectories (their index), not the whole table (raw_base_flow has none: decision 38).
    trajectories = Interaction.objects.filter(flow_id__in=doomed).values("trajectory_id")
    dependents = list(Interaction.objects.filter(trajectory_id__in=trajectories,
                                                 raw_base_flow__in=doomed,
                                                 raw_ciphertext__isnull=False)
                      .exclude(flow_id__in=doomed).select_related("data_key"))
    bodies: dict[str, bytes] = {}
    for ia in dependents:
        raw = open_raw(ia, bodies)
        ia.raw_ciphertext = seal_raw(unwrap(ia.data_key), ia.flow_id, pack_raw(raw))
        ia.raw_base_flow = ""
    Interaction.objects.bulk_update(dependents, ["raw_ciphertext", "raw_base_flow"],
                                    batch_size=200)
    return len(dependents)


def insert_ignore_conflicts(objs: list, returning: tuple[str, ...]) -> list[tuple]:
    """Multi-row INSERT ... ON CONFLICT DO NOTHING RETURNING <cols>: the rows that were really
    inserted (Django's bulk_create(ignore_conflicts=True) cannot say which)."""
    if not objs:
        return []
    if len(objs) > INSERT_CHUNK:  # keep under PostgreSQL's 65535 bind parameters
        return [row for i in range(0, len(objs), INSERT_CHUNK)
                for row in insert_ignore_conflicts(objs[i:i + INSERT_CHUNK], returning)]
    model = type(objs[0])
    meta = model._meta
    fields = [f for f in meta.concrete_fields if not (f.primary_key and f.auto_created)]
    qn = connection.ops.quote_name
    cols = ", ".join(qn(f.column) for f in fields)
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    params: list[Any] = []
    for obj in objs:
        for f in fields:
            params.append(f.get_db_prep_save(f.pre_save(obj, True), connection))
    sql = (f"INSERT INTO {qn(meta.db_table)} ({cols}) VALUES "
           + ", ".join([row] * len(objs))
           + " ON CONFLICT DO NOTHING RETURNING "
           + ", ".join(qn(meta.get_field(c).column) for c in returning))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
