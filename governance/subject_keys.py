"""The leakproof overlap operator of subject-index keys (decision 38, migration 0025).

The services run under forced row-level security, where PostgreSQL uses a condition as an index
condition only if its function is LEAKPROOF; `&&` on arrays is not, so a subject lookup read the
whole subject index. `steward_keys_overlap` is the same C function (`arrayoverlap`) declared
LEAKPROOF for uuid[] (uuid equality reveals nothing but its answer), `&&&` its operator, and
OPCLASS a GIN operator class with the built-in array support functions whose strategy 1 is it.

Declaring LEAKPROOF and creating an operator class need a superuser. CREATE_SQL (idempotent)
is run by migration 0025 when it migrates as one (tests, compose's POSTGRES_USER) and by the
embedded appliance's set-up as its bootstrap superuser (config/embedded.py: its owner role is
not one). Elsewhere a DBA runs it as a superuser before migrating. The migration builds
subjectindex_hashes with OPCLASS whenever OPCLASS exists.
"""

OPCLASS = "steward_uuid_keys_ops"

CREATE_SQL = f"""
DO $do$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_opclass WHERE opcname = '{OPCLASS}') THEN
        CREATE FUNCTION steward_keys_overlap(uuid[], uuid[]) RETURNS boolean
            LANGUAGE internal IMMUTABLE STRICT PARALLEL SAFE LEAKPROOF AS 'arrayoverlap';
        CREATE OPERATOR &&& (LEFTARG = uuid[], RIGHTARG = uuid[],
            FUNCTION = steward_keys_overlap, COMMUTATOR = &&&, RESTRICT = contsel,
            JOIN = contjoinsel);
        CREATE OPERATOR CLASS {OPCLASS} FOR TYPE uuid[] USING gin AS
            OPERATOR 1 &&& (uuid[], uuid[]),
            FUNCTION 1 uuid_cmp(uuid, uuid),
            FUNCTION 2 ginarrayextract(anyarray, internal, internal),
            FUNCTION 3 ginqueryarrayextract(anyarray, internal, int2, internal, internal,
                                            internal, internal),
            FUNCTION 4 ginarrayconsistent(internal, int2, anyarray, int4, internal, internal,
                                          internal, internal),
            FUNCTION 6 ginarraytriconsistent(internal, int2, anyarray, int4, internal, internal,
                                             internal),
            STORAGE uuid;
    END IF;
END $do$;
"""

DROP_SQL = [
    f"DROP OPERATOR CLASS IF EXISTS {OPCLASS} USING gin",
    f"DROP OPERATOR FAMILY IF EXISTS {OPCLASS} USING gin",
    "DROP OPERATOR IF EXISTS &&& (uuid[], uuid[])",
    "DROP FUNCTION IF EXISTS steward_keys_overlap(uuid[], uuid[])",
]
