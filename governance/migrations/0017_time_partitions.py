"""Time partitions (issue 16 item 4, docs/decisions.md 33): interactions, steps and findings
become tables range-partitioned by month on their time column, so that retention can drop a
whole month instead of deleting it row by row.

Forward, per table: the plain table is renamed away, a partitioned one is created LIKE it
(defaults, identity, checks), a partition per month from the oldest row (at most 24 months
back; older rows go to the DEFAULT partition) to two months ahead plus the DEFAULT partition
are created by `steward_ensure_partitions` (below, also called by the beat task
governance.tasks.ensure_partitions), the rows are copied, the old table dropped, and then the
keys, indexes, outgoing foreign keys and row-level security are put back:

- the primary key and every unique constraint include the partition key (PostgreSQL requires
  it): (id, started_at), flow_id and step_id with started_at, a step's interaction with its
  started_at (a step has its interaction's started_at by construction). The guarantee the
  single-column uniques gave across partitions is kept by the trigger
  `steward_interaction_unique` (a flow id or step id already stored with another started_at
  is refused; same started_at: the composite unique, so the shipper's ON CONFLICT DO NOTHING
  still makes a re-shipped record a no-op);
- no foreign key points into the partitioned tables any more (findings and subject-index rows
  to steps and interactions, steps to interactions): Django's collector still cascades on every
  ORM delete, erasure deletes dependents explicitly, and retention's partition drop deletes
  what outside the dropped months depends on them (governance/partitions.py);
- findings lose `interaction_id` (always its step's interaction) and the indexes nothing
  queries (findings are read through their step): tenant_id, (tenant_id, entity_type),
  (tenant_id, created_at), and item_id over every row (now partial: only history-message
  findings have one).

Reverse turns them back into plain tables with the old keys, unique constraints, foreign keys
(Django's names, from the 0016 state) and indexes, and findings get `interaction_id` back from
their steps.
"""

from __future__ import annotations

from django.db import migrations, models

from governance.tenancy import TENANT_RLS_EXPR, tenant_rls_sql

# table -> partition key column
TABLES = {
    "governance_interaction": "started_at",
    "governance_step": "started_at",
    "governance_finding": "created_at",
}
# Unique constraints of the plain tables, by column; partitioned: (column, partition key).
UNIQUES = {
    "governance_interaction": ["flow_id", "step_id"],
    "governance_step": ["interaction_id"],
}
# Indexes of the plain findings table that the partitioned one does without: Django's on
# tenant_id, item_id (now partial) and interaction_id (column dropped), and two nothing reads
# (findings are read through their step).
FINDING_DROPPED_INDEX_COLUMNS = {"tenant_id", "item_id", "interaction_id"}
FINDING_DROPPED_INDEXES = {
    "finding_tenant_entity": "(tenant_id, entity_type)",
    "finding_tenant_created": "(tenant_id, created_at)",
}
FINDING_ITEM_INDEX = "finding_item"
MONTHS_BACK_MAX = 24
MONTHS_AHEAD = 3  # the current month and the next two


