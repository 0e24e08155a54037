"""Detection results shared by a host's worker processes (governance.sanitizing.SharedDetections,
decision 43): what one process analysed another reuses, keyed so that the cache holds no text,
no result of other detector code or another key, and every failure of it is a miss."""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

from governance.recognizers import Span
from governance.sanitizer.engine import Analysis
from governance.sanitizing import (
    AnalysisCache,
    SharedDetections,
    decode_analysis,
    encode_analysis,
)

SECRET = b"k" * 32
TEXTS = ["Call Maria Garcia at 020 7946 0018 about order 77.", "plain words only",
         "Kai Tanaka moved to Osaka."]


class CountingAnalyzer:
    """Stands in for StewardAnalyzer where the tests count what was analysed (the real one is
    used where the results themselves matter)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def analyze_batch(self, texts, with_ner, organizations: bool = False) -> list[Analysis]:
        self.asked.extend(texts)
        return [Analysis([Span("PERSON", 0, min(4, len(t)), 0.85, "spacy_ner")],
                         [("PERSON", 0, min(4, len(t)))]) for t in texts]


def _analyse_in_child(directory: str, texts: list[str], queue: Any) -> None:
    analyzer = CountingAnalyzer()
    cache = AnalysisCache(analyzer, shared=SharedDetections(directory, SECRET))
    cache.analyze_batch(texts, [True] * len(texts))
    queue.put((analyzer.asked, cache.hits, cache.shared.hits))


def _in_other_process(directory: Path, texts: list[str]) -> tuple[list[str], int, int]:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_analyse_in_child, args=(str(directory), texts, queue))
    child.start()
    out = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    return out


def test_a_string_one_process_analysed_is_not_analysed_again_by_another(tmp_path):
    asked, hits, shared_hits = _in_other_process(tmp_path, TEXTS[:2])
    assert asked == TEXTS[:2] and hits == 0 and shared_hits == 0
    asked, hits, shared_hits = _in_other_process(tmp_path, TEXTS[1:])
    assert asked == TEXTS[2:]  # the second string came from the first process's work
    assert hits == 1 and shared_hits == 1
    # and this process, a third one, finds all three
    analyzer = CountingAnalyzer()
    cache = AnalysisCache(analyzer, shared=SharedDetections(tmp_path, SECRET))
    results = cache.analyze_batch(TEXTS, [True] * 3)
    assert analyzer.asked == [] and cache.hits == 3 and cache.misses == 0
    assert results == CountingAnalyzer().analyze_batch(TEXTS, [True] * 3)


def test_real_results_come_back_equal_and_the_cache_holds_no_text(tmp_path):
    from governance.sanitizer import get_sanitizer

    analyzer = get_sanitizer().analyzer
    analyzer = getattr(analyzer, "_analyzer", analyzer)  # the bare StewardAnalyzer
    fresh = analyzer.analyze_batch(TEXTS, [True, False, True])
    assert any(r.spans for r in fresh)
    for r in fresh:
        assert decode_analysis(encode_analysis(r)) == r
    first = AnalysisCache(analyzer, shared=SharedDetections(tmp_path, SECRET))
    assert first.analyze_batch(TEXTS, [True, False, True]) == fresh
    second = AnalysisCache(analyzer, shared=SharedDetections(tmp_path, SECRET))
    assert second.analyze_batch(TEXTS, [True, False, True]) == fresh
    assert second.shared.hits == 3
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    for needle in ("Maria Garcia", "Garcia", "7946", "Osaka", "Tanaka", "plain words"):
        assert needle.encode() not in stored, needle


def test_another_key_options_or_detector_find_nothing(tmp_path):
    CountingAnalyzer_ = CountingAnalyzer
    base = AnalysisCache(CountingAnalyzer_(), shared=SharedDetections(tmp_path, SECRET))
    base.analyze_batch(TEXTS, [True] * 3)

    def misses(shared: SharedDetections, with_ner: bool = True, **options: Any) -> int:
        analyzer = CountingAnalyzer_()
        AnalysisCache(analyzer, shared=shared).analyze_batch(TEXTS, [with_ner] * 3, **options)
        return len(analyzer.asked)

    assert misses(SharedDetections(tmp_path, SECRET)) == 0
    assert misses(SharedDetections(tmp_path, b"another master key".ljust(32))) == 3
    assert misses(SharedDetections(tmp_path, SECRET), with_ner=False) == 3
    assert misses(SharedDetections(tmp_path, SECRET), organizations=True) == 3
    upgraded = SharedDetections(tmp_path, SECRET)
    upgraded._fingerprint = b"\x00" * 16  # other recognizers, word lists or packages
    assert misses(upgraded) == 3


def test_entries_expire(tmp_path):
    short = SharedDetections(tmp_path, SECRET, ttl_s=0.3)
    AnalysisCache(CountingAnalyzer(), shared=short).analyze_batch(TEXTS, [True] * 3)
    assert len(SharedDetections(tmp_path, SECRET).get_many(
        [short.key(t, True, ((), ())) for t in TEXTS])) == 3
    time.sleep(0.5)
    analyzer = CountingAnalyzer()
    AnalysisCache(analyzer, shared=SharedDetections(tmp_path, SECRET)).analyze_batch(
        TEXTS, [True] * 3)
    assert analyzer.asked == TEXTS


def test_a_broken_cache_is_a_miss_never_a_wrong_result(tmp_path, caplog):
    shared = SharedDetections(tmp_path / "cache", SECRET)
    key = shared.key(TEXTS[0], True, ((), ()))
    shared.get_many([])  # creates the file
    with sqlite3.connect(tmp_path / "cache" / SharedDetections.FILE) as db:
        db.execute("INSERT INTO detection VALUES (?, ?, ?)", (key, b"\x00not json",
                                                              time.time() + 60))
    analyzer = CountingAnalyzer()
    with caplog.at_level(logging.WARNING, logger="governance.sanitizing"):
        out = AnalysisCache(analyzer, shared=shared).analyze_batch(TEXTS, [True] * 3)
    assert sorted(analyzer.asked) == sorted(TEXTS)  # the bad one too, put off to the end
    assert out == CountingAnalyzer().analyze_batch(TEXTS, [True] * 3)
    assert "shared detection cache read failed" in caplog.text
    assert len(shared.get_many([key])) == 1  # overwritten by the result analysed here
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / SharedDetections.FILE).write_bytes(b"not a database" * 100)
    caplog.clear()
    analyzer = CountingAnalyzer()
    with caplog.at_level(logging.WARNING, logger="governance.sanitizing"):
        out = AnalysisCache(analyzer, shared=SharedDetections(tmp_path / "other", SECRET)
                            ).analyze_batch(TEXTS, [True] * 3)
    assert analyzer.asked == TEXTS and len(out) == 3
    assert "DatabaseError" in caplog.text

    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    caplog.clear()
    analyzer = CountingAnalyzer()
    with caplog.at_level(logging.WARNING, logger="governance.sanitizing"):
        out = AnalysisCache(analyzer, shared=SharedDetections(blocked, SECRET)).analyze_batch(
            TEXTS, [True] * 3)
    assert analyzer.asked == TEXTS and len(out) == 3
    assert "shared detection cache read failed" in caplog.text
    assert str(blocked) in caplog.text


def test_the_cache_directory_is_private_to_the_service(tmp_path):
    directory = tmp_path / "var" / "detection-cache"
    AnalysisCache(CountingAnalyzer(), shared=SharedDetections(directory, SECRET)).analyze_batch(
        TEXTS, [True] * 3)
    assert directory.stat().st_mode & 0o777 == 0o700


def test_settings_turn_it_on_and_off(settings, tmp_path):
    from governance.sanitizing import shared_detections

    settings.STEWARD_DETECTION_CACHE_DIR = ""
    assert shared_detections() is None
    settings.STEWARD_DETECTION_CACHE_DIR = str(tmp_path)
    settings.STEWARD_DETECTION_CACHE_MB = 8
    settings.STEWARD_DETECTION_CACHE_SECONDS = 60
    shared = shared_detections()
    assert shared is not None and shared.directory == str(tmp_path)
    assert shared.size_bytes == 8 * 1024 * 1024 and shared.ttl_s == 60


def test_the_builder_reuses_what_another_process_analysed_and_says_so(
        tenant, tmp_path, caplog, monkeypatch):
    """Two sessions carrying the same tool output, built as if by two processes (the
    process's own cache emptied between them): the second batch's log line counts the
    strings the shared cache answered, and its steps are what they would be without it."""
    import re

    from governance import sanitizing
    from governance.models import Step
    from governance.services import ensure_agent
    from governance.tenancy import tenant_context
    from tests.pipeline import chat_response, make_record, ship_and_build

    agent = ensure_agent("system:test", tenant, "shared-bot")
    cache = sanitizing.sanitizer_for_tenant(tenant).analyzer
    monkeypatch.setattr(cache, "shared", SharedDetections(tmp_path / "cache", SECRET))
    note = ("Customer note: Priya Raman (priya.raman@example.org, +44 20 7946 0321) asked "
            "us to move the delivery to 14 Elm Grove, Leeds LS6 2AB.")

    def session() -> str:
        traj = str(uuid.uuid4())
        request = {"model": "m", "messages": [
            {"role": "user", "content": f"Session {traj}: read the notes"},
            {"role": "tool", "tool_call_id": "c1", "content": note}]}
        ship_and_build(tmp_path / traj, [make_record(
            tenant.pk, agent.pk, trajectory_id=traj, request=request,
            response=chat_response("Done."))])
        return traj

    lines = []
    for _ in range(2):
        cache.clear()  # a process that has analysed nothing itself
        with caplog.at_level(logging.INFO, logger="steward.capture"):
            caplog.clear()
            session_id = session()
        lines += [r.getMessage() for r in caplog.records if " built 1 steps " in r.getMessage()]
    assert len(lines) == 2, lines
    first, second = (re.search(r"(\d+) of (\d+) strings' detection cached \((\d+) shared\)",
                               line).groups() for line in lines)
    assert first[2] == "0"
    assert int(second[2]) >= 2  # the note and the assistant's answer at least
    with tenant_context(tenant):
        step = Step.objects.get(trajectory_id=session_id)
        text = str(step.observation)
    assert "Priya" not in text and "7946 0321" not in text and "LS6 2AB" not in text


def test_a_string_another_process_is_analysing_is_put_off_and_never_waited_on(tmp_path):
    other = SharedDetections(tmp_path, SECRET)
    assert other.claim([other.key(TEXTS[0], True, ((), ()))])  # analysing it now
    analyzer = CountingAnalyzer()
    t0 = time.monotonic()
    out = AnalysisCache(analyzer, shared=SharedDetections(tmp_path, SECRET)).analyze_batch(
        TEXTS, [True] * 3)
    assert time.monotonic() - t0 < 5  # the claim lapses after 60 s: not waited for
    assert analyzer.asked == [TEXTS[1], TEXTS[2], TEXTS[0]]  # its own first, the claimed last
    assert out == CountingAnalyzer().analyze_batch(TEXTS, [True] * 3)


def test_a_put_off_string_is_taken_once_the_other_process_published_it(tmp_path, monkeypatch):
    from governance import sanitizing

    monkeypatch.setattr(sanitizing, "SHARED_CHUNK", 1)
    other = SharedDetections(tmp_path, SECRET)
    key = other.key(TEXTS[0], True, ((), ()))
    assert other.claim([key])
    theirs = Analysis([Span("PERSON", 5, 17, 0.85, "spacy_ner")], [("PERSON", 5, 17)])

    class Slow(CountingAnalyzer):
        def analyze_batch(self, texts, with_ner, organizations: bool = False):
            if not self.asked:  # meanwhile the other process finishes its batch
                other.put_many({key: theirs})
            return super().analyze_batch(texts, with_ner, organizations)

    analyzer = Slow()
    cache = AnalysisCache(analyzer, shared=SharedDetections(tmp_path, SECRET))
    out = cache.analyze_batch(TEXTS, [True] * 3)
    assert analyzer.asked == TEXTS[1:]
    assert out[0] == theirs and cache.hits == 1 and cache.misses == 2


def test_past_its_size_the_older_half_goes(tmp_path, monkeypatch):
    shared = SharedDetections(tmp_path, SECRET, size_mb=0.05)
    analysis = CountingAnalyzer().analyze_batch(["x"], [True])[0]
    for batch in range(10):  # ~150 KB of entries, each batch expiring later than the last
        monkeypatch.setattr(time, "time", lambda b=batch: 1_000_000.0 + b)
        shared.put_many({shared.key(f"{batch}-{i}", True, ()): analysis for i in range(100)})
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0 + 10)
    shared._maintain(shared._conn())
    left = shared._conn().execute("SELECT count(*) FROM detection").fetchone()[0]
    assert 400 <= left <= 600
    assert len(shared.get_many([shared.key("9-0", True, ())])) == 1  # the newest stay
    assert shared.get_many([shared.key("0-0", True, ())]) == {}
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0 + 10 + 3600)
    shared._maintain(shared._conn())  # and what expired goes
    assert shared._conn().execute("SELECT count(*) FROM detection").fetchone()[0] == 0


def test_two_real_worker_processes_share_what_they_analysed(transactional_db, tmp_path):
    """Through real Celery workers, one process after another (as two workers of a host
    are): the second builds a session carrying the first one's tool output and its log line
    counts the strings the shared cache answered. The cache directory is private and holds
    none of the analysed text."""
    import re

    from governance.capture.shipper import ship_once
    from governance.models import Step
    from governance.services import create_tenant, ensure_agent
    from governance.tasks import build_steps
    from tests.live import celery_worker
    from tests.pipeline import chat_response, make_record, write_records

    tenant = create_tenant("system:test", "shared", "Shared Bank")[0]
    agent = ensure_agent("system:test", tenant, "shared-bot")
    cache_dir = tmp_path / "detection-cache"
    note = ("Support note: Ingrid Svensson (ingrid.svensson@example.se, +46 8 555 0199) asked "
            "for her card to be reissued to Storgatan 12, Uppsala.")
    logs = []
    for n in range(2):
        traj = str(uuid.uuid4())
        write_records(tmp_path / f"spool{n}", [make_record(
            tenant.pk, agent.pk, trajectory_id=traj, request={"model": "m", "messages": [
                {"role": "user", "content": f"Session {n}: what does the note say?"},
                {"role": "tool", "tool_call_id": "c1", "content": note}]},
            response=chat_response("The card goes to the address on file."))])
        ids: list[int] = []
        ship_once(tmp_path / f"spool{n}", enqueue=ids.extend)
        log = tmp_path / f"worker{n}.log"
        with celery_worker("capture", log, f"shared-{n}",
                           STEWARD_TEST_DETECTION_CACHE_DIR=str(cache_dir)):
            build_steps.delay(ids, tenant_id=tenant.pk)
            deadline = time.monotonic() + 180
            while not Step.objects.filter(trajectory_id=traj).exists():
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.25)
            while " built 1 steps " not in log.read_text():  # logged after the commit
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.1)
        logs.append(log.read_text())
    shared = [int(re.search(r"strings' detection cached \((\d+) shared\)", text).group(1))
              for text in logs]
    assert shared[0] == 0 and shared[1] >= 2, shared  # the note and the answer at least
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    stored = b"".join(p.read_bytes() for p in cache_dir.rglob("*") if p.is_file())
    assert stored
    for needle in ("Ingrid", "Svensson", "555 0199", "Storgatan", "Uppsala"):
        assert needle.encode() not in stored, needle


def test_the_context_enhancer_without_its_copy_finds_what_presidios_finds():
    """governance/sanitizer/engine.py's enhancer skips Presidio's deep copy where no result
    has a recognizer with context words; over third-party text and strings that do raise a
    score by context (dates, licences, passports), every result is what Presidio's own
    LemmaContextAwareEnhancer gives."""
    import json

    from presidio_analyzer.context_aware_enhancers import LemmaContextAwareEnhancer

    from governance.sanitizer import get_sanitizer

    analyzer = get_sanitizer().analyzer
    analyzer = getattr(analyzer, "_analyzer", analyzer)
    synth = Path(__file__).parent / "bench" / "data" / "synth_dataset_v2.json"
    texts = [row["full_text"] for row in json.loads(synth.read_text())[:300]] + [
        "Date of birth: 1985-03-12, passport 912803456, driver license D1234567.",
        "Visit https://example.com/a?b=1 before 2026-01-31; medical license AB123456.",
        "born on 12/03/1985 in Leeds", "plain words"]
    ours = analyzer.analyze_batch(texts, [True] * len(texts))
    engine = analyzer.analyzer
    original = engine.context_aware_enhancer
    engine.context_aware_enhancer = LemmaContextAwareEnhancer()
    try:
        presidios = analyzer.analyze_batch(texts, [True] * len(texts))
    finally:
        engine.context_aware_enhancer = original
    assert type(original).__name__ == "StewardContextEnhancer"
    assert ours == presidios
    assert sum(len(a.spans) for a in ours) > 300
    assert any(s.recognizer in ("DateRecognizer", "UsPassportRecognizer", "UsLicenseRecognizer")
               for a in ours for s in a.spans)
