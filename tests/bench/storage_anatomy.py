"""What a captured call costs in the database, part by part: for each agent, per call, each
table's rows split into the data they keep (payload columns), the rest of the row (keys,
digests, timestamps, tuple headers), page slack and index entries; then what of that is an
answer kept twice (the next call's echoed copy of the previous answer) and what is the
conversation's opening (system prompt, tool schemas, instructions).

    .venv/bin/python tests/bench/storage_anatomy.py DATABASE [--agent NAME ...] [--json PATH]

DATABASE is a database name on DATABASE_URL's server (default
postgresql://postgres@127.0.0.1:5432/) or a postgresql:// URL: typically the one
`tests/bench/long_sessions.py --keep` leaves (its agents are `bench-<shape>-<mode>`, so one-off
and session calls of a run are told apart). Nothing is written; it reads as the database's
owner would, outside any tenant (the system scope).

The bench's "KB per call by table" rows say where a call's bytes are; this says why they are
there, which is what a planner deciding the next storage change needs (decision 60's notes
measured these by hand with pg_column_size). How the figures are made:

- rows of an agent: interactions and trajectories by their agent; steps, conversation items,
  subject-index rows and placeholder deltas by their trajectory's agent; findings by their
  step's. Per call = divided by the agent's steps.
- payload: pg_column_size of the columns that hold the call's data (see PAYLOAD) as stored
  (compressed where the column is); row: the rest of pg_column_size(row) plus the 4-byte line
  pointer; page slack: the table's heap (pg_table_size: with TOAST, free space and visibility
  maps) beyond its rows, shared out by row bytes; index: each index's size shared out by row
  count. The shares are exact when one agent wrote the whole table, proportional otherwise.
- audit events, pending interactions and the partition bookkeeping are not any one agent's and
  are left out (the bench's by-table rows show them).
- an echoed answer: an item a step appends that is equal to one of its parent step's answer
  messages (the action's `messages`): the agent sent back the answer it was given, and it is
  stored again as an item, with its own findings and subject-index rows. Since decision 62
  such an item is a reference to the answer (19 bytes, no findings), counted apart as "answers
  sent back, kept as a reference"; what is still an echo is one the store could not point at.
- the opening: items of kind `tools` or `instructions`, and messages whose role is `system` or
  `developer`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[2]

# Table -> the columns that hold the call's data (what the rest of the row is there to find).
PAYLOAD = {
    "governance_interaction": ("raw_ciphertext", "error_message"),
    "governance_step": ("observation", "hidden_state", "action", "tokens", "usage", "timings",
                        "versions", "metadata", "error", "item_refs", "appended"),
    "governance_conversationitem": ("content",),
    "governance_finding": ("counts", "spans"),
    "governance_subjectindex": ("hashes",),
    "governance_placeholderdelta": ("data",),
    "governance_trajectory": (),
}
_BY_TRAJECTORY = "x.trajectory_id IN (SELECT id FROM governance_trajectory WHERE agent_id = %s)"
# Table -> which of its rows are the agent's (alias x).
AGENT_ROWS = {
    "governance_interaction": "x.agent_id = %s",
    "governance_step": _BY_TRAJECTORY,
    "governance_conversationitem": _BY_TRAJECTORY,
    "governance_finding": ("x.step_id IN (SELECT s.id FROM governance_step s JOIN "
                           "governance_trajectory t ON t.id = s.trajectory_id "
                           "WHERE t.agent_id = %s)"),
    "governance_subjectindex": _BY_TRAJECTORY,
    "governance_placeholderdelta": _BY_TRAJECTORY,
    "governance_trajectory": "x.agent_id = %s",
}
LINE_POINTER = 4  # bytes of a heap page's item pointer, per row
PARTS = ("payload", "row", "slack", "index")


def _relations(cur: Any, table: str) -> list[str]:
    """The table itself and its partitions (a partitioned parent stores nothing itself)."""
    cur.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s", [table])
    return [table] + [name for (name,) in cur.fetchall()]


def _storage(cur: Any, table: str) -> tuple[int, dict[str, int]]:
    """(heap bytes with TOAST and maps, index name -> bytes) of a table and its partitions;
    a partition's index counts under its partitioned parent index's name."""
    heap = 0
    indexes: dict[str, int] = defaultdict(int)
    for rel in _relations(cur, table):
        cur.execute("SELECT pg_table_size(%s::regclass)", [rel])
        heap += int(cur.fetchone()[0])
        cur.execute("SELECT ic.relname, coalesce(pc.relname, ic.relname), "
                    "pg_relation_size(ic.oid) FROM pg_index x "
                    "JOIN pg_class ic ON ic.oid = x.indexrelid "
                    "LEFT JOIN pg_inherits pi ON pi.inhrelid = ic.oid "
                    "LEFT JOIN pg_class pc ON pc.oid = pi.inhparent "
                    "WHERE x.indrelid = %s::regclass", [rel])
        for _, name, size in cur.fetchall():
            indexes[name] += int(size)
    return heap, dict(indexes)


def _payload_sql(table: str) -> str:
    """SQL summing a row's payload columns (alias x)."""
    return " + ".join(f"coalesce(pg_column_size(x.{c}), 0)" for c in PAYLOAD[table]) or "0"