FUNCTIONS = r"""
-- Monthly partitions of the three time-partitioned tables for `p_months` months from the
-- month of `p_first` (UTC bounds), each behind the tenant policy. A month whose rows already
-- landed in the DEFAULT partition (clock skew, a beat that did not run) gets its partition
-- anyway: those rows are moved into it before it is attached. Owner's rights: the app role
-- owns no table. Idempotent.
CREATE OR REPLACE FUNCTION steward_ensure_partitions(p_first date, p_months integer)
RETURNS TABLE (partition_name text, moved_rows bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_variable
DECLARE
    prev text := coalesce(current_setting('steward.system', true), '');
    tables text[] := ARRAY['governance_interaction', 'governance_step', 'governance_finding'];
    keys text[] := ARRAY['started_at', 'started_at', 'created_at'];
    m date; lo timestamptz; hi timestamptz; name text; moved bigint; i integer; k integer;
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    FOR i IN 0 .. p_months - 1 LOOP
        m := (date_trunc('month', p_first::timestamp) + make_interval(months => i))::date;
        lo := m::timestamp AT TIME ZONE 'UTC';
        hi := (m + interval '1 month')::timestamp AT TIME ZONE 'UTC';
        FOR k IN 1 .. array_length(tables, 1) LOOP
            name := tables[k] || '_p' || to_char(m, 'YYYY_MM');
            CONTINUE WHEN to_regclass('public.' || quote_ident(name)) IS NOT NULL;
            moved := 0;
            IF to_regclass('public.' || quote_ident(tables[k] || '_default')) IS NOT NULL THEN
                EXECUTE format('SELECT count(*) FROM public.%I WHERE %I >= $1 AND %I < $2',
                               tables[k] || '_default', keys[k], keys[k])
                    INTO moved USING lo, hi;
            END IF;
            IF moved > 0 THEN
                -- PostgreSQL refuses a partition overlapping rows of the DEFAULT one: build
                -- the month as a plain table, move the rows over, then attach it.
                EXECUTE format('CREATE TABLE public.%I (LIKE public.%I '
                               'INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', name, tables[k]);
                EXECUTE format('WITH gone AS (DELETE FROM public.%I WHERE %I >= $1 AND %I < $2 '
                               'RETURNING *) INSERT INTO public.%I SELECT * FROM gone',
                               tables[k] || '_default', keys[k], keys[k], name) USING lo, hi;
                EXECUTE format('ALTER TABLE public.%I ATTACH PARTITION public.%I '
                               'FOR VALUES FROM (%L) TO (%L)', tables[k], name, lo, hi);
            ELSE
                EXECUTE format('CREATE TABLE public.%I PARTITION OF public.%I '
                               'FOR VALUES FROM (%L) TO (%L)', name, tables[k], lo, hi);
            END IF;
            EXECUTE format('ALTER TABLE public.%I ENABLE ROW LEVEL SECURITY', name);
            EXECUTE format('ALTER TABLE public.%I FORCE ROW LEVEL SECURITY', name);
            EXECUTE format('CREATE POLICY tenant_isolation ON public.%I USING (%s) WITH CHECK (%s)',
                           name, %(rls)L, %(rls)L);
            partition_name := name;
            moved_rows := moved;
            RETURN NEXT;
        END LOOP;
    END LOOP;
    PERFORM set_config('steward.system', prev, true);
END $$;

-- Detach and drop one monthly partition of the three tables (retention, after it checked
-- that every row in it is past its deadline and dealt with what depends on them). Refuses
-- anything else: another table, the DEFAULT partition, a month not yet over.
CREATE OR REPLACE FUNCTION steward_drop_partition(p_partition text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE parent text; month date;
BEGIN
    SELECT p.relname INTO parent FROM pg_inherits h
        JOIN pg_class c ON c.oid = h.inhrelid JOIN pg_class p ON p.oid = h.inhparent
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relname = p_partition;
    IF parent IS NULL OR parent NOT IN ('governance_interaction', 'governance_step',
                                        'governance_finding')
            OR p_partition !~ ('^' || parent || '_p[0-9]{4}_[0-9]{2}$') THEN
        RAISE EXCEPTION 'not a monthly partition of a time-partitioned table: %', p_partition
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    month := to_date(right(p_partition, 7), 'YYYY_MM');
    IF (month + interval '1 month')::timestamp AT TIME ZONE 'UTC' > now() THEN
        RAISE EXCEPTION 'partition % is not over yet', p_partition
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    EXECUTE format('ALTER TABLE public.%I DETACH PARTITION public.%I', parent, p_partition);
    EXECUTE format('DROP TABLE public.%I', p_partition);
    RETURN true;
END $$;

-- Flow ids and step ids are unique across all partitions. The composite unique constraints
-- cover rows with the same started_at (so ON CONFLICT DO NOTHING keeps re-shipping a no-op);
-- this refuses one already stored with another started_at. The advisory lock serializes
-- concurrent inserts, so the check sees the other's committed row.
CREATE OR REPLACE FUNCTION steward_interaction_unique() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
        step_clash boolean; flow_clash boolean;
BEGIN
    -- One lock for every insert (re-taking it costs no lock-table slot, where one per id
    -- would use two per row of a 500-record batch). It adds little serialization: a shipping
    -- transaction takes the audit chain's lock right after its insert anyway.
    PERFORM pg_advisory_xact_lock(hashtextextended('steward.interaction_ids', 0));
    PERFORM set_config('steward.system', 'on', true);
    SELECT EXISTS (SELECT 1 FROM public.governance_interaction i
                   WHERE i.step_id = NEW.step_id AND i.started_at <> NEW.started_at),
           EXISTS (SELECT 1 FROM public.governance_interaction i
                   WHERE i.flow_id = NEW.flow_id AND i.started_at <> NEW.started_at)
        INTO step_clash, flow_clash;
    PERFORM set_config('steward.system', prev, true);
    -- Named as the unique constraint it extends across partitions.
    IF step_clash THEN
        RAISE EXCEPTION 'step id already stored by another interaction'
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'governance_interaction_step_id_key';
    END IF;
    IF flow_clash THEN
        RAISE EXCEPTION 'flow id already stored with another started_at'
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'governance_interaction_flow_id_key';
    END IF;
    RETURN NEW;
END $$;
""".replace("%(rls)L", "'" + TENANT_RLS_EXPR.replace("'", "''") + "'")

