"""The leakproof overlap operator of subject-index keys (decision 38, migration 0025; for 64-bit
keys, decision 40, migration 0031).

The services run under forced row-level security, where PostgreSQL uses a condition as an index
condition only if its function is LEAKPROOF; `&&` on arrays is not, so a subject lookup read the
whole subject index. `steward_keys_overlap` is the same C function (`arrayoverlap`) declared
LEAKPROOF for the keys' array type (equality of uuids or of bigints reveals nothing but its
answer), `&&&` its operator, and OPCLASS a GIN operator class with the built-in array support
functions whose strategy 1 is it. The keys are bigint[] since migration 0031 (OPCLASS); the
uuid[] class (UUID_OPCLASS) is what migrations 0025-0030 build, and stays for them.

Declaring LEAKPROOF and creating an operator class need a superuser. Migration 0025 runs
UUID_CREATE_SQL and 0031 INT8_CREATE_SQL when they migrate as one (tests, compose's
POSTGRES_USER); the embedded appliance's set-up runs CREATE_SQL (both, idempotent) as its
bootstrap superuser (config/embedded.py: its owner role is not one), and elsewhere a DBA runs
CREATE_SQL as a superuser before migrating. Each migration builds subjectindex_hashes with its
class whenever that class exists.
"""

OPCLASS = "steward_int8_keys_ops"
UUID_OPCLASS = "steward_uuid_keys_ops"

_CLASS_SQL = """
DO $do$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_opclass WHERE opcname = '{opclass}') THEN
        CREATE FUNCTION steward_keys_overlap({t}[], {t}[]) RETURNS boolean
            LANGUAGE internal IMMUTABLE STRICT PARALLEL SAFE LEAKPROOF AS 'arrayoverlap';
        CREATE OPERATOR &&& (LEFTARG = {t}[], RIGHTARG = {t}[],
            FUNCTION = steward_keys_overlap, COMMUTATOR = &&&, RESTRICT = contsel,
            JOIN = contjoinsel);
        CREATE OPERATOR CLASS {opclass} FOR TYPE {t}[] USING gin AS
            OPERATOR 1 &&& ({t}[], {t}[]),
            FUNCTION 1 {cmp}({t}, {t}),
            FUNCTION 2 ginarrayextract(anyarray, internal, internal),
            FUNCTION 3 ginqueryarrayextract(anyarray, internal, int2, internal, internal,
                                            internal, internal),
            FUNCTION 4 ginarrayconsistent(internal, int2, anyarray, int4, internal, internal,
                                          internal, internal),
            FUNCTION 6 ginarraytriconsistent(internal, int2, anyarray, int4, internal, internal,
                                             internal),
            STORAGE {t};
    END IF;
END $do$;
"""


def _drop_sql(opclass: str, t: str) -> list[str]:
    return [
        f"DROP OPERATOR CLASS IF EXISTS {opclass} USING gin",
        f"DROP OPERATOR FAMILY IF EXISTS {opclass} USING gin",
        f"DROP OPERATOR IF EXISTS &&& ({t}[], {t}[])",
        f"DROP FUNCTION IF EXISTS steward_keys_overlap({t}[], {t}[])",
    ]


UUID_CREATE_SQL = _CLASS_SQL.format(opclass=UUID_OPCLASS, t="uuid", cmp="uuid_cmp")
INT8_CREATE_SQL = _CLASS_SQL.format(opclass=OPCLASS, t="bigint", cmp="btint8cmp")
CREATE_SQL = UUID_CREATE_SQL + INT8_CREATE_SQL
UUID_DROP_SQL = _drop_sql(UUID_OPCLASS, "uuid")
INT8_DROP_SQL = _drop_sql(OPCLASS, "bigint")
