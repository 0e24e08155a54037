-- Run once by the postgres container on an empty data directory (compose mounts this file in
-- /docker-entrypoint-initdb.d/). The schema owner (POSTGRES_USER, used for migrations) is not
-- the role the services connect as: steward_app owns nothing and has NOBYPASSRLS, so row-level
-- security applies to it. Change the password (and DATABASE_URL in compose.yaml) before use.
CREATE ROLE steward_app LOGIN PASSWORD 'steward_app' NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE;
GRANT CONNECT ON DATABASE steward TO steward_app;
GRANT USAGE ON SCHEMA public TO steward_app;
-- Tables and sequences created later by the owner's migrations.
ALTER DEFAULT PRIVILEGES FOR ROLE steward IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO steward_app;
ALTER DEFAULT PRIVILEGES FOR ROLE steward IN SCHEMA public
    GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO steward_app;