def _rows(cur: Any, table: str, where: str, params: list[Any]) -> tuple[int, int, int]:
    """(rows, bytes of those rows with line pointers, bytes of their payload columns)."""
    cur.execute(f"SELECT count(*), coalesce(sum(pg_column_size(x.*)), 0), "  # noqa: S608
                f"coalesce(sum({_payload_sql(table)}), 0) FROM {table} x WHERE {where}",
                params)
    n, row_bytes, payload_bytes = cur.fetchone()
    return int(n), int(row_bytes) + LINE_POINTER * int(n), int(payload_bytes)


def _whole_tables(cur: Any) -> dict[str, dict[str, Any]]:
    """Per table, once for all agents: its heap and index bytes and all its rows' bytes."""
    out = {}
    for table in AGENT_ROWS:
        heap, indexes = _storage(cur, table)
        n, row_bytes, _ = _rows(cur, table, "TRUE", [])
        out[table] = {"heap": heap, "indexes": indexes, "rows": n, "row_bytes": row_bytes}
    return out


def _table_costs(cur: Any, agent_id: int, whole: dict[str, dict[str, Any]]
                 ) -> dict[str, dict[str, Any]]:
    """The agent's rows per table, and its share of each table's page slack (by row bytes)
    and of each index (by row count)."""
    out = {}
    for table, where in AGENT_ROWS.items():
        n, row_bytes, payload = _rows(cur, table, where, [agent_id])
        w = whole[table]
        slack = (max(0, w["heap"] - w["row_bytes"]) * row_bytes / w["row_bytes"]
                 if w["row_bytes"] else 0)
        index_share = {name: round(size * n / w["rows"]) if w["rows"] else 0
                       for name, size in w["indexes"].items()}
        out[table] = {"rows": n, "payload": payload, "row": row_bytes - payload,
                      "slack": round(slack), "index": sum(index_share.values()),
                      "indexes": index_share}
    return out


def _unit_cost(costs: dict[str, Any]) -> float:
    """Bytes one row of a table costs on average: its row and its share of slack and
    indexes, payload excluded (the caller adds the row's own payload)."""
    n = costs["rows"]
    return (costs["row"] + costs["slack"] + costs["index"]) / n if n else 0.0


def _echoes_and_openings(cur: Any, agent_id: int, tables: dict[str, dict[str, Any]]
                         ) -> dict[str, Any]:
    from governance.models import AnswerRef, ItemJSONField, StepJSONField

    cur.execute("SELECT x.id, x.kind, x.content, pg_column_size(x.content) "
                f"FROM governance_conversationitem x WHERE {_BY_TRAJECTORY}",  # noqa: S608
                [agent_id])
    items = {pk: (kind, ItemJSONField.unpack(content), int(size))
             for pk, kind, content, size in cur.fetchall()}
    cur.execute("SELECT x.id, x.parent_step, x.appended, x.action "
                f"FROM governance_step x WHERE {_BY_TRAJECTORY}", [agent_id])  # noqa: S608
    steps = cur.fetchall()
    answers = {sid: (StepJSONField.unpack(action) or {}).get("messages") or []
               for sid, _, _, action in steps}
    echoed: set[int] = set()
    with_parent = 0
    for _, parent, appended, _ in steps:
        if parent is None or parent not in answers:
            continue
        with_parent += 1
        mine = [i for i in appended or () if i in items
                and items[i][1] in answers[parent]]
        echoed.update(mine)
    # Items stored as a reference to the answer they repeat (decision 62): what is left of
    # an answer sent back.
    referenced = {pk for pk, (_, content, _) in items.items() if isinstance(content, AnswerRef)}
    opening = {pk for pk, (kind, content, _) in items.items()
               if kind in ("tools", "instructions")
               or (isinstance(content, dict) and content.get("role") in ("system", "developer"))}

    def cost(ids: set[int]) -> dict[str, float]:
        """Item, finding and subject-index bytes of these items (payload + shares)."""
        if not ids:
            return {"items": 0, "item_bytes": 0.0, "finding_bytes": 0.0, "subject_bytes": 0.0}
        item_bytes = sum(items[i][2] for i in ids) + len(ids) * _unit_cost(
            tables["governance_conversationitem"])
        found = {}
        for table in ("governance_finding", "governance_subjectindex"):
            cur.execute(f"SELECT count(*), coalesce(sum({_payload_sql(table)}), 0) "  # noqa: S608
                        f"FROM {table} x WHERE x.item_id = ANY(%s)", [list(ids)])
            n, data = cur.fetchone()
            found[table] = int(data) + int(n) * _unit_cost(tables[table])
        return {"items": len(ids), "item_bytes": item_bytes,
                "finding_bytes": found["governance_finding"],
                "subject_bytes": found["governance_subjectindex"]}

    return {"steps_with_parent": with_parent, "echoed": cost(echoed),
            "referenced": cost(referenced), "opening": cost(opening)}


