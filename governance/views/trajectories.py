"""Trajectory search, the conversation view of one trajectory and the audited raw read.

Search (`/trajectories/`): agent, session, data subject, time range, reward bounds and status,
50 per page. The subject is typed as the person knows it (an email, a customer id) and turned
into the keyed hashes erasure uses (governance.erasure.lookup_hashes); the page then carries a
signed reference to those hashes instead of the identifier, so it is not kept in the pager
links or the browser history. The search form is a POST (answered with a redirect to the GET
address that carries the reference, or, for htmx, the results with that address pushed): a
typed identifier never travels in a URL, so no access log, proxy log or Referer holds it. (A
hand-made GET with `subject=` still works the same way; config/gunicorn_logging.py keeps
query strings out of the web access log for that case.)

Matches: the subject header of the trajectory (Trajectory.subject_hash) or an identifier the
sanitizer found in one of its steps (the subject index). Counting stops at COUNT_CAP: an exact
count of a large filtered set costs as much as the whole search, and "more than 1,000" says
enough.

Detail (`/trajectories/<id>/`): the ATDP document
(governance.capture.atdp.trajectory_document: steps,
tool results, rewards, governance in three queries) rendered as the conversation it was — each
step shows only the messages its request added to the previous step's, then its answer.
Sanitizer placeholders (`<PERSON_1>`, `<EMAIL_ADDRESS:3f2a…>`, `<US_SSN>`) are marked with their
entity type; every other character is HTML-escaped (governance.views.trajectories.highlight).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django import forms
from django.core import signing
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Exists, Max, OuterRef, Q, QuerySet, Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.html import escape, format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_http_methods, require_POST

from governance.capture.atdp import trajectory_document
from governance.datasets import latest_rewards, reward_within
from governance.erasure import erased_by, lookup_hashes
from governance.models import (
    Agent,
    Consent,
    DatasetVersionMember,
    Finding,
    Interaction,
    Step,
    SubjectIndex,
    Trajectory,
)
from governance.retention import step_deadlines
from governance.services import ServiceError, ServiceGone, read_raw_payload
from governance.views.common import can, console_view, proxy_base_url

PER_PAGE = 50
COUNT_CAP = 1000
# Page 200 is OFFSET 9,950: deeper pages cost a scan of everything before them; the page says to
# narrow the time range instead.
MAX_PAGE = 200
SUBJECT_SALT = "steward.console.trajectory-subject"
MAX_REASON = 2000


# --- placeholders -----------------------------------------------------------------------------

# What the sanitizer writes (governance/sanitizer/core.py): `<TYPE_N>` (placeholder operator),
# `<TYPE:hexmac>` (hash) and `<TYPE>` (redact). TYPE is upper case with underscores, so the
# number is split off the end.
PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*?)(?:_(\d+)|:([0-9a-f]{8,64}))?>")


def highlight(text: Any) -> SafeString:
    """`text` HTML-escaped, each sanitizer placeholder wrapped in
    `<mark class="ph" title="TYPE">&lt;TYPE_1&gt;</mark>`. Every piece of content goes through
    escape(); only the mark element itself is markup."""
    if text is None:
        return SafeString("")
    text = text if isinstance(text, str) else str(text)
    out: list[str] = []
    pos = 0
    for m in PLACEHOLDER.finditer(text):
        out.append(escape(text[pos:m.start()]))
        out.append(format_html('<mark class="ph" title="{}">{}</mark>', m.group(1), m.group(0)))
        pos = m.end()
    out.append(escape(text[pos:]))
    return mark_safe("".join(out))  # noqa: S308 — every part above is escaped


def pretty_json(value: Any) -> str:
    """Tool arguments and other JSON for people: a JSON string is parsed and indented, anything
    unparseable is shown as it came."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    except (TypeError, ValueError):
        return str(value)


# --- search -----------------------------------------------------------------------------------

STATUSES = [
    ("", "Any status"),
    ("complete", "Complete: every call built into a step"),
    ("pending", "Pending: calls waiting for their step"),
    ("quarantined", "Has quarantined calls"),
    ("eligible", "Training-eligible"),
    ("no-train", "Consent: no-train"),
]


