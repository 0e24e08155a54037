"""Subject-index lookups use the GIN index under row-level security (decision 38).

The services run as a role under forced row-level security, and PostgreSQL evaluates a query's
own conditions after the policy's unless their functions are LEAKPROOF — and none of the array
operators is (`&&` is `arrayoverlap`: generic over element types, some of whose comparisons
could raise errors that reveal a value). So `hashes && ARRAY[...]`, erasure's and the console's
subject lookup, could never be an index condition there: every lookup read the whole subject
index, every tenant's rows, and filtered (the erasure bench's plan: a sequential scan).

For uuid keys, `arrayoverlap` reveals nothing but its answer (uuid equality is leakproof), so
this migration declares `steward_keys_overlap(uuid[], uuid[])` LEAKPROOF over the same C
function, an operator `&&&` on it, and a GIN operator class (the built-in array support
functions, keyed by uuid) whose strategy 1 is that operator; subjectindex_hashes is rebuilt
with it. Lookups then use the index under the policy (governance.models.subject_keys_operator
picks `&&&` when the index has this class).

Declaring a function LEAKPROOF and creating an operator class need a superuser. Run by any
other role, the migration changes nothing and lookups keep `&&` (correct, but a full scan
under row-level security; the first lookup of each process logs a warning). Reversible."""

from django.db import migrations

OPCLASS = "steward_uuid_keys_ops"
CREATE = [
    "CREATE FUNCTION steward_keys_overlap(uuid[], uuid[]) RETURNS boolean LANGUAGE internal "
    "IMMUTABLE STRICT PARALLEL SAFE LEAKPROOF AS 'arrayoverlap'",
    "CREATE OPERATOR &&& (LEFTARG = uuid[], RIGHTARG = uuid[], "
    "FUNCTION = steward_keys_overlap, COMMUTATOR = &&&, RESTRICT = contsel, "
    "JOIN = contjoinsel)",
    f"CREATE OPERATOR CLASS {OPCLASS} FOR TYPE uuid[] USING gin AS "
    "OPERATOR 1 &&& (uuid[], uuid[]), "
    "FUNCTION 1 uuid_cmp(uuid, uuid), "
    "FUNCTION 2 ginarrayextract(anyarray, internal, internal), "
    "FUNCTION 3 ginqueryarrayextract(anyarray, internal, int2, internal, internal, internal, "
    "internal), "
    "FUNCTION 4 ginarrayconsistent(internal, int2, anyarray, int4, internal, internal, internal, "
    "internal), "
    "FUNCTION 6 ginarraytriconsistent(internal, int2, anyarray, int4, internal, internal, "
    "internal), "
    "STORAGE uuid",
    "DROP INDEX IF EXISTS subjectindex_hashes",
    f"CREATE INDEX subjectindex_hashes ON governance_subjectindex USING gin (hashes {OPCLASS}) "
    "WITH (fastupdate = off)",
]
DROP = [
    "DROP INDEX IF EXISTS subjectindex_hashes",
    "CREATE INDEX subjectindex_hashes ON governance_subjectindex USING gin (hashes) "
    "WITH (fastupdate = off)",
    f"DROP OPERATOR CLASS IF EXISTS {OPCLASS} USING gin",
    f"DROP OPERATOR FAMILY IF EXISTS {OPCLASS} USING gin",
    "DROP OPERATOR IF EXISTS &&& (uuid[], uuid[])",
    "DROP FUNCTION IF EXISTS steward_keys_overlap(uuid[], uuid[])",
]


def _superuser(cursor) -> bool:
    cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    row = cursor.fetchone()
    return bool(row and row[0])


def forward(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        if not _superuser(cur):
            return
        for statement in CREATE:
            cur.execute(statement)


def backward(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_opclass WHERE opcname = %s", [OPCLASS])
        if cur.fetchone() is None:
            return  # forward changed nothing (not a superuser)
        for statement in DROP:
            cur.execute(statement)


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0024_interaction_indexes"),
    ]

    operations = [migrations.RunPython(forward, backward)]
