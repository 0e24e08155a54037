"""`manage.py verify_audit` — walk the hash chain; non-zero exit at the first bad event."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from governance.audit import audit_event_count, verify_chain


class Command(BaseCommand):
    help = (
        "Verify the hash-chained audit log: every event's sequence number follows the previous "
        "one without gaps, links to the previous event's hash, and hashes to its stored value. "
        "Exits 0 with 'audit chain OK: N events', or exits 1 naming the first bad sequence "
        "number (an event was changed, deleted or inserted out of band)."
    )

    def handle(self, *args, **options) -> None:
        ok, bad_seq, reason = verify_chain()
        if not ok:
            raise CommandError(f"audit chain BROKEN at seq {bad_seq}: {reason}")
        self.stdout.write(f"audit chain OK: {audit_event_count()} events")
