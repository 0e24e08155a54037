"""GDPR Art. 17 erasure in the console: file a request, watch its progress live (htmx polls
every 2 s while it is pending or running), read and download its certificate.

The subject a person types goes straight to governance.erasure.request_erasure, which keeps only
keyed hashes; no page ever shows it again (after a successful submit the form comes back empty,
and the request is named by its id and the hash)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET

from governance.erasure import COUNT_KINDS, MAX_SUBJECT_CHARS, ErasureError, request_erasure
from governance.models import ErasureRequest, Tenant
from governance.views.common import console_view

ACTIVE = (ErasureRequest.Status.PENDING, ErasureRequest.Status.RUNNING)
PAGE_SIZE = 50

# The job's stages (governance.erasure.STAGES, "done" aside) as a person reads them.
STAGE_LABELS: dict[str, str] = {
    "suppress": "Suppressing the subject and destroying their data keys",
    "spool": "Waiting for the proxy spool to drain",
    "scan": "Decrypting and scanning payloads that were never indexed",
    "delete": "Deleting trajectories, steps, interactions and what hangs off them",
    "exports": "Removing export files of affected dataset versions",
    "verify": "Checking that nothing of the subject is left",
}
COUNT_LABELS: dict[str, str] = {
    "trajectories": "Trajectories",
    "steps": "Steps",
    "interactions": "Captured interactions",
    "raw_payloads": "Raw payloads (encrypted)",
    "findings": "Sanitizer findings",
    "subject_index": "Subject index rows",
    "rewards": "Rewards",
    "dataset_memberships": "Dataset memberships",
    "data_keys_destroyed": "Data keys destroyed (crypto-shredding)",
    "suppressed_hashes": "Hashes put on the suppression list",
    "exports_removed": "Export files removed",
    "dead_letters": "Dead letters (records the shipper could not store)",
}
REMAINING_LABELS: dict[str, str] = {
    "trajectories": "Trajectories",
    "interactions": "Interactions",
    "subject_index": "Subject index rows",
    "live_data_keys": "Live data keys",
    "dead_letters": "Dead letters",
}


def pending_erasures_count(tenant: Tenant | int) -> int:
    """Erasure requests of the tenant not finished yet (pending or running): the overview's
    badge. Call it inside the tenant's scope (a console request is)."""
    return ErasureRequest.objects.for_tenant(tenant).filter(status__in=ACTIVE).count()


def _progress(req: ErasureRequest) -> dict[str, Any]:
    """What the progress cell and the detail page show of a request's `progress`/`stage`."""
    progress = req.progress or {}
    counts = progress.get("counts") or {}
    stages = list(STAGE_LABELS)
    # A pending request has no stage yet (no worker claimed it); a running one starts at 1.
    running = req.status == ErasureRequest.Status.RUNNING
    stage = req.stage or ("suppress" if running else "")
    return {
        "active": req.status in ACTIVE,
        "stage": stage,
        "stage_label": STAGE_LABELS.get(stage, ""),
        "stage_number": stages.index(stage) + 1 if stage in stages else None,
        "stage_total": len(stages),
        "counts": [(COUNT_LABELS[k], counts.get(k, 0)) for k in COUNT_KINDS if counts.get(k)],
        "batches": progress.get("batches", 0),
        "spool": progress.get("spool") or {},
    }


def _rows(page: Any) -> list[dict[str, Any]]:
    return [{"req": r, "p": _progress(r)} for r in page]


def _list_context(request: HttpRequest, subject: str = "") -> dict[str, Any]:
    qs = (ErasureRequest.objects.for_tenant(request.tenant).select_related("requested_by")
          .defer("lookup_hashes", "certificate").order_by("-created_at", "-pk"))
    page = Paginator(qs, PAGE_SIZE).get_page(request.GET.get("page"))
    rows = _rows(page)
    return {"page": page, "rows": rows, "subject": subject, "max_chars": MAX_SUBJECT_CHARS,
            # One poll for the whole page while anything on it is pending or running.
            "any_active": any(r["p"]["active"] for r in rows)}


@console_view(permission="erase")
def erasure_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        subject = request.POST.get("subject", "")
        if request.POST.get("confirm") != "yes":
            # Irreversible: the form asks for an explicit confirmation (works without JS).
            messages.error(request, "The erasure request was not filed: confirm that you "
                           "understand it cannot be undone.")
            return render(request, "console/erasure.html",
                          _list_context(request, subject), status=400)
        try:
            req, created = request_erasure(request.user, request.tenant, subject)
        except ErasureError as exc:
            # Nothing was stored: the typed value may come back so it can be corrected.
            messages.error(request, f"The erasure request was not filed: {exc}.")
            return render(request, "console/erasure.html",
                          _list_context(request, subject), status=400)
        if created:
            messages.success(request, f"Erasure request #{req.pk} filed. The job runs in the "
                             "background; this page shows its progress.")
        else:
            messages.info(request, f"An erasure of this subject is already under way: "
                          f"request #{req.pk}.")
        return redirect("erasure-request", req.pk)
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET, POST"})
    if request.htmx and request.GET.get("part") == "rows":
        return render(request, "console/erasure.html#rows", _list_context(request))
    return render(request, "console/erasure.html", _list_context(request))


def _get_request(request: HttpRequest, request_id: int) -> ErasureRequest:
    req = (ErasureRequest.objects.for_tenant(request.tenant).select_related("requested_by")
           .filter(pk=request_id).first())
    if req is None:
        raise Http404("no such erasure request")
    return req


def _certificate_rows(cert: dict[str, Any]) -> dict[str, Any]:
    counts = cert.get("counts") or {}
    remaining = (cert.get("post_condition") or {}).get("remaining") or {}
    return {
        "counts": [(COUNT_LABELS.get(k, k), counts.get(k, 0)) for k in COUNT_KINDS],
        "remaining": [(REMAINING_LABELS.get(k, k), v) for k, v in remaining.items()],
        "clean": bool((cert.get("post_condition") or {}).get("clean")),
        "because": list((cert.get("post_condition") or {}).get("because") or []),
    }


@console_view(permission="erase")
@require_GET
def erasure_detail(request: HttpRequest, request_id: int) -> HttpResponse:
    req = _get_request(request, request_id)
    context = {"req": req, "p": _progress(req)}
    if req.certificate:
        context["cert"] = req.certificate
        context["cert_rows"] = _certificate_rows(req.certificate)
    if request.htmx and request.GET.get("part") == "state":
        return render(request, "console/erasure_request.html#state", context)
    return render(request, "console/erasure_request.html", context)


@console_view(permission="erase")
@require_GET
def erasure_certificate(request: HttpRequest, request_id: int) -> HttpResponse:
    """The certificate as the REST API shows it (ErasureRequestSerializer), as a download."""
    from rest_framework.renderers import JSONRenderer

    from governance.api import ErasureRequestSerializer

    req = _get_request(request, request_id)
    if not req.certificate:
        messages.warning(request, f"Erasure request #{req.pk} has no certificate yet: it is "
                         "written when the job finishes.")
        return redirect("erasure-request", req.pk)
    body = JSONRenderer().render(ErasureRequestSerializer(req).data,
                                 renderer_context={"indent": 2})
    response = HttpResponse(body, content_type="application/json")
    response["Content-Disposition"] = (
        f'attachment; filename="erasure-{req.pk}-certificate.json"')
    return response