def anatomy(agent_names: list[str] | None = None) -> list[dict[str, Any]]:
    """Per agent (every agent with steps when `agent_names` is None), its calls and the bytes
    per table and part, on the database Django is connected to."""
    from django.db import connection

    from governance.tenancy import system_context

    out = []
    with system_context("storage anatomy (bench)"), connection.cursor() as cur:
        cur.execute("SELECT a.id, a.name, count(s.id), count(DISTINCT t.id) "
                    "FROM governance_agent a JOIN governance_trajectory t ON t.agent_id = a.id "
                    "JOIN governance_step s ON s.trajectory_id = t.id "
                    "GROUP BY a.id, a.name ORDER BY a.id")
        agents = [a for a in cur.fetchall() if agent_names is None or a[1] in agent_names]
        whole = _whole_tables(cur) if agents else {}
        for agent_id, name, calls, trajectories in agents:
            tables = _table_costs(cur, agent_id, whole)
            out.append({"agent": name, "calls": int(calls), "trajectories": int(trajectories),
                        "tables": tables, **_echoes_and_openings(cur, agent_id, tables)})
    return out


def report(entry: dict[str, Any]) -> str:
    calls = entry["calls"]
    lines = [f"\n== {entry['agent']}: {calls} calls in {entry['trajectories']} trajectories; "
             "bytes per call ==",
             f"{'table':<18} {'rows':>6} {'payload':>8} {'row':>7} {'slack':>7} "
             f"{'index':>7} {'total':>8}"]
    totals = dict.fromkeys(PARTS, 0.0)
    tables = sorted(entry["tables"].items(),
                    key=lambda kv: -sum(kv[1][p] for p in PARTS))
    for table, c in tables:
        per = {p: c[p] / calls for p in PARTS}
        for p in PARTS:
            totals[p] += per[p]
        lines.append(f"{table.removeprefix('governance_'):<18} {c['rows'] / calls:>6.2f} "
                     + " ".join(f"{per[p]:>{8 if p == 'payload' else 7}.0f}" for p in PARTS)
                     + f" {sum(per.values()):>8.0f}")
    lines.append(f"{'all of these':<18} {'':>6} "
                 + " ".join(f"{totals[p]:>{8 if p == 'payload' else 7}.0f}" for p in PARTS)
                 + f" {sum(totals.values()):>8.0f}")
    for table, c in tables:
        if c["indexes"]:
            big = sorted(c["indexes"].items(), key=lambda kv: -kv[1])
            lines.append(f"  {table.removeprefix('governance_')} indexes: "
                         + ", ".join(f"{name} {size / calls:.0f}" for name, size in big))
    for what, label in (("echoed", "answers kept twice (an appended item equal to the parent "
                                   "step's answer)"),
                        ("referenced", "answers sent back, kept as a reference (decision 62)"),
                        ("opening", "openings (system prompt, tools, instructions items)")):
        e = entry[what]
        total = (e["item_bytes"] + e["finding_bytes"] + e["subject_bytes"]) / calls
        extra = (f" in {entry['steps_with_parent']} steps with a parent"
                 if what == "echoed" else "")
        lines.append(f"{label}: {e['items']} items{extra}; per call {total:.0f} B: item "
                     f"{e['item_bytes'] / calls:.0f}, findings {e['finding_bytes'] / calls:.0f}"
                     f", subject index {e['subject_bytes'] / calls:.0f}")
    return "\n".join(lines)


def _database_url(database: str) -> str:
    if "://" in database:
        return database
    server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    return urlunsplit(urlsplit(server)._replace(path="/" + database))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="What a captured call costs in a Steward database, by table and part "
                    "(payload, rest of the row, page slack, indexes), per agent; and what of "
                    "it is answers kept twice and conversation openings.",
        epilog="Typically on the database `tests/bench/long_sessions.py --keep` leaves: "
               "tests/bench/storage_anatomy.py steward_bench_12345")
    ap.add_argument("database", help="a database name on DATABASE_URL's server, or a "
                                     "postgresql:// URL")
    ap.add_argument("--agent", action="append", metavar="NAME",
                    help="only this agent (repeatable; default: every agent with steps)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    os.environ["DATABASE_URL"] = _database_url(args.database)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.pop("DATABASE_OWNER_URL", None)
    # Reading needs no key; settings only require one to be set.
    os.environ.setdefault("STEWARD_MASTER_KEY", "c3RvcmFnZSBhbmF0b215IHJlYWRzIG5vIGtleXMhIQ==")
    sys.path.insert(0, str(REPO))
    import django
    from django.db.utils import OperationalError

    django.setup()
    try:
        entries = anatomy(args.agent)
    except OperationalError as exc:
        print(f"storage_anatomy: cannot read {args.database}: {exc}", file=sys.stderr)
        return 2
    if not entries:
        print(f"storage_anatomy: no agent with steps in {args.database}"
              + (f" named {', '.join(args.agent)}" if args.agent else ""), file=sys.stderr)
        return 1
    for entry in entries:
        print(report(entry))
    if args.json:
        Path(args.json).write_text(json.dumps(entries, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
