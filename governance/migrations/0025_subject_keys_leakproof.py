"""Subject-index lookups use the GIN index under row-level security (decision 38): the index
is rebuilt with the leakproof operator class of governance/subject_keys.py (why: there).

Creating that class needs a superuser: this migration creates it when it runs as one (tests,
compose's POSTGRES_USER); the embedded appliance's set-up creates it before migrating
(config/embedded.py, whose owner role is not a superuser). Without it the index stays as it
was, lookups keep `&&` (right answers, full scans under row-level security) and the first
lookup of each process logs a warning. Reversible: the plain GIN index again, and the class
dropped when a superuser reverses."""

from django.db import migrations

# The uuid[] class: the keys' type from 0023 to 0031 (decision 40 moved them to bigint[]).
from governance.subject_keys import UUID_CREATE_SQL as CREATE_SQL
from governance.subject_keys import UUID_DROP_SQL as DROP_SQL
from governance.subject_keys import UUID_OPCLASS as OPCLASS

INDEX = ("CREATE INDEX subjectindex_hashes ON governance_subjectindex USING gin (hashes{}) "
         "WITH (fastupdate = off)")


def _superuser(cur) -> bool:
    cur.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    row = cur.fetchone()
    return bool(row and row[0])


def _rebuild(cur, opclass: str) -> None:
    cur.execute("DROP INDEX IF EXISTS subjectindex_hashes")
    cur.execute(INDEX.format(f" {opclass}" if opclass else ""))


def forward(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        if _superuser(cur):
            cur.execute(CREATE_SQL)
        cur.execute("SELECT 1 FROM pg_opclass WHERE opcname = %s", [OPCLASS])
        if cur.fetchone() is not None:
            _rebuild(cur, OPCLASS)


def backward(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        _rebuild(cur, "")
        if _superuser(cur):
            for statement in DROP_SQL:
                cur.execute(statement)


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0024_interaction_indexes"),
    ]

    operations = [migrations.RunPython(forward, backward)]
