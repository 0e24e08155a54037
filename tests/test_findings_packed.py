"""Findings packed one row per place (governance/capture/findings.py, migration 0020, decision
37): the codec keeps every finding's detail, the real step builder writes one row per item and
per step side with counts that agree with the detail, and the migration packs rows of the
row-per-finding layout and gives them back exactly."""

from __future__ import annotations

import uuid
import zlib
from collections import Counter

import pytest
from django.core.management import call_command
from django.db import connection

from governance.capture import findings as codec
from governance.capture.atdp import trajectory_document
from governance.models import Finding, PendingInteraction, Step, Trajectory
from governance.tenancy import tenant_context
from tests.pipeline import customer_session, ship_and_build


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "findings-bot")


def test_codec_round_trip_keeps_order_and_cuts_long_strings():
    found = [
        {"entity_type": "PERSON", "path": "$.messages[1].content", "value_path": "",
         "start": 17, "end": 29, "score": 0.85, "recognizer": "SpacyRecognizer",
         "operator": "placeholder"},
        {"entity_type": "EMAIL_ADDRESS", "path": "$.messages[1].content", "value_path": "",
         "start": 31, "end": 55, "score": 1.0, "recognizer": "EmailRecognizer",
         "operator": "placeholder"},
        {"entity_type": "PERSON", "path": "$.tools[0]", "value_path": "$.name" + "x" * 600,
         "start": 0, "end": 4, "score": 0.123456, "recognizer": "r", "operator": "redact"},
    ]
    back = codec.unpack(codec.pack([codec.clean(f) for f in found]))
    assert [b["entity_type"] for b in back] == ["PERSON", "EMAIL_ADDRESS", "PERSON"]
    assert back[0] == found[0] and back[1] == found[1]
    assert back[2]["score"] == 0.123 and len(back[2]["value_path"]) == 512
    assert codec.counts([codec.clean(f) for f in found]) == {"EMAIL_ADDRESS": 1, "PERSON": 2}
    assert codec.unpack(b"") == []
    # Each distinct string once: 60 findings on one path pack into far less than their rows.
    many = [dict(found[0], start=i, end=i + 5) for i in range(60)]
    assert len(codec.pack([codec.clean(f) for f in many])) < 150


def test_format2_reads_format1_and_refuses_what_is_neither():
    """Rows written before decision 40 (format 1) read the same; format 2 is smaller on a
    PII-dense tool result (one path, a value path per field) and keeps negative or odd values
    exactly; a damaged blob is an error, never other findings."""
    fields = ["name", "email", "phone", "address", "note"]
    found = [codec.clean({"entity_type": ["PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER",
                                          "STREET_ADDRESS", "PERSON"][j],
                          "path": "$.messages[9].content",
                          "value_path": f"$.customers[{i}].{fields[j]}", "start": 3 * j,
                          "end": 3 * j + 11 + i, "score": 0.85, "recognizer": "email",
                          "operator": "placeholder"})
             for i in range(10) for j in range(5)]
    v1, v2 = codec.pack_v1(found), codec.pack(found)
    assert v2.startswith(codec.MAGIC) and not v1.startswith(codec.MAGIC)
    assert codec.unpack(v1) == codec.unpack(v2) == found
    assert len(v2) < 0.6 * len(v1)
    odd = [dict(found[0], start=-4, end=-9, score=-0.25, value_path="ü\u0000x")]
    assert codec.unpack(codec.pack(odd)) == odd
    assert codec.unpack(codec.pack([])) == []
    for bad in (v2[:-3], codec.MAGIC + b"junk", v2 + b"\x00", b"\x00fd9" + v2[4:]):
        with pytest.raises((ValueError, zlib.error)):
            codec.unpack(bad)


def test_builder_writes_one_row_per_place_and_side(tenant, agent, tmp_path):
    traj = str(uuid.uuid4())
    ship_and_build(tmp_path, customer_session(tenant.pk, agent.pk, traj))
    assert not PendingInteraction.objects.exists()  # every call built
    steps = list(Step.objects.filter(trajectory_id=traj).order_by("started_at"))
    rows = list(Finding.objects.filter(step__trajectory_id=traj))
    places = [(r.step_id, r.item_id, r.side) for r in rows]
    assert len(places) == len(set(places))  # one row per place and side
    for r in rows:
        details = r.details()
        assert r.total == len(details) >= 1
        assert r.counts == dict(sorted(Counter(d["entity_type"] for d in details).items()))
        for d in details:
            assert d["side"] == r.side and 0 <= d["start"] < d["end"]
            assert "garcia" not in str(d).lower() and "@" not in str(d)
    # The customer message: one item row on the first step, with both people and emails.
    customer = [r for r in rows if r.item_id is not None and r.counts.get("PERSON", 0) >= 2]
    assert len(customer) == 1 and customer[0].step_id == steps[0].pk
    assert customer[0].counts["EMAIL_ADDRESS"] == 2
    # The first response names Maria: a response-side row of the first step.
    assert any(r.side == "response" and r.step_id == steps[0].pk and r.item_id is None
               for r in rows)
    # ATDP's counts are the rows' counts summed, per step and for the trajectory.
    with tenant_context(tenant):
        doc = trajectory_document(Trajectory.objects.select_related("tenant", "agent")
                                  .get(pk=traj))
    total: Counter[str] = Counter()
    for r in rows:
        total.update(r.counts)
    assert doc["governance"]["findings"] == dict(sorted(total.items()))
    first_counts: Counter[str] = Counter()
    for r in rows:
        if r.step_id == steps[0].pk:
            first_counts.update(r.counts)
    assert doc["steps"][0]["governance"]["findings"] == dict(sorted(first_counts.items()))