REVERSE_FUNCTIONS = r"""
DROP FUNCTION IF EXISTS steward_ensure_partitions(date, integer);
DROP FUNCTION IF EXISTS steward_drop_partition(text);
DROP FUNCTION IF EXISTS steward_interaction_unique() CASCADE;
"""

TRIGGER = """
CREATE TRIGGER interaction_unique BEFORE INSERT ON governance_interaction
    FOR EACH ROW EXECUTE FUNCTION steward_interaction_unique();
"""


def _fetch(cursor, sql: str, params: list | None = None) -> list[tuple]:
    cursor.execute(sql, params or [])
    return cursor.fetchall()


def _indexes(cursor, table: str) -> list[tuple[str, str]]:
    """(name, definition) of the table's indexes that back no constraint."""
    return _fetch(cursor, (
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
        "AND tablename = %s AND indexname NOT IN "
        "(SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass)"), [table, table])


def _outgoing_fks(cursor, table: str) -> list[tuple[str, str]]:
    """(name, definition) of the foreign keys from the table to tables not partitioned here."""
    return _fetch(cursor, (
        "SELECT c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c "
        "JOIN pg_class r ON r.oid = c.confrelid "
        "WHERE c.conrelid = %s::regclass AND c.contype = 'f' AND NOT (r.relname = ANY(%s))"),
        [table, list(TABLES)])


def _rename_sequence(schema_editor, table: str) -> None:
    """The identity sequence LIKE made for the new table, named as Django's was."""
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
        seq = cur.fetchone()[0]
    if seq and seq.split(".")[-1].strip('"') != f"{table}_id_seq":
        schema_editor.execute(f'ALTER SEQUENCE {seq} RENAME TO "{table}_id_seq"')


def _restart_identity(schema_editor, table: str) -> None:
    with schema_editor.connection.cursor() as cur:
        cur.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
        seq = cur.fetchone()[0]
    if seq:
        schema_editor.execute(
            f"SELECT setval('{seq}', coalesce((SELECT max(id) FROM {table}), 0) + 1, false)")


def _grants(cursor, table: str) -> list[tuple[str, str]]:
    """(grantee, privilege) granted on the table to roles other than its owner: the new table
    gets the same (the app role's, between two `grant_app_privileges`)."""
    return _fetch(cursor, (
        "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END, "
        "a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
        "LEFT JOIN pg_roles r ON r.oid = a.grantee "
        "WHERE c.oid = %s::regclass AND a.grantee <> c.relowner"), [table])


def _columns(cursor, table: str) -> list[str]:
    return [r[0] for r in _fetch(cursor, (
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
        "AND NOT attisdropped ORDER BY attnum"), [table])]


def _catalog(cur) -> tuple[dict, dict, dict]:
    """What the tables carry before they are replaced: indexes, outgoing foreign keys, grants."""
    return ({t: _indexes(cur, t) for t in TABLES}, {t: _outgoing_fks(cur, t) for t in TABLES},
            {t: _grants(cur, t) for t in TABLES})


