"""Conversation-item digests and step history digests keep 128 bits (decision 40,
governance/capture/conversation.py DIGEST_HEX): `m:`/`t:`/`i:`/`s:` and 32 hex digits instead of
64, in the row and in the unique index. No schema change; one UPDATE of each, under the system
scope (row-level security).

An item's new digest is its old one cut, the same HMAC, so a live trajectory finds its stored
items again. Its steps' history digests chain those digests, so chains computed from now on
differ from the stored ones (cut as well, to free the bytes): the next call of a live
trajectory finds no parent, takes its whole history as appended item references (the items
themselves are found, not copied), and its calls after that extend it as before.

The reverse changes nothing: the release before computes 64-digit digests, which match none of
these, so it stores each live trajectory's items once more and re-roots its next step — a
duplicate, never a wrong message."""

from django.db import migrations

FORWARD = [
    "SELECT set_config('steward.system', 'on', true)",
    "UPDATE governance_conversationitem SET digest = left(digest, 34) "
    "WHERE digest ~ '^[a-z]:[0-9a-f]{64}$'",
    "UPDATE governance_step SET history_digest = left(history_digest, 32) "
    "WHERE length(history_digest) = 64",
    # The updates queued deferred foreign-key checks; later schema changes in the same
    # transaction refuse to run with trigger events pending.
    "SET CONSTRAINTS ALL IMMEDIATE",
]


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0031_subject_index_64bit_keys"),
    ]

    operations = [migrations.RunSQL(FORWARD, migrations.RunSQL.noop)]
