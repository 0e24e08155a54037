"""REST authentication: `Authorization: Bearer stwt_...` (or `Token stwt_...`). Sets
`request.tenant` and `request.membership` — the only source of tenant for API views — and
switches the request's transaction to that tenant (row-level security, governance/tenancy.py).

The token is found across tenants by the SECURITY DEFINER function steward_api_token_lookup
(the tenant is not known before); everything after that is read under the token's tenant."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from governance.models import ApiToken, Membership
from governance.tenancy import (
    api_token_lookup,
    request_scope_active,
    set_request_tenant,
    tenant_context,
)
from wire.crypto import token_hash


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keywords = (b"bearer", b"token")

    def authenticate(self, request):
        # Bytes throughout: a header value is whatever the client sent (WSGI hands it over as
        # latin-1), so nothing here may assume UTF-8 — a bad byte is a 401, never a 500.
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() not in self.keywords:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Invalid Authorization header.")
        try:
            secret = header[1].decode("ascii")  # issued tokens are ASCII (stwt_ + urlsafe)
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid or revoked token.") from None
        if not secret.isprintable():  # NUL and other control characters: never a token
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        found = api_token_lookup(token_hash(secret))
        if found is None or found[3]:  # unknown or revoked
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        token_id, tenant_id, _user_id, _revoked = found
        if request_scope_active():
            set_request_tenant(tenant_id)
            return self._load(request, token_id)
        # Called outside TenantMiddleware (no request transaction to switch): read under a
        # scope of our own; a view run this way sees no tenant rows (fails closed).
        with tenant_context(tenant_id):
            return self._load(request, token_id)

    def _load(self, request, token_id: int):
        token = ApiToken.objects.select_related("user", "tenant").filter(pk=token_id).first()
        if token is None or not token.user.is_active:
            raise exceptions.AuthenticationFailed("Invalid or revoked token.")
        membership = Membership.objects.filter(user=token.user, tenant=token.tenant).first()
        if membership is None:
            raise exceptions.AuthenticationFailed("Token's user is no longer a tenant member.")
        request._request.tenant = token.tenant
        request._request.membership = membership
        return token.user, token

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="steward"'