# The owner that migrates is subject to the tables' FORCEd row-level security (it is neither
# superuser nor BYPASSRLS: config/embedded.py, deploy/postgres-init.sql): without the system
# context for this transaction, copying would read no row and the old tables would be dropped.
SYSTEM_SCOPE = "SELECT set_config('steward.system', 'on', true)"


def forward(apps, schema_editor) -> None:
    run = schema_editor.execute
    run(SYSTEM_SCOPE)
    with schema_editor.connection.cursor() as cur:
        indexes, fks, grants = _catalog(cur)
        oldest = _fetch(cur, " UNION ALL ".join(
            f"SELECT min({key}) FROM {table}" for table, key in TABLES.items()))  # noqa: S608
        cur.execute("SELECT date_trunc('month', now() AT TIME ZONE 'UTC')::date")
        this_month = cur.fetchone()[0]
    first = min([r[0] for r in oldest if r[0] is not None], default=None)
    months = MONTHS_AHEAD
    if first is not None:
        back = (this_month.year - first.year) * 12 + this_month.month - first.month
        back = min(max(back, 0), MONTHS_BACK_MAX)
        months += back
    else:
        back = 0
    start = f"(date '{this_month.isoformat()}' - interval '{back} months')::date"

    for table, key in TABLES.items():
        run(f"ALTER TABLE {table} RENAME TO {table}_old")
        run(f"CREATE TABLE {table} (LIKE {table}_old INCLUDING DEFAULTS INCLUDING IDENTITY "
            f"INCLUDING CONSTRAINTS) PARTITION BY RANGE ({key})")
    # Always its step's interaction: not worth 8 bytes and an index per finding.
    run("ALTER TABLE governance_finding DROP COLUMN interaction_id")
    for table in TABLES:
        run(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
    run(f"SELECT count(*) FROM steward_ensure_partitions({start}, {months})")
    with schema_editor.connection.cursor() as cur:
        columns = {t: _columns(cur, t) for t in TABLES}
    for table in TABLES:
        cols = ", ".join(f'"{c}"' for c in columns[table])
        run(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {table}_old")  # noqa: S608
    run("DROP TABLE " + ", ".join(f"{t}_old" for t in TABLES) + " CASCADE")

    for table, key in TABLES.items():
        _rename_sequence(schema_editor, table)
        _restart_identity(schema_editor, table)
        run(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id, {key})")
        for col in UNIQUES.get(table, []):
            run(f"ALTER TABLE {table} ADD CONSTRAINT {table}_{col}_key UNIQUE ({col}, {key})")
        for name, definition in indexes[table]:
            if table == "governance_finding" and (name in FINDING_DROPPED_INDEXES or any(
                    definition.endswith(f"btree ({c})") for c in FINDING_DROPPED_INDEX_COLUMNS)):
                continue
            # The same definition on the partitioned table: every partition gets it.
            run(definition)
        for name, definition in fks[table]:
            if table == "governance_finding" and "(interaction_id)" in definition:
                continue
            run(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition}")
        for sql in tenant_rls_sql(table)[0].split(";\n"):
            run(sql)
        for grantee, privilege in grants[table]:
            run(f"GRANT {privilege} ON {table} TO {grantee}")
        for sql in tenant_rls_sql(f"{table}_default")[0].split(";\n"):
            run(sql)
    run(f"CREATE INDEX {FINDING_ITEM_INDEX} ON governance_finding (item_id) "
        "WHERE item_id IS NOT NULL")
    run(TRIGGER)


def reverse(apps, schema_editor) -> None:
    run = schema_editor.execute
    run(SYSTEM_SCOPE)
    with schema_editor.connection.cursor() as cur:
        indexes, fks, grants = _catalog(cur)
    for table in TABLES:
        run(f"ALTER TABLE {table} RENAME TO {table}_part")
        run(f"CREATE TABLE {table} (LIKE {table}_part INCLUDING DEFAULTS INCLUDING IDENTITY "
            "INCLUDING CONSTRAINTS)")
    with schema_editor.connection.cursor() as cur:
        columns = {t: _columns(cur, t) for t in TABLES}
    for table in TABLES:
        cols = ", ".join(f'"{c}"' for c in columns[table])
        run(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {table}_part")  # noqa: S608
    run("ALTER TABLE governance_finding ADD COLUMN interaction_id bigint NULL")
    run("UPDATE governance_finding f SET interaction_id = s.interaction_id "
        "FROM governance_step s WHERE s.id = f.step_id")
    run("DROP TABLE " + ", ".join(f"{t}_part" for t in TABLES) + " CASCADE")

    for table in TABLES:
        _rename_sequence(schema_editor, table)
        _restart_identity(schema_editor, table)
        run(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id)")
        for col in UNIQUES.get(table, []):
            run(f"ALTER TABLE {table} ADD CONSTRAINT {table}_{col}_key UNIQUE ({col})")
        for name, definition in indexes[table]:
            if name == FINDING_ITEM_INDEX:
                continue
            run(definition.replace(" ON ONLY ", " ON "))
        for name, definition in fks[table]:
            run(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition}")
        for sql in tenant_rls_sql(table)[0].split(";\n"):
            run(sql)
        for grantee, privilege in grants[table]:
            run(f"GRANT {privilege} ON {table} TO {grantee}")
    # Django's own names (the 0016 state) for what the plain findings table had, and the
    # foreign keys into steps and interactions.
    for name, columns in FINDING_DROPPED_INDEXES.items():
        run(f"CREATE INDEX {name} ON governance_finding {columns}")
    finding = apps.get_model("governance", "Finding")
    for field_name in ("tenant", "item", "interaction"):
        field = finding._meta.get_field(field_name)
        run(schema_editor._create_index_sql(finding, fields=[field]))
    for model_name, field_name in (("Step", "interaction"), ("Finding", "step"),
                                   ("Finding", "interaction"), ("SubjectIndex", "step"),
                                   ("SubjectIndex", "interaction")):
        model = apps.get_model("governance", model_name)
        field = model._meta.get_field(field_name)
        run(schema_editor._create_fk_sql(model, field, "_fk_%(to_table)s_%(to_column)s"))


class Migration(migrations.Migration):
    atomic = True

    dependencies = [("governance", "0016_raw_request_deltas")]

    operations = [
        migrations.RunSQL(FUNCTIONS, REVERSE_FUNCTIONS),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forward, reverse)],
            state_operations=[
                migrations.RemoveField(model_name="finding", name="interaction"),
                *(migrations.RemoveIndex(model_name="finding", name=name)
                  for name in FINDING_DROPPED_INDEXES),
                migrations.AlterField(
                    model_name="finding", name="tenant",
                    field=models.ForeignKey(db_index=False, on_delete=models.deletion.CASCADE,
                                            related_name="findings", to="governance.tenant")),
                migrations.AlterField(
                    model_name="finding", name="step",
                    field=models.ForeignKey(db_constraint=False,
                                            on_delete=models.deletion.CASCADE,
                                            related_name="findings", to="governance.step")),
                migrations.AlterField(
                    model_name="finding", name="item",
                    field=models.ForeignKey(blank=True, db_index=False, null=True,
                                            on_delete=models.deletion.CASCADE,
                                            related_name="findings",
                                            to="governance.conversationitem")),
                migrations.AddIndex(
                    model_name="finding",
                    index=models.Index(condition=models.Q(item__isnull=False),
                                       fields=["item"], name=FINDING_ITEM_INDEX)),
                migrations.AlterField(
                    model_name="step", name="interaction",
                    field=models.OneToOneField(db_constraint=False, null=True,
                                               on_delete=models.deletion.SET_NULL,
                                               related_name="step",
                                               to="governance.interaction")),
                *(migrations.AlterField(
                    model_name="subjectindex", name=name,
                    field=models.ForeignKey(blank=True, db_constraint=False, null=True,
                                            on_delete=models.deletion.CASCADE,
                                            related_name="subject_index",
                                            to=f"governance.{name}"))
                  for name in ("step", "interaction")),
            ],
        ),
    ]
