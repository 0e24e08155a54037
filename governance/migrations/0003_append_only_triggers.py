"""Append-only audit log and rewards, enforced by PostgreSQL itself.

- governance_auditevent: UPDATE, DELETE and TRUNCATE are refused by triggers, and revoked from
  PUBLIC (the app role, a non-owner, is only ever granted SELECT and INSERT on it).
- governance_reward: UPDATE and TRUNCATE are refused; DELETE only inside a transaction that set
  `steward.allow_purge` = 'on' with set_config(..., true) (erasure and retention do, through
  governance.services.purge_allowed()).
- TRUNCATE passes only where `steward.allow_truncate` = 'on' — set on the *test* database
  (ALTER DATABASE ... SET, tests/conftest.py) so Django can flush it between transactional
  tests; production never sets it.

A superuser can still disable triggers (ALTER TABLE ... DISABLE TRIGGER, or
session_replication_role = replica): that is what the hash chain and verify_audit detect.
"""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION steward_auditevent_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' AND current_setting('steward.allow_truncate', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'governance_auditevent is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER auditevent_append_only
    BEFORE UPDATE OR DELETE ON governance_auditevent
    FOR EACH ROW EXECUTE FUNCTION steward_auditevent_append_only();
CREATE TRIGGER auditevent_no_truncate
    BEFORE TRUNCATE ON governance_auditevent
    FOR EACH STATEMENT EXECUTE FUNCTION steward_auditevent_append_only();

CREATE OR REPLACE FUNCTION steward_reward_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('steward.allow_purge', true) = 'on' THEN
        RETURN OLD;
    END IF;
    IF TG_OP = 'TRUNCATE' AND current_setting('steward.allow_truncate', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'governance_reward is append-only: % refused (a correction is a new row)',
        TG_OP USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER reward_append_only
    BEFORE UPDATE OR DELETE ON governance_reward
    FOR EACH ROW EXECUTE FUNCTION steward_reward_append_only();
CREATE TRIGGER reward_no_truncate
    BEFORE TRUNCATE ON governance_reward
    FOR EACH STATEMENT EXECUTE FUNCTION steward_reward_append_only();

REVOKE UPDATE, DELETE, TRUNCATE ON governance_auditevent FROM PUBLIC;
REVOKE UPDATE, TRUNCATE ON governance_reward FROM PUBLIC;
"""

REVERSE_SQL = r"""
DROP TRIGGER IF EXISTS auditevent_append_only ON governance_auditevent;
DROP TRIGGER IF EXISTS auditevent_no_truncate ON governance_auditevent;
DROP TRIGGER IF EXISTS reward_append_only ON governance_reward;
DROP TRIGGER IF EXISTS reward_no_truncate ON governance_reward;
DROP FUNCTION IF EXISTS steward_auditevent_append_only();
DROP FUNCTION IF EXISTS steward_reward_append_only();
"""


class Migration(migrations.Migration):
    dependencies = [("governance", "0002_datasets_retention")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