class TrajectoryFilter(forms.Form):
    agent = forms.CharField(required=False, max_length=128)
    session = forms.CharField(required=False, max_length=256)
    subject = forms.CharField(required=False, max_length=512, strip=True)
    subject_ref = forms.CharField(required=False, max_length=4096)
    started_after = forms.DateTimeField(required=False, label="Started after")
    started_before = forms.DateTimeField(required=False, label="Started before")
    reward_name = forms.CharField(required=False, max_length=64, label="Reward name")
    reward_min = forms.FloatField(required=False, label="Reward at least")
    reward_max = forms.FloatField(required=False, label="Reward at most")
    status = forms.ChoiceField(required=False, choices=STATUSES)

    def clean_subject_ref(self) -> list[str]:
        ref = self.cleaned_data.get("subject_ref")
        if not ref:
            return []
        try:
            hashes = signing.loads(ref, salt=SUBJECT_SALT)
        except signing.BadSignature:
            raise forms.ValidationError("The subject filter link is damaged; type the subject "
                                        "again.") from None
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise forms.ValidationError("The subject filter link is damaged.")
        return hashes

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        after, before = data.get("started_after"), data.get("started_before")
        if after and before and after >= before:
            self.add_error("started_before", "Must be later than “started after”.")
        lo, hi = data.get("reward_min"), data.get("reward_max")
        if lo is not None and hi is not None and lo > hi:
            self.add_error("reward_max", "Must not be below “reward at least”.")
        if (lo is not None or hi is not None) and not data.get("reward_name"):
            self.add_error("reward_name", "Name the reward the bounds apply to "
                                          "(e.g. “reward”).")
        return data


def subject_ref(tenant_id: int, subject: str) -> str:
    """A signed, URL-safe reference to the subject's keyed hashes (never the subject)."""
    return signing.dumps(lookup_hashes(tenant_id, subject), salt=SUBJECT_SALT, compress=True)


def filtered(tenant: Any, data: dict[str, Any]) -> QuerySet:
    qs = Trajectory.objects.for_tenant(tenant)
    if data.get("agent"):
        agent_id = (Agent.objects.for_tenant(tenant).filter(name=data["agent"])
                    .values_list("pk", flat=True).first())
        qs = qs.filter(agent_id=agent_id) if agent_id else qs.none()
    if data.get("session"):
        qs = qs.filter(session_id=data["session"])
    hashes = data.get("subject_ref") or []
    if hashes:
        by_content = SubjectIndex.objects.for_tenant(tenant) \
            .filter(hashes__keys_overlap=SubjectIndex.keys(hashes)).values("trajectory_id")
        qs = qs.filter(Q(subject_hash__in=hashes) | Q(pk__in=by_content))
    if data.get("started_after"):
        qs = qs.filter(started_at__gte=data["started_after"])
    if data.get("started_before"):
        qs = qs.filter(started_at__lt=data["started_before"])
    status = data.get("status")
    interactions = Interaction.objects.for_tenant(tenant)
    if status == "quarantined":
        qs = qs.filter(pk__in=interactions.filter(pending__state=Interaction.State.QUARANTINED)
                       .values("trajectory_id"))
    elif status == "pending":
        qs = qs.filter(pk__in=interactions.filter(pending__state=Interaction.State.CAPTURED)
                       .values("trajectory_id"))
    elif status in ("complete", "eligible"):
        unbuilt = interactions.filter(pending__isnull=False).values("trajectory_id")
        # step_count counts calls shipped, not steps built: ask the steps.
        qs = qs.filter(Exists(Step.objects.filter(trajectory_id=OuterRef("pk")))) \
            .exclude(pk__in=unbuilt)
        if status == "eligible":  # the per-trajectory part of governance/datasets.py's rule
            bad = Step.objects.filter(trajectory_id=OuterRef("pk")).filter(
                ~Q(training_eligible=True) | Q(sanitizer_version="") | ~Q(consent=Consent.TRAIN))
            qs = qs.filter(consent=Consent.TRAIN).exclude(Exists(bad))
    elif status == "no-train":
        qs = qs.filter(consent=Consent.NO_TRAIN)
    name = data.get("reward_name")
    lo, hi = data.get("reward_min"), data.get("reward_max")
    if name and (lo is not None or hi is not None):
        qs = qs.filter(reward_within(tenant.pk, name, lo, hi))
    return qs


