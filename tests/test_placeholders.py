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


def test_migration_0019_back_folds_the_deltas_into_the_base(tenant, agent, transactional_db,
                                                            monkeypatch):
    monkeypatch.setenv("STEWARD_MIGRATION_ACCEPT_LOSS", "placeholder-keys")  # 0026's reverse
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
    assert folded == {**whole, "v": 1}  # the layout 0018 reads
    call_command("migrate", "governance", verbosity=0)
    # The re-created table has the app role's grants again (copied from the trajectories'):
    # this test's scope runs as that role.
    with tenant_context(tenant):
        assert placeholder_state(traj.pk).to_json() == whole


# --- format 2 (decision 39, capture/delta_codec.py) --------------------------------------------

def _format1(delta: dict) -> bytes:
    """A delta as the release before 0026 packed it: zlib over JSON, 128-bit hex keys."""
    import zlib

    import orjson

    return zlib.compress(orjson.dumps(delta), 6)


def test_format_2_round_trips_every_label_shape_and_reads_format_1():
    from governance.capture import delta_codec

    assert delta_codec.KEY_HEX == PlaceholderState.KEY_HEX
    delta = {"labels": {"0123456789abcdef": "PERSON_1", "fedcba9876543210": "EMAIL_ADDRESS_12",
                        "00000000000000ff": "US_SSN_0", "1111111111111111": "CUSTOM_07",
                        "2222222222222222": "NO_NUMBER"},
             "aliases": {"3333333333333333": "PERSON_1"},
             "counters": {"PERSON": 1, "EMAIL_ADDRESS": 300}}
    packed = PlaceholderDelta.pack({"v": 2, **delta})
    assert PlaceholderDelta.unpack(packed) == {"v": 2, **delta}
    # Keys as 8 raw bytes: well under the ~23 bytes an entry of format 1.
    assert len(packed) < 14 * 6 + 40
    old = {"v": 1, "labels": {"0123456789abcdef" * 2: "PERSON_1"}, "counters": {"PERSON": 1}}
    assert PlaceholderDelta.unpack(_format1(old)) == {
        "v": 2, "labels": {"0123456789abcdef": "PERSON_1"}, "counters": {"PERSON": 1}}
    for bad in (packed[:-1], packed + b"\x00"):
        with pytest.raises(ValueError):
            PlaceholderDelta.unpack(bad)
    with pytest.raises(ValueError):
        PlaceholderDelta.pack({"labels": {"abc": "PERSON_1"}})


def test_a_delta_packs_to_the_same_bytes_whatever_order_it_was_filled_in():
    """The builder fills a delta from sets, whose order changes with each process's string
    hashing: the stored bytes must not (tests.bench.step_cpu compares two runs' rows)."""
    labels = {f"{i:016x}": f"PERSON_{i}" for i in range(1, 30)}
    aliases = {f"{i:016x}": f"PERSON_{i}" for i in range(100, 90, -1)}
    counters = {"PERSON": 29, "EMAIL_ADDRESS": 3, "IBAN_CODE": 1}
    forward = {"labels": labels, "aliases": aliases, "counters": counters}
    backward = {part: dict(reversed(list(entries.items())))
                for part, entries in forward.items()}
    assert PlaceholderDelta.pack(forward) == PlaceholderDelta.pack(backward)
    assert PlaceholderDelta.unpack(PlaceholderDelta.pack(backward)) == {"v": 2, **forward}


def test_a_trajectory_numbered_with_128_bit_keys_goes_on_with_the_same_numbers(tenant, agent):
    """A state and deltas written before 0026 (32 hex digits a key) read as their first 64
    bits, which is what the sanitizer now looks the same values up by."""
    from governance.sanitizer.policy import _mac

    def old_key(purpose: str, value: str) -> str:
        return _mac(SECRET, purpose, value)[:32]

    base = {"v": 1, "counters": {"PERSON": 1},
            "labels": {old_key("ph:PERSON", "maria garcia"): "PERSON_1"},
            "aliases": {old_key("alias", "garcia"): "PERSON_1"}}
    traj = _trajectory(tenant, agent, base)
    with tenant_context(tenant):
        Trajectory.objects.filter(pk=traj.pk).update(sanitizer_state_seq=1)
        PlaceholderDelta.objects.create(
            tenant=tenant, trajectory=traj, seq=1, data=_format1(
                {"v": 1, "counters": {"PERSON": 1, "EMAIL_ADDRESS": 1},
                 "labels": {old_key("ph:EMAIL_ADDRESS", "a@example.com"): "EMAIL_ADDRESS_1"}}))
        state = placeholder_state(traj.pk)
    assert state.label("PERSON", "maria garcia", SECRET) == "PERSON_1"
    assert state.alias_label("Garcia", SECRET) == "PERSON_1"
    assert state.label("EMAIL_ADDRESS", "a@example.com", SECRET) == "EMAIL_ADDRESS_1"
    assert state.label("PERSON", "peter novak", SECRET) == "PERSON_2"


def test_migration_0026_converts_the_deltas_and_refuses_a_lossy_reverse(
        tenant, agent, transactional_db, monkeypatch):
    from governance.capture.delta_codec import MAGIC

    traj = _trajectory(tenant, agent)
    old = {"v": 1, "counters": {"PERSON": 2},
           "labels": {"a" * 32: "PERSON_1", "b" * 32: "PERSON_2"},
           "aliases": {"c" * 32: "PERSON_2"}}
    call_command("migrate", "governance", "0025", verbosity=0)
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("INSERT INTO governance_placeholderdelta (tenant_id, trajectory_id, seq, "
                        "data, created_at) VALUES (%s, %s, 1, %s, now())",
                        [tenant.pk, traj.pk, _format1(old)])
    finally:
        call_command("migrate", "governance", verbosity=0)

    def stored() -> bytes:
        with connection.cursor() as cur:
            cur.execute("SELECT set_config('steward.system', 'on', false)")
            cur.execute("SELECT data FROM governance_placeholderdelta WHERE trajectory_id = %s",
                        [traj.pk])
            return bytes(cur.fetchone()[0])

    converted = stored()
    assert converted.startswith(MAGIC) and len(converted) < len(_format1(old))
    assert PlaceholderDelta.unpack(converted) == {
        "v": 2, "counters": {"PERSON": 2}, "labels": {"a" * 16: "PERSON_1", "b" * 16: "PERSON_2"},
        "aliases": {"c" * 16: "PERSON_2"}}

    monkeypatch.delenv("STEWARD_MIGRATION_ACCEPT_LOSS", raising=False)
    with pytest.raises(RuntimeError, match="governance 0026 .*placeholder-keys"):
        call_command("migrate", "governance", "0025", verbosity=0)
    assert stored() == converted  # refused before anything changed
    monkeypatch.setenv("STEWARD_MIGRATION_ACCEPT_LOSS", "placeholder-keys")
    call_command("migrate", "governance", "0025", verbosity=0)
    try:
        import zlib

        back = json.loads(zlib.decompress(stored()))
        assert back == {"v": 1, "counters": {"PERSON": 2},
                        "labels": {"a" * 16: "PERSON_1", "b" * 16: "PERSON_2"},
                        "aliases": {"c" * 16: "PERSON_2"}}
    finally:
        call_command("migrate", "governance", verbosity=0)
    assert PlaceholderDelta.unpack(stored())["labels"] == {"a" * 16: "PERSON_1",
                                                           "b" * 16: "PERSON_2"}
