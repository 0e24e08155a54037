"""Time partitions of interactions, steps and findings (migration 0017, docs/decisions.md 33).

Each of the three tables is range-partitioned by month (UTC) on its time column, with a
DEFAULT partition so that an insert never fails for want of one. Partitions are created ahead
by the beat task governance.tasks.ensure_partitions (the current month and the next
`MONTHS_AHEAD - 1`) through the SECURITY DEFINER function `steward_ensure_partitions`: the
services' role owns no table, so it cannot create or drop one itself. Rows that landed in the
DEFAULT partition for a month that gets its partition later are moved into it by that
function. Retention (governance/retention.py) drops a whole month through
`steward_drop_partition` when every row in it is past its deadline.

Nothing here reads a partition directly: a month is read through its parent with a range
predicate (PostgreSQL prunes to the partition), so the app role needs no grant on partitions
and row-level security is the parent's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime

from django.db import connection, transaction
from django.utils import timezone

# table -> partition key
PARTITIONED = {
    "governance_interaction": "started_at",
    "governance_step": "started_at",
    "governance_finding": "created_at",
}
MONTHS_AHEAD = 3  # the current month and the next two
_MONTHLY = re.compile(r"^(?P<table>governance_[a-z]+)_p(?P<year>\d{4})_(?P<month>\d{2})$")


@dataclass(frozen=True, order=True)
class Month:
    start: datetime  # UTC, inclusive
    end: datetime    # UTC, exclusive

    @classmethod
    def of(cls, year: int, month: int) -> Month:
        start = datetime(year, month, 1, tzinfo=UTC)
        end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
        return cls(start, end)

    def suffix(self) -> str:
        return f"p{self.start:%Y_%m}"

    def partition(self, table: str) -> str:
        return f"{table}_{self.suffix()}"


def ensure_partitions(months: int = MONTHS_AHEAD, *, first: date | None = None) -> list[dict]:
    """Create the monthly partitions of the three tables that are missing from the month of
    `first` (default: now, UTC) for `months` months. Idempotent. Returns what was created:
    [{"partition": name, "moved_rows": rows moved out of the DEFAULT partition}]."""
    first = first or timezone.now().astimezone(UTC).date()
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT partition_name, moved_rows FROM steward_ensure_partitions(%s, %s)",
                    [first, months])
        return [{"partition": name, "moved_rows": moved} for name, moved in cur.fetchall()]


def monthly_partitions(table: str) -> list[Month]:
    """The months that have a partition of `table`, oldest first (the DEFAULT one excluded)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid "
            "JOIN pg_class p ON p.oid = h.inhparent WHERE p.relname = %s", [table])
        names = [row[0] for row in cur.fetchall()]
    months = []
    for name in names:
        m = _MONTHLY.match(name)
        if m and m["table"] == table:
            months.append(Month.of(int(m["year"]), int(m["month"])))
    return sorted(months)


def drop_partition(table: str, month: Month) -> bool:
    """Detach and drop one month of `table` (inside the caller's transaction). False when it
    has no such partition."""
    if month not in monthly_partitions(table):
        return False
    with connection.cursor() as cur:
        cur.execute("SELECT steward_drop_partition(%s)", [month.partition(table)])
    return True
