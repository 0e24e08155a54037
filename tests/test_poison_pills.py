"""Poison pills (issue 12, items 6 and 7): one record or interaction the database cannot store
must not stop the shipper or a tenant's step building; it is set aside where a person can see
it, and everything around it goes on."""

from __future__ import annotations

import pytest

from governance.models import Interaction, Step
from governance.tasks import build_steps
from proxy.shipper import ship_once
from tests.pipeline import chat_response, make_record, write_records


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "support-bot")


def _chat(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


# --- item 7: a step PostgreSQL refuses --------------------------------------------------------

def test_nul_in_message_content_quarantines_that_interaction_and_builds_its_neighbours(
        tenant, agent, tmp_path):
    before = make_record(tenant.pk, agent.pk, request=_chat("first"),
                         response=chat_response("one"), t=1_700_000_000)
    poison = make_record(tenant.pk, agent.pk, request=_chat("a\u0000b"),
                         response=chat_response("two"), t=1_700_000_001)
    after = make_record(tenant.pk, agent.pk, request=_chat("third"),
                        response=chat_response("th\u0000ree"), t=1_700_000_002)
    fine = make_record(tenant.pk, agent.pk, request=_chat("fourth"),
                       response=chat_response("four"), t=1_700_000_003)
    write_records(tmp_path, [before, poison, after, fine])
    ship_once(tmp_path, enqueue=None)
    ids = {r["flow_id"]: Interaction.objects.get(flow_id=r["flow_id"]).pk
           for r in (before, poison, after, fine)}

    # One batch holds all four (as the shipper enqueues them): jsonb refuses "\u0000", and
    # before the fix the whole batch rolled back with a DataError, every time it was retried.
    result = build_steps(list(ids.values()))
    assert result == {"built": 2, "quarantined": 2, "skipped": 0}
    for rec in (before, fine):
        assert Interaction.objects.get(flow_id=rec["flow_id"]).state == "processed"
        assert Step.objects.filter(pk=rec["step_id"]).exists()
    for rec in (poison, after):
        ia = Interaction.objects.get(flow_id=rec["flow_id"])
        assert ia.state == "quarantined"
        assert ia.state_reason.startswith("step not stored: the database refused it (DataError")
        assert "\x00" not in ia.state_reason
        assert not Step.objects.filter(interaction=ia).exists()
        assert ia.raw_ciphertext is not None  # kept: erasure and compliance can still see it

    # The tenant is not stuck: a later call is built, and the quarantined ones stay put.
    later = make_record(tenant.pk, agent.pk, request=_chat("later"),
                        response=chat_response("five"))
    write_records(tmp_path, [later])
    ship_once(tmp_path, enqueue=None)
    pk = Interaction.objects.get(flow_id=later["flow_id"]).pk
    assert build_steps([pk]) == {"built": 1, "quarantined": 0, "skipped": 0}
    assert Interaction.objects.filter(state="captured").count() == 0
