"""Labels are part of what is approved (issue 12, item 13): a frozen dataset version pins the
rewards naming its members as of the freeze — their ids and values are in its content hash —,
training reads only those, and a reward posted later takes a new version. Reward comments
(free text, and the reference answers training reads) are sanitized like captured text.

Real services, the real step/reward tables, the real training task (run in-process on the CPU,
as the `gpu` queue's worker runs it) and the real sanitizer (spaCy + Presidio)."""

from __future__ import annotations

import json

import pytest
from django.db import connection

from governance import services as gov
from governance.datasets import content_hash, version_content_hash
from governance.models import Reward, Step
from governance.tenancy import tenant_context
from tests.test_training_jobs import TINY, make_version, var_dir  # noqa: F401 - fixture
from trainer import services
from trainer.models import TrainingJob
from trainer.taskdata import iter_examples
from trainer.tasks import run_training_job


def references(version) -> dict[str, dict | None]:
    with tenant_context(version.tenant_id):
        return {e.trajectory_id: e.reference for e in iter_examples(version)}


def test_a_reference_posted_after_approval_is_not_trained_on(tenant, people, var_dir):  # noqa: F811
    users, _ = people
    version, trajs = make_version(tenant, people)
    first = str(trajs[0].pk)
    before = references(version)
    assert before[first] == {"answer": 0}  # 0+0, the reference recorded before the freeze

    # After the approval someone posts a different reference answer for a member.
    gov.record_reward(users["steward"], tenant, value=1.0, trajectory_id=trajs[0].pk,
                      name="reference", comment="777")
    # The approved version is unchanged: same hash, same labels; it still trains.
    assert version_content_hash(version)[0] == version.content_hash
    assert references(version) == before
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    assert run_training_job(job.pk) == "completed"

    # Training on the new label takes a new version (and a new approval).
    again = gov.freeze_dataset_version(users["steward"], version.dataset)
    assert again.content_hash != version.content_hash
    assert references(again)[first] == {"answer": 777}


def test_pinned_rewards_are_in_the_content_hash(tenant, people, var_dir):  # noqa: F811
    users, _ = people
    version, trajs = make_version(tenant, people)
    members = [t.pk for t in trajs]
    steps = Step.objects.filter(trajectory__in=members).values_list(
        "trajectory_id", "id", "sanitizer_version")
    from governance.datasets import reward_row

    pinned = [reward_row(*r) for r in Reward.objects.filter(trajectory_id__in=members)
              .values_list("id", "trajectory_id", "response_id", "name", "value", "final",
                           "comment")]
    assert len(pinned) == 2 * len(trajs) - 1  # a reference and a provisional one each
    assert version.content_hash == content_hash(members, steps, pinned)
    assert version.content_hash != content_hash(members, steps)

    # A superuser rewrites a pinned label behind the trigger's back: the version no longer
    # matches what was approved, and the training task refuses it.
    job = services.launch_training_job(users["steward"], tenant, version, config=TINY)
    reward = Reward.objects.get(trajectory_id=trajs[1].pk, name="reference", final=True)
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cur.execute("ALTER TABLE governance_reward DISABLE TRIGGER reward_append_only")
        cur.execute("UPDATE governance_reward SET comment = '{\"answer\": 1}' WHERE id = %s",
                    [reward.pk])
        cur.execute("ALTER TABLE governance_reward ENABLE TRIGGER reward_append_only")
    assert run_training_job(job.pk) == "refused"
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.REFUSED and "content hash" in job.error


def test_approval_refuses_a_version_whose_labels_changed(tenant, people, var_dir):  # noqa: F811
    users, _ = people
    version, trajs = make_version(tenant, people, decide="pending")
    with gov.purge_allowed():  # as only erasure and retention may (which also invalidate)
        Reward.objects.filter(trajectory_id=trajs[2].pk).delete()
    with pytest.raises(gov.ServiceConflict, match="content changed"):
        gov.approve_version(users["compliance"], version, "looks fine")


PII_COMMENT = "Confirmed by Maria Lopez, maria.lopez@example.com, SSN 123-45-6789."


def test_reward_comments_are_sanitized_before_they_are_stored(tenant, people):
    users, clients = people
    r = clients["steward"].post("/api/v1/rewards/", {
        "response_id": "chatcmpl-1", "value": 1, "comment": PII_COMMENT}, format="json")
    assert r.status_code == 201, r.content
    stored = Reward.objects.get(pk=r.json()["id"]).comment
    for raw in ("maria.lopez@example.com", "123-45-6789", "Maria Lopez"):
        assert raw not in stored and raw not in r.json()["comment"], stored
    assert "<EMAIL_ADDRESS" in stored and "<US_SSN" in stored and "Confirmed by" in stored

    # A JSON reference stays JSON, its text sanitized, its numbers as they were.
    reference = {"answer": "write to maria.lopez@example.com", "tolerance": 0.5}
    reward = gov.record_reward(users["steward"], tenant, value=1.0, response_id="chatcmpl-2",
                               name="reference", comment=json.dumps(reference))
    parsed = json.loads(Reward.objects.get(pk=reward.pk).comment)
    assert parsed["tolerance"] == 0.5 and "maria" not in parsed["answer"]
    assert parsed["answer"].startswith("write to <EMAIL_ADDRESS")
    # Nothing to sanitize: stored as given (no NER run for an empty comment).
    plain = gov.record_reward(users["steward"], tenant, value=0.0, response_id="chatcmpl-3")
    assert Reward.objects.get(pk=plain.pk).comment == ""


def test_the_review_page_shows_how_many_labels_are_pinned(client, tenant, people, var_dir):  # noqa: F811
    users, _ = people
    version, trajs = make_version(tenant, people, decide="pending")
    gov.record_reward(users["steward"], tenant, value=1.0, trajectory_id=trajs[0].pk,
                      name="reference", comment="after the freeze")
    client.force_login(users["compliance2"])
    body = client.get(f"/approvals/{version.pk}/").content.decode()
    # make_version records a reference and a provisional row per trajectory (one has none).
    assert f"<dt>Rewards</dt><dd>{2 * len(trajs) - 1} " in body

