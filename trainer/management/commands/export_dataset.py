"""`python manage.py export_dataset --version ID --format {verl-rl,verl-sft,atdp-jsonl} --out PATH`

Writes an export of an approved, non-invalidated dataset version (trainer/exports.py describes
the formats), audited like the REST export; refuses any other version with a clear error and
exit code 1. The summary (rows, skipped members, sha256) is the last line, as JSON. --tenant
narrows the lookup of the version (ids are unique across tenants either way).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from governance.management.commands._common import CLI_ACTOR, get_tenant
from governance.models import DatasetVersion, Tenant
from governance.services import ServiceError
from governance.tenancy import tenant_context
from trainer.exports import FORMATS


def find_version(version_id: int, tenant_slug: str | None) -> DatasetVersion:
    """The version in whichever tenant holds it: each tenant's scope in turn (row-level
    security shows a version only to its own tenant)."""
    tenants = [get_tenant(tenant_slug)] if tenant_slug else list(Tenant.objects.order_by("pk"))
    for tenant in tenants:
        with tenant_context(tenant):
            version = DatasetVersion.objects.filter(pk=version_id).first()
        if version is not None:
            return version
    raise CommandError(f"unknown dataset version {version_id}")


class Command(BaseCommand):
    help = "Export an approved dataset version as verl RL/SFT parquet or ATDP JSONL."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        # `--version` is the dataset version here (the interface DESIGN.md fixes), not
        # Django's "print the Django version" flag: the later definition wins.
        kwargs.setdefault("conflict_handler", "resolve")
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--version", dest="version_id", type=int, required=True,
                            help="dataset version id")
        parser.add_argument("--format", dest="fmt", choices=FORMATS, required=True)
        parser.add_argument("--out", required=True, help="output file path")
        parser.add_argument("--tenant", default=None, help="tenant slug (optional)")
        parser.add_argument("--reference-reward", default="reference",
                            help="reward name carrying the ground truth (verl-rl)")

    def handle(self, *args: Any, **opts: Any) -> None:
        from trainer.services import export_dataset_version

        version = find_version(opts["version_id"], opts["tenant"])
        try:
            summary = export_dataset_version(CLI_ACTOR, version, opts["fmt"], opts["out"],
                                             reference_reward=opts["reference_reward"])
        except ServiceError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(json.dumps(summary, sort_keys=True))
