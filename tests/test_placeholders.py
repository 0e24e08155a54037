"""A trajectory's placeholder state as a base plus append-only deltas (governance/capture/
placeholders.py, migration 0019, decision 34): what the batches numbered reads back as the one
state, each batch writes only what it added, and going back to 0018 folds the deltas into the
base column."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from governance.capture.placeholders import (
    delta_between,
    placeholder_state,
    read_states,
    write_deltas,
)
from governance.models import PlaceholderDelta, Trajectory
from governance.sanitizer import PlaceholderState
from governance.tenancy import tenant_context

SECRET = b"k" * 32


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "ph-bot")


def _trajectory(tenant, agent, base: dict | None = None) -> Trajectory:
    now = timezone.now()
    return Trajectory.objects.create(tenant=tenant, agent=agent, started_at=now,
                                     last_step_at=now, sanitizer_state=base or {})


def _batch(state: PlaceholderState, values: list[tuple[str, str]]) -> None:
    for etype, value in values:
        label = state.label(etype, value, SECRET)
        if etype == "PERSON":
            state.add_person_aliases(value, label, SECRET)


def test_batches_append_only_what_they_numbered_and_read_back_whole(tenant, agent):
    base = PlaceholderState()
    _batch(base, [("PERSON", "Maria Garcia")])  # a trajectory built before the deltas
    traj = _trajectory(tenant, agent, base.to_json())
    batches = [[("EMAIL_ADDRESS", "a@example.com"), ("PERSON", "Peter Novak")],
               [("PERSON", "Maria Garcia"), ("EMAIL_ADDRESS", "a@example.com")],  # all known
               [("PERSON", "Dana White"), ("PHONE_NUMBER", "+1 415 555 0142")]]
    expected = PlaceholderState.from_json(base.to_json())
    with tenant_context(tenant):
        for values in batches:
            seq, state = read_states([traj.pk])[traj.pk]
            before = state.to_json()
            _batch(state, values)
            _batch(expected, values)
            locked = {traj.pk: Trajectory.objects.select_for_update().get(pk=traj.pk)}
            assert locked[traj.pk].sanitizer_state_seq == seq
            write_deltas(locked, {traj.pk: state}, {traj.pk: before})
        assert placeholder_state(str(traj.pk)).to_json() == expected.to_json()
        deltas = list(PlaceholderDelta.objects.filter(trajectory=traj).order_by("seq"))
    # The batch that numbered nothing new wrote nothing; the others only their own entries.
    assert [d.seq for d in deltas] == [1, 2]
    assert Trajectory.objects.get(pk=traj.pk).sanitizer_state_seq == 2
    assert len(deltas[0].delta()["labels"]) == 2 and "aliases" in deltas[0].delta()
    assert Trajectory.objects.get(pk=traj.pk).sanitizer_state == base.to_json()
    assert delta_between(expected.to_json(), expected) == {}


def test_migration_0019_back_folds_the_deltas_into_the_base(tenant, agent, transactional_db):
    base = PlaceholderState()
    _batch(base, [("PERSON", "Maria Garcia")])
    traj = _trajectory(tenant, agent, base.to_json())
    with tenant_context(tenant):
        state = placeholder_state(traj.pk)
        before = state.to_json()
        _batch(state, [("EMAIL_ADDRESS", "a@example.com"), ("PERSON", "Peter Novak")])
        write_deltas({traj.pk: Trajectory.objects.get(pk=traj.pk)}, {traj.pk: state},
                     {traj.pk: before})
    whole = state.to_json()
    call_command("migrate", "governance", "0018", verbosity=0)
    with connection.cursor() as cur:
        cur.execute("SELECT set_config('steward.system', 'on', false)")
        cur.execute("SELECT sanitizer_state FROM governance_trajectory WHERE id = %s",
                    [traj.pk])
        folded = cur.fetchone()[0]
    folded = folded if isinstance(folded, dict) else json.loads(folded)
    assert folded == whole
    call_command("migrate", "governance", verbosity=0)
    # The re-created table has the app role's grants again (copied from the trajectories'):
    # this test's scope runs as that role.
    with tenant_context(tenant):
        assert placeholder_state(traj.pk).to_json() == whole
