"""The Celery task gets a job id only; before any tenant is known, row-level security shows it
no job. This SECURITY DEFINER function (the pattern of governance migration 0004: one query,
`steward.system` on for its own duration only) maps a job id to its tenant id and nothing else;
the task then opens that tenant's scope (trainer.tasks)."""

from django.db import migrations

FORWARD = r"""
CREATE OR REPLACE FUNCTION steward_training_job_tenant(p_id bigint)
RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE prev text := coalesce(current_setting('steward.system', true), '');
DECLARE found bigint;
BEGIN
    PERFORM set_config('steward.system', 'on', true);
    SELECT j.tenant_id::bigint INTO found FROM public.trainer_trainingjob j WHERE j.id = p_id;
    PERFORM set_config('steward.system', prev, true);
    RETURN found;
END $$;
"""

REVERSE = "DROP FUNCTION IF EXISTS steward_training_job_tenant(bigint);"


class Migration(migrations.Migration):

    dependencies = [("trainer", "0001_initial")]

    operations = [migrations.RunSQL(FORWARD, REVERSE)]