def test_migration_0020_packs_and_expands_rows_of_the_old_layout(tenant, agent,
                                                                 transactional_db):
    """Rows of the row-per-finding layout (0019) are grouped per (step, item, side) by 0020,
    and its reverse gives back every row — the same ids for the first of each group and the
    same values for all."""
    call_command("migrate", "governance", "0019", verbosity=0)
    steps = [uuid.uuid4(), uuid.uuid4()]
    old = []  # (step, side, entity type, path, value path, start, end, score, rec, op)
    for i, step in enumerate(steps):
        for side in ("request", "response"):
            for j, etype in enumerate(["PERSON", "EMAIL_ADDRESS", "PERSON"][:2 + i]):
                old.append((step, side, etype, f"$.messages[{j}].content",
                            "$.q" if j == 1 else "", j * 10, j * 10 + 5, 0.5 + j / 10,
                            "rec", "placeholder"))
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        ids = []
        for step, side, etype, path, vpath, start, end, score, rec, op in old:
            cur.execute(
                'INSERT INTO governance_finding (tenant_id, step_id, item_id, side, '
                'entity_type, path, value_path, start, "end", score, recognizer, operator, '
                "sanitizer_version, created_at) VALUES (%s, %s, NULL, %s, %s, %s, %s, %s, %s, "
                "%s, %s, %s, 'v1', now()) RETURNING id",
                [tenant.pk, step, side, etype, path, vpath, start, end, score, rec, op])
            ids.append(cur.fetchone()[0])
    call_command("migrate", "governance", verbosity=0)
    with tenant_context(tenant):
        rows = list(Finding.objects.filter(step_id__in=steps).order_by("pk"))
    assert len(rows) == 4  # 2 steps x 2 sides
    assert sum(r.total for r in rows) == len(old)
    assert rows[0].pk == ids[0] and rows[0].counts == {"EMAIL_ADDRESS": 1, "PERSON": 1}
    detail = sorted((r.step_id, r.side, d["entity_type"], d["path"], d["value_path"],
                     d["start"], d["end"], d["score"], d["recognizer"], d["operator"])
                    for r in rows for d in r.details())
    assert detail == sorted(old)

    call_command("migrate", "governance", "0019", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute('SELECT id, step_id, side, entity_type, path, value_path, start, "end", '
                    "score, recognizer, operator FROM governance_finding "
                    "WHERE step_id = ANY(%s) ORDER BY id", [steps])
        back = cur.fetchall()
    assert sorted(b[1:] for b in back) == sorted(old)
    firsts = {min(i for i, o in zip(ids, old, strict=True) if o[:2] == key)
              for key in {o[:2] for o in old}}
    assert firsts <= {b[0] for b in back}
    call_command("migrate", "governance", verbosity=0)


def test_migration_0029_repacks_rows_both_ways(tenant, agent, transactional_db):
    """0029 re-encodes rows of format 1 (what 0020 and the releases before wrote) in format 2,
    and its reverse gives format 1 back with the same detail: what 0020's reverse reads."""
    call_command("migrate", "governance", "0028", verbosity=0)
    found = [codec.clean({"entity_type": "PERSON", "path": f"$.messages[{i}].content",
                          "value_path": "", "start": i, "end": i + 7, "score": 0.85,
                          "recognizer": "spacy_ner", "operator": "placeholder"})
             for i in range(5)]
    step = uuid.uuid4()
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("INSERT INTO governance_finding (tenant_id, step_id, item_id, side, counts, "
                    "total, spans, sanitizer_version, created_at) VALUES (%s, %s, NULL, "
                    "'request', '{\"PERSON\": 5}', 5, %s, 'v1', now()), (%s, %s, NULL, "
                    "'response', '{}', 0, '', 'v1', now())",
                    [tenant.pk, step, codec.pack_v1(found), tenant.pk, step])

    def stored() -> list[bytes]:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT spans FROM governance_finding WHERE step_id = %s ORDER BY side",
                        [step])
            return [bytes(row[0]) for row in cur.fetchall()]

    call_command("migrate", "governance", "0029", verbosity=0)
    spans, empty = stored()
    assert spans.startswith(codec.MAGIC) and codec.unpack(spans) == found and empty == b""
    call_command("migrate", "governance", "0028", verbosity=0)
    spans, empty = stored()
    assert not spans.startswith(codec.MAGIC) and spans == codec.pack_v1(found)
    assert empty == b""
    call_command("migrate", "governance", verbosity=0)
