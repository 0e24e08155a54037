"""Row-level security: the second tenancy wall (see governance/tenancy.py).

1. Every table with a foreign key to Tenant — found from the models at this point of the
   migration history, so none is forgotten — gets RLS ENABLEd and FORCEd (the owner is subject
   to it too) and the policy `tenant_isolation`: its rows are visible and writable only where
   `steward.tenant_id` (set per transaction) names their tenant, or in the explicit system
   context (`steward.system` = 'on'). With neither set, nothing is visible. Audit events without
   a tenant are visible to the system context only. A table added later needs the same in its
   own migration (governance.tenancy.tenant_rls_sql); tests/test_rls.py fails until it has it.
2. SECURITY DEFINER functions for the few lookups that must cross tenants before a tenant is
   known. Each runs its one query with `steward.system` switched on for its own duration only
   (plpgsql saves and restores it: PostgreSQL 15+ refuses placeholder settings in a function's
   SET clause for non-superuser owners). Only the columns each caller needs come out.
3. The append-only audit log: UPDATE/DELETE/TRUNCATE revoked from every role but the owner
   (e.g. from privileges granted by ALTER DEFAULT PRIVILEGES in deploy/postgres-init.sql).
"""

from django.db import migrations

from governance.tenancy import tenant_rls_sql

FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION steward_proxy_keys()
RETURNS TABLE (key_id bigint, key_hash text, tenant_id bigint, tenant_slug text,
               agent_id bigint, agent_name text, revoked boolean, updated_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    RETURN QUERY
        SELECT k.id::bigint, k.key_hash::text, k.tenant_id::bigint, t.slug::text,
               k.agent_id::bigint, a.name::text, k.revoked_at IS NOT NULL, k.updated_at
        FROM public.governance_proxykey k
        JOIN public.governance_agent a ON a.id = k.agent_id
        JOIN public.governance_tenant t ON t.id = k.tenant_id;
    PERFORM set_config('steward.system', prev, true);
END $$;

-- The proxy's cheap change probe (polled every STEWARD_KEY_REFRESH_SECONDS).
CREATE OR REPLACE FUNCTION steward_proxy_keys_version()
RETURNS TABLE (key_count bigint, max_updated_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    RETURN QUERY SELECT count(*)::bigint, max(k.updated_at) FROM public.governance_proxykey k;
    PERFORM set_config('steward.system', prev, true);
END $$;

CREATE OR REPLACE FUNCTION steward_api_token_lookup(p_key_hash text)
RETURNS TABLE (token_id bigint, tenant_id bigint, user_id bigint, revoked boolean)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    RETURN QUERY
        SELECT k.id::bigint, k.tenant_id::bigint, k.user_id::bigint, k.revoked_at IS NOT NULL
        FROM public.governance_apitoken k WHERE k.key_hash = p_key_hash;
    PERFORM set_config('steward.system', prev, true);
END $$;

CREATE OR REPLACE FUNCTION steward_user_memberships(p_user_id bigint)
RETURNS TABLE (membership_id bigint, user_id bigint, tenant_id bigint, role text,
               created_at timestamptz, tenant_slug text, tenant_name text,
               tenant_created_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    RETURN QUERY
        SELECT m.id::bigint, m.user_id::bigint, m.tenant_id::bigint, m.role::text,
               m.created_at, t.slug::text, t.name::text, t.created_at
        FROM public.governance_membership m
        JOIN public.governance_tenant t ON t.id = m.tenant_id
        WHERE m.user_id = p_user_id
        ORDER BY t.slug;
    PERFORM set_config('steward.system', prev, true);
END $$;

CREATE OR REPLACE FUNCTION steward_audit_head()
RETURNS TABLE (seq bigint, hash text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    RETURN QUERY
        SELECT e.seq::bigint, e.hash::text FROM public.governance_auditevent e
        ORDER BY e.seq DESC LIMIT 1;
    PERFORM set_config('steward.system', prev, true);
END $$;

CREATE OR REPLACE FUNCTION steward_interaction_tenants(p_ids bigint[])
RETURNS TABLE (id bigint, tenant_id bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
#variable_conflict use_column
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    RETURN QUERY
        SELECT i.id::bigint, i.tenant_id::bigint FROM public.governance_interaction i
        WHERE i.id = ANY (p_ids);
    PERFORM set_config('steward.system', prev, true);
END $$;

DO $$
DECLARE r record;
BEGIN
    FOR r IN
        SELECT DISTINCT pg_get_userbyid(a.grantee) AS grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'public.governance_auditevent'::regclass
          AND a.grantee <> 0 AND a.grantee <> c.relowner
          AND a.privilege_type IN ('UPDATE', 'DELETE', 'TRUNCATE')
    LOOP
        EXECUTE format('REVOKE UPDATE, DELETE, TRUNCATE ON public.governance_auditevent FROM %I',
                       r.grantee);
    END LOOP;
END $$;
"""

REVERSE_FUNCTIONS = r"""
DROP FUNCTION IF EXISTS steward_proxy_keys();
DROP FUNCTION IF EXISTS steward_proxy_keys_version();
DROP FUNCTION IF EXISTS steward_api_token_lookup(text);
DROP FUNCTION IF EXISTS steward_user_memberships(bigint);
DROP FUNCTION IF EXISTS steward_audit_head();
DROP FUNCTION IF EXISTS steward_interaction_tenants(bigint[]);
"""


def tenant_tables(apps) -> list[str]:
    """The tables of every model (at this migration) with a foreign key to Tenant."""
    tables = []
    for model in apps.get_models():
        for field in model._meta.concrete_fields:
            related = getattr(field, "related_model", None)
            if field.many_to_one and related is not None \
                    and related._meta.label_lower == "governance.tenant":
                tables.append(model._meta.db_table)
                break
    return sorted(set(tables))


def enable(apps, schema_editor) -> None:
    for table in tenant_tables(apps):
        schema_editor.execute(tenant_rls_sql(table)[0])


def disable(apps, schema_editor) -> None:
    for table in tenant_tables(apps):
        schema_editor.execute(tenant_rls_sql(table)[1])


class Migration(migrations.Migration):
    dependencies = [("governance", "0003_append_only_triggers")]

    operations = [
        migrations.RunPython(enable, disable),
        migrations.RunSQL(FUNCTIONS, REVERSE_FUNCTIONS),
    ]
