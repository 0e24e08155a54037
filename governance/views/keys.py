"""Proxy keys per agent and API tokens per member: list, create (the secret is shown once),
revoke (proxy keys after a confirmation page, since agents in production break at once; API
tokens straight from the list). An API token is issued only to the admin asking for it; they
may revoke anyone's.

A new secret is rendered straight into the response to the POST that created it, marked
`no-store`, instead of the usual POST + redirect: the redirect would have to park the secret in
the session store (the database) until the next page is drawn. Steward keeps only its hash."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers

from governance.models import Agent, ApiToken, Membership, ProxyKey
from governance.services import (
    ServiceError,
    create_api_token,
    create_proxy_key,
    revoke_api_token,
    revoke_proxy_key,
)
from governance.views.common import console_view, proxy_base_url

PAGE_SIZE = 50
AGENT_NAME_MAX = Agent._meta.get_field("name").max_length


def _context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    keys = (ProxyKey.objects.for_tenant(request.tenant)
            .select_related("agent", "created_by").order_by("-created_at", "-pk"))
    agent_filter = request.GET.get("agent", "").strip()
    if agent_filter:
        keys = keys.filter(agent__name=agent_filter)
    tokens = (ApiToken.objects.for_tenant(request.tenant).select_related("user")
              .order_by("-created_at", "-pk"))
    return {
        "page": Paginator(keys, PAGE_SIZE).get_page(request.GET.get("page")),
        "tokens": Paginator(tokens, PAGE_SIZE).get_page(request.GET.get("tokens_page")),
        "agents": Agent.objects.for_tenant(request.tenant).order_by("name"),
        "base_url": proxy_base_url(request),
        "agent_name": "",
        "agent_filter": agent_filter,
        **extra,
    }


def _secret_page(request: HttpRequest, context: dict[str, Any]) -> HttpResponse:
    response = render(request, "console/keys_created.html", context)
    add_never_cache_headers(response)  # no-store: the secret stays out of every cache
    return response


@console_view(permission="manage_keys")
def key_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        agent_name = request.POST.get("agent", "").strip()
        error = ""
        if not agent_name:
            error = "Name the agent the key is for."
        elif len(agent_name) > AGENT_NAME_MAX:
            error = f"An agent name has at most {AGENT_NAME_MAX} characters."
        if error:
            messages.error(request, f"No key was created: {error}")
            return render(request, "console/keys.html",
                          _context(request, agent_name=agent_name), status=400)
        issued = create_proxy_key(request.user, request.tenant, agent_name)
        return _secret_page(request, {"kind": "proxy key", "issued": issued,
                                      "secret": issued.secret, "agent_name": agent_name,
                                      "base_url": proxy_base_url(request)})
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET, POST"})
    return render(request, "console/keys.html", _context(request))


def _key(request: HttpRequest, key_id: int) -> ProxyKey:
    key = (ProxyKey.objects.for_tenant(request.tenant).select_related("agent")
           .filter(pk=key_id).first())
    if key is None:
        raise Http404("no such proxy key")
    return key


@console_view(permission="manage_keys")
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    """GET: the confirmation page; POST: revoke (idempotent) and back to the list."""
    key = _key(request, key_id)
    if request.method == "POST":
        if key.revoked_at is not None:
            messages.info(request, f"Key {key.prefix}… was already revoked.")
        else:
            revoke_proxy_key(request.user, key)
            messages.success(request, f"Key {key.prefix}… of {key.agent.name} is revoked: the "
                             "proxy refuses it from now on.")
        return redirect("keys")
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET, POST"})
    return render(request, "console/keys_revoke.html", {"key": key})


@console_view(permission="manage_keys")
def token_create(request: HttpRequest) -> HttpResponse:
    """An API token for the person asking (the REST API acts with their role). Never for
    another member: its holder would act as that member (separation of duties, enforced by
    the service); a `user` field naming someone else is refused with the reason."""
    if request.method != "POST":
        return redirect("keys")
    user_id = request.POST.get("user", "").strip() or str(request.user.pk)
    member = (Membership.objects.for_tenant(request.tenant).select_related("user")
              .filter(user_id=int(user_id)).first() if user_id.isdigit() else None)
    if member is None:
        messages.error(request, "No token was created: choose a member of this tenant.")
        return redirect("keys")
    try:
        issued = create_api_token(request.user, request.tenant, member.user)
    except ServiceError as exc:
        messages.error(request, f"No token was created: {exc}")
        return redirect("keys")
    return _secret_page(request, {"kind": "API token", "issued": issued, "secret": issued.secret,
                                  "member": member, "api_url": request.build_absolute_uri(
                                      "/api/v1/")})


@console_view(permission="manage_keys")
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    """GET: the confirmation page (as for proxy keys); POST: revoke an API token of this
    tenant (idempotent) and back to the list."""
    token = (ApiToken.objects.for_tenant(request.tenant).select_related("user")
             .filter(pk=token_id).first())
    if token is None:
        raise Http404("no such API token")
    if request.method == "GET":
        return render(request, "console/token_revoke.html", {"token": token})
    if request.method != "POST":
        return HttpResponse(status=405, headers={"Allow": "GET, POST"})
    if token.revoked_at is not None:
        messages.info(request, f"Token {token.prefix}… was already revoked.")
    else:
        revoke_api_token(request.user, token)
        messages.success(request, f"Token {token.prefix}… of {token.user.username} is revoked: "
                         "the REST API refuses it from now on.")
    return redirect("keys")