@dataclass
class Page:
    """A page of results: rows, a count capped at COUNT_CAP, neighbours."""

    rows: list[Any]
    number: int
    count: int
    count_capped: bool

    @property
    def has_previous(self) -> bool:
        return self.number > 1

    @property
    def has_next(self) -> bool:
        return self.count > self.number * PER_PAGE and self.number < MAX_PAGE

    @property
    def at_limit(self) -> bool:
        """The deepest page with more after it: the page says to narrow the time range."""
        return self.number >= MAX_PAGE and self.count > self.number * PER_PAGE

    @property
    def previous_page_number(self) -> int:
        return self.number - 1

    @property
    def next_page_number(self) -> int:
        return self.number + 1

    @property
    def num_pages(self) -> int | None:
        return None if self.count_capped else max(1, -(-self.count // PER_PAGE))

    @property
    def start_index(self) -> int:
        return (self.number - 1) * PER_PAGE + 1 if self.rows else 0

    @property
    def end_index(self) -> int:
        return (self.number - 1) * PER_PAGE + len(self.rows)


def paginate(qs: QuerySet, page_param: str | None) -> Page:
    try:
        number = max(1, min(int(page_param or 1), MAX_PAGE))
    except ValueError:
        number = 1
    offset = (number - 1) * PER_PAGE
    # Count up to the end of this page + COUNT_CAP: exact for small sets, bounded for large.
    limit = offset + COUNT_CAP + 1
    count = qs.order_by()[:limit].count()
    capped = count == limit
    if capped:
        count = limit - 1
    if offset >= count and number > 1:  # past the end: the last page
        number = max(1, -(-count // PER_PAGE))
        offset = (number - 1) * PER_PAGE
    rows = list(qs.select_related("agent").order_by("-started_at", "-pk")[offset:offset + PER_PAGE])
    return Page(rows, number, count, capped)


def annotate_row_status(tenant: Any, rows: list[Trajectory]) -> None:
    """Each row's `calls` (quarantined, pending, upstream errors and the worst status code)
    and `findings` (sanitizer findings in its steps): two grouped queries over the page, so a
    500/502 capture or a quarantined call never reads as a success in the list."""
    ids = [t.pk for t in rows]
    if not ids:
        return
    State = Interaction.State
    calls = {c["trajectory_id"]: c for c in (
        Interaction.objects.for_tenant(tenant).filter(trajectory_id__in=ids)
        .values("trajectory_id").order_by()
        .annotate(quarantined=Count("pk", filter=Q(pending__state=State.QUARANTINED)),
                  pending=Count("pk", filter=Q(pending__state=State.CAPTURED)),
                  errors=Count("pk", filter=Q(status_code__gte=400)),
                  worst=Max("status_code", filter=Q(status_code__gte=400))))}
    findings = dict(Finding.objects.for_tenant(tenant).filter(step__trajectory_id__in=ids)
                    .values("step__trajectory_id").order_by()
                    .annotate(n=Sum("total")).values_list("step__trajectory_id", "n"))
    for t in rows:
        t.calls = calls.get(t.pk, {})
        t.findings = findings.get(t.pk, 0)


def _filter_query(data: dict[str, Any], ref: str) -> dict[str, str]:
    """The cleaned filters as query parameters (the subject as its signed reference)."""
    out: dict[str, str] = {}
    for key in ("agent", "session", "reward_name", "status"):
        if data.get(key):
            out[key] = data[key]
    for key in ("started_after", "started_before"):
        if data.get(key):
            out[key] = data[key].isoformat(timespec="minutes")
    for key in ("reward_min", "reward_max"):
        if data.get(key) is not None:
            out[key] = repr(data[key])
    if ref:
        out["subject_ref"] = ref
    return out


def redirect_303(url: str) -> HttpResponse:
    response = HttpResponse(status=303)
    response["Location"] = url
    return response


def _list_response(request: HttpRequest, template: str, context: dict[str, Any],
                   push_url: str | None = None) -> HttpResponse:
    response = render(request, template, context)
    response["Vary"] = "HX-Request, HX-Target"
    if push_url and request.htmx:
        response["HX-Push-Url"] = push_url
    return response


@require_http_methods(["GET", "HEAD", "POST"])
@console_view(permission="read_trajectories")
def trajectory_list(request: HttpRequest) -> HttpResponse:
    tenant = request.tenant
    # The search form POSTs (the subject stays out of URLs); pager links and pushed addresses
    # are GETs with the signed reference.
    params = request.POST if request.method == "POST" else request.GET
    form = TrajectoryFilter(params or None)
    errors: list[str] = []
    data: dict[str, Any] = {}
    ref = ""
    if form.is_bound:
        if form.is_valid():
            data = dict(form.cleaned_data)
        else:
            # Keep what is valid, say what is not: a bad date never hides the whole page.
            data = {k: v for k, v in getattr(form, "cleaned_data", {}).items()
                    if k not in form.errors}
            errors = [f"{form.fields[k].label or k.replace('_', ' ').capitalize()}: {e}"
                      if k != "__all__" else str(e)
                      for k, errs in form.errors.items() for e in errs]
        ref = params.get("subject_ref", "") if data.get("subject_ref") else ""
        if data.get("subject"):
            # Typed: computed into keyed hashes; the address bar and the pager keep the signed
            # reference, never the identifier.
            ref = subject_ref(tenant.pk, data["subject"])
            data["subject_ref"] = signing.loads(ref, salt=SUBJECT_SALT)
        if (request.method == "POST" or data.get("subject")) and not request.htmx \
                and not errors:
            # Post/redirect/get: the results live at a GET address without the identifier
            # (303: the browser follows with a GET; reloading never re-posts).
            query = urlencode(_filter_query(data, ref))
            return redirect_303(f"{reverse('trajectories')}" + (f"?{query}" if query else ""))
    query = _filter_query(data, ref)
    # An invalid filter lists nothing: a list that silently ignores "status=quarantend" looks
    # like the filtered one. The errors say what to fix; the form keeps what was typed.
    qs = Trajectory.objects.none() if errors else filtered(tenant, data)
    page = paginate(qs, request.GET.get("page"))
    annotate_row_status(tenant, page.rows)
    reward_column = bool(data.get("reward_name") and (
        data.get("reward_min") is not None or data.get("reward_max") is not None))
    if reward_column:
        values = latest_rewards(tenant.pk, data["reward_name"], [t.pk for t in page.rows])
        for t in page.rows:
            t.latest_reward = values.get(t.pk)
    active = bool(query)
    context = {
        "form": form,
        "params": params,
        "data": data,
        "errors": errors,
        "page": page,
        "active": active,
        "subject_active": bool(data.get("subject_ref")),
        "reward_column": reward_column,
        "query": query,
        "query_string": urlencode(query),
        "statuses": STATUSES,
        "can_record_rewards": can(request, "record_rewards"),
        "time_zone": timezone.get_current_timezone_name(),
        "agents": Agent.objects.for_tenant(tenant).order_by("name").values_list("name",
                                                                               flat=True),
        "base_url": proxy_base_url(request),
    }
    push = f"{reverse('trajectories')}?{urlencode({**query, 'page': page.number})}" \
        if page.number > 1 else f"{reverse('trajectories')}" + (f"?{urlencode(query)}"
                                                                if query else "")
    if request.htmx and request.htmx.target == "results" \
            and not request.htmx.history_restore_request:
        return _list_response(request, "console/trajectories.html#results", context, push)
    return _list_response(request, "console/trajectories.html", context, push)


# --- detail -----------------------------------------------------------------------------------

def _content_text(content: Any) -> tuple[str | None, list[Any]]:
    """A message's content as text, and the parts that are not text (shown as JSON)."""
    if content is None or isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts, other = [], []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, str):
                texts.append(part)
            else:
                other.append(part)
        return ("\n".join(texts) if texts else None), other
    return None, [content]


def _tool_calls(message: dict) -> list[dict[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        calls.append({"id": call.get("id") or "", "name": fn.get("name") or call.get("type"),
                      "arguments": highlight(pretty_json(fn.get("arguments", "")))})
    fc = message.get("function_call")
    if isinstance(fc, dict):
        calls.append({"id": "", "name": fc.get("name") or "",
                      "arguments": highlight(pretty_json(fc.get("arguments", "")))})
    return calls


def render_message(message: Any) -> dict[str, Any]:
    """One chat message (or Responses input item) for the template, already escaped."""
    if not isinstance(message, dict):
        return {"role": "input", "text": highlight(pretty_json(message)), "tool_calls": [],
                "extra": []}
    kind = message.get("type")
    if kind == "function_call":  # Responses: the model called a tool
        return {"role": "assistant", "text": None, "extra": [], "tool_call_id": "",
                "tool_calls": [{"id": message.get("call_id") or "", "name": message.get("name"),
                                "arguments": highlight(pretty_json(message.get("arguments")))}]}
    if kind == "function_call_output":
        return {"role": "tool", "text": highlight(pretty_json(message.get("output"))),
                "tool_call_id": message.get("call_id") or "", "tool_calls": [], "extra": []}
    text, other = _content_text(message.get("content"))
    return {
        "role": str(message.get("role") or kind or "message"),
        "name": message.get("name") or "",
        "tool_call_id": message.get("tool_call_id") or "",
        "text": highlight(text) if text is not None else None,
        "refusal": highlight(message["refusal"]) if message.get("refusal") else None,
        "tool_calls": _tool_calls(message),
        "extra": [highlight(pretty_json(o)) for o in other],
    }


def _key(message: Any) -> str:
    """What identifies a message when a later request repeats it (role, text, tool call ids):
    the request's copy of an earlier answer may differ in keys that do not matter."""
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True, default=str)
    text, other = _content_text(message.get("content"))
    ids = [c.get("id") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return json.dumps([message.get("role") or message.get("type"), text or "",
                       message.get("tool_call_id") or message.get("call_id") or "", ids,
                       message.get("output") if message.get("type") else None],
                      sort_keys=True, default=str)


def _request_messages(step: dict) -> list[Any]:
    obs = step.get("observation") or {}
    if isinstance(obs.get("messages"), list):
        return obs["messages"]
    items: list[Any] = []
    if isinstance(obs.get("instructions"), str):
        items.append({"role": "system", "content": obs["instructions"]})
    inp = obs.get("input")
    if isinstance(inp, str):
        items.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        items.extend(inp)
    if obs.get("prompt") is not None:
        prompt = obs["prompt"]
        items.append({"role": "prompt", "content": prompt if isinstance(prompt, str)
                      else pretty_json(prompt)})
    return items


def _answer_messages(step: dict) -> list[Any]:
    action = step.get("action") or {}
    if isinstance(action.get("messages"), list):
        return action["messages"]
    if action.get("text") is not None:
        return [{"role": "completion", "content": action["text"]}]
    return []


def conversation(step_docs: list[dict]) -> list[dict[str, Any]]:
    """Per step: the request's messages that the previous step's request and answer did not
    already hold (a chat request repeats the whole conversation), and its answer."""
    seen: list[str] = []
    out = []
    for doc in step_docs:
        request = _request_messages(doc)
        keys = [_key(m) for m in request]
        repeated = 0
        while repeated < min(len(keys), len(seen)) and keys[repeated] == seen[repeated]:
            repeated += 1
        answer = _answer_messages(doc)
        out.append({"repeated": repeated,
                    "new": [render_message(m) for m in request[repeated:]],
                    "answer": [render_message(m) for m in answer]})
        seen = keys + [_key(m) for m in answer]
    return out


VERSION_FIELDS = [
    ("gen_ai.request.model", "model requested"),
    ("gen_ai.response.model", "model answered"),
    ("system_prompt_hash", "system prompt"),
    ("tool_schema_hash", "tool schema"),
    ("harness_version", "harness"),
]


def _versions(step: dict, previous: dict | None) -> list[dict[str, Any]]:
    versions = step.get("versions") or {}
    before = (previous or {}).get("versions") or {}
    rows = []
    for key, label in VERSION_FIELDS:
        value = versions.get(key)
        rows.append({"label": label, "value": value, "is_hash": key.endswith("_hash"),
                     "changed": previous is not None and before.get(key) != value})
    return rows


def reward_chart(rewards: list[dict]) -> dict[str, Any] | None:
    """Reward values in the order they arrived, one line per reward name."""
    if not rewards:
        return None
    names = sorted({r["name"] for r in rewards})
    labels = [r["created_at"][:19].replace("T", " ") for r in rewards]
    datasets = [{"label": name, "data": [r["value"] if r["name"] == name else None
                                         for r in rewards], "spanGaps": True}
                for name in names]
    return {"type": "line", "labels": labels, "datasets": datasets, "y_label": "value",
            "x_label": "received", "begin_at_zero": False}


def _dataset_approvals(trajectory: Trajectory) -> list[dict[str, Any]]:
    rows = (DatasetVersionMember.objects.for_tenant(trajectory.tenant_id)
            .filter(trajectory=trajectory)
            .select_related("version__dataset", "version__approval__decided_by")
            .order_by("version__dataset__name", "version__number"))
    out = []
    for member in rows:
        version = member.version
        approval = getattr(version, "approval", None)
        try:
            href = reverse("dataset-version", args=[version.pk])
        except NoReverseMatch:
            href = None
        out.append({"dataset": version.dataset.name, "number": version.number,
                    "status": version.get_status_display(), "href": href,
                    "decision": approval.get_decision_display() if approval else None,
                    "decided_by": approval.decided_by.get_username()
                    if approval and approval.decided_by else None,
                    "decided_at": approval.decided_at if approval else None})
    return out


def _when(iso: str | None) -> datetime | None:
    """An ISO timestamp of the ATDP document as a datetime (for the date filter)."""
    return datetime.fromisoformat(iso) if iso else None


def _get_trajectory(request: HttpRequest, trajectory_id: Any) -> Trajectory:
    trajectory = (Trajectory.objects.for_tenant(request.tenant)
                  .select_related("agent", "tenant").filter(pk=trajectory_id).first())
    if trajectory is None:
        request_id = erased_by(request.tenant.pk, trajectory_id)
        if request_id is not None:
            raise Http404(f"this trajectory was erased by erasure request #{request_id}: "
                          "its steps, rewards and raw payloads are gone for good")
        raise Http404("no such trajectory")
    return trajectory


def detail_context(request: HttpRequest, trajectory: Trajectory) -> dict[str, Any]:
    doc = trajectory_document(trajectory)
    steps = doc["steps"]
    turns = conversation(steps)
    rewards_by_step: dict[int, list[dict]] = {}
    for r in doc["rewards"]:
        if r["step_index"] is not None:
            rewards_by_step.setdefault(r["step_index"], []).append(r)
    for i, (step, turn) in enumerate(zip(steps, turns, strict=True)):
        step["turn"] = turn
        step["number"] = i + 1
        step["version_rows"] = _versions(step, steps[i - 1] if i else None)
        step["rewards_here"] = rewards_by_step.get(i, [])
        hidden = step.get("hidden_state") or {}
        reasoning = hidden.get("reasoning_content") or hidden.get("reasoning")
        step["reasoning"] = highlight(reasoning if isinstance(reasoning, str)
                                      else pretty_json(reasoning)) if reasoning else None
        step["error_text"] = highlight(pretty_json(step["error"])) if step.get("error") else None
        step["findings_list"] = sorted(step["governance"]["findings"].items())
    for r in doc["rewards"]:
        r["step_number"] = r["step_index"] + 1 if r["step_index"] is not None else None
        r["at"] = _when(r["created_at"])
    for q in doc["governance"]["quarantined"]:
        q["at"] = _when(q["started_at"])
    # The deadlines the purge will apply (governance/retention.py), not only a per-step
    # override: with no policy the defaults (365 days, raw payloads 7) still apply.
    deadlines = step_deadlines(trajectory.tenant_id, trajectory.pk)
    for step in steps:
        override = _when(step["governance"]["retention_until"])
        found = deadlines.get(step["id"])
        step["deadlines"] = found
        step["retention_at"] = (min(override, found.steps) if override and found
                                else override or (found.steps if found else None))
        step["at"] = _when(step["started_at"])
    dated = list(deadlines.values())
    raw_left = [d.raw for d in dated if d.raw is not None]
    pending = sum(1 for q in doc["governance"]["quarantined"] if q["state"] == "captured")
    return {
        "trajectory": trajectory,
        "doc": doc,
        "steps": steps,
        "rewards": doc["rewards"],
        "reward_chart": reward_chart(doc["rewards"]),
        "governance": doc["governance"],
        "retention_until": _when(doc["governance"]["retention"]["until"]),
        "deadlines": {
            "steps": min((s["retention_at"] for s in steps if s["retention_at"]), default=None),
            "raw": min(raw_left, default=None),
            "raw_gone": bool(dated) and not raw_left,
            "findings": min((d.findings for d in dated), default=None),
            "defaults": bool(dated) and all(d.source == "default" for d in dated),
        },
        "findings_total": sorted(doc["governance"]["findings"].items()),
        "unbuilt": doc["governance"]["quarantined"],
        "pending": pending,
        "status": doc["status"],
        "approvals": _dataset_approvals(trajectory),
        "can_read_raw": can(request, "read_raw_payloads"),
        "raw": None,
    }


@console_view(permission="read_trajectories")
def trajectory_detail(request: HttpRequest, trajectory_id: Any) -> HttpResponse:
    trajectory = _get_trajectory(request, trajectory_id)
    return render(request, "console/trajectory.html", detail_context(request, trajectory))


# --- the raw payload (compliance, audited) ----------------------------------------------------

def _body(value: Any) -> dict[str, Any]:
    """A captured body for the page: text (indented when JSON), or a note for binary."""
    import base64

    if not isinstance(value, str):
        return {"text": None, "size": 0, "binary": False}
    data = base64.b64decode(value)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return {"text": None, "size": len(data), "binary": True}
    try:
        text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        pass  # a stream or plain text: as captured
    return {"text": text, "size": len(data), "binary": False}


def raw_view_model(raw: Any) -> dict[str, Any]:
    ex, ia = raw.exchange, raw.interaction
    return {
        "step_id": str(raw.step.pk),
        "method": ex.get("method"), "path": ex.get("path"),
        "captured_at": ia.started_at, "expires_at": ia.raw_expires_at,
        "request_headers": ex.get("request_headers") or [],
        "request_body": _body(ex.get("request_body")),
        "response_status": ex.get("response_status"),
        "response_headers": ex.get("response_headers") or [],
        "response_body": _body(ex.get("response_body")),
        "is_stream": bool(ex.get("is_stream")),
        "error": pretty_json(ex.get("error")) if ex.get("error") else None,
    }


@require_POST
@console_view(permission="read_trajectories")
def trajectory_raw(request: HttpRequest, trajectory_id: Any, step_id: Any) -> HttpResponse:
    """POST a reason, get the step's raw exchange (audited `raw.read`). htmx swaps the step's
    raw region; without JS the trajectory page comes back with the payload under its step (a
    POST response: the payload is never put in a redirect, a message or a cache)."""
    if not can(request, "read_raw_payloads"):
        raise PermissionDenied("Only a compliance officer may read raw payloads "
                               "(needs read_raw_payloads).")
    trajectory = _get_trajectory(request, trajectory_id)
    step = (Step.objects.for_tenant(request.tenant).filter(trajectory=trajectory, pk=step_id)
            .first())
    if step is None:
        raise Http404("no such step in this trajectory")
    reason = (request.POST.get("reason") or "").strip()
    status, error, raw = 200, None, None
    if not reason:
        status, error = 400, "Say why you read this raw payload: the reason is required " \
            "and recorded (as a hash) in the audit log."
    elif len(reason) > MAX_REASON:
        status, error = 400, f"The reason may be at most {MAX_REASON} characters."
    else:
        try:
            raw = raw_view_model(read_raw_payload(request.user, step, reason))
        except ServiceGone as exc:
            status, error = 410, f"Gone for good: {exc}."
        except ServiceError as exc:
            status, error = 400, str(exc)
    fragment = {"step_id": str(step.pk), "trajectory": trajectory, "raw": raw,
                "raw_error": error, "reason": reason if error else "", "gone": status == 410}
    if request.htmx:
        # htmx swaps 2xx only: the error is the fragment's content, its status stays 200.
        response = render(request, "console/_trajectory_raw.html", fragment)
    else:
        # The error is shown at the step's form (role="alert"), where the reason is typed.
        context = detail_context(request, trajectory)
        context["raw_for"] = fragment
        response = render(request, "console/trajectory.html", context, status=status)
    response["Cache-Control"] = "no-store"  # unsanitized: never kept by a cache
    return response


__all__ = ["highlight", "trajectory_detail", "trajectory_list", "trajectory_raw"]
