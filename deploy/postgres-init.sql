-- Run once by the postgres container on an empty data directory (compose mounts this file in
-- /docker-entrypoint-initdb.d/). The schema owner (POSTGRES_USER `steward`, used for migrations:
-- DATABASE_OWNER_URL, or DATABASE_URL of the one-shot migrate service) is not the role the
-- services connect as: steward_app owns nothing and has NOBYPASSRLS, so the row-level security
-- of every tenant table (ENABLEd and FORCEd by migration 0004) applies to it. Change the
-- password (and DATABASE_URL in compose.yaml) before use. config/embedded.py creates the same
-- two roles (steward_owner, steward_app) for the embedded appliance.
CREATE ROLE steward_app LOGIN PASSWORD 'steward_app' NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE;
GRANT CONNECT ON DATABASE steward TO steward_app;
GRANT USAGE ON SCHEMA public TO steward_app;
-- Tables and sequences created later by the owner's migrations. The append-only audit log keeps
-- SELECT and INSERT only: migration 0004 revokes UPDATE, DELETE and TRUNCATE on it from every
-- role but the owner. (`manage.py migrate` run with DATABASE_OWNER_URL also re-grants exactly
-- governance.tenancy.grant_app_privileges after each migration.)
ALTER DEFAULT PRIVILEGES FOR ROLE steward IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO steward_app;
ALTER DEFAULT PRIVILEGES FOR ROLE steward IN SCHEMA public
    GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO steward_app;
