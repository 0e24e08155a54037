"""REST authentication: `Authorization: Bearer stwt_...` (or `Token stwt_...`). Sets
`request.tenant` and `request.membership` — the only source of tenant for API views."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from governance.crypto import token_hash
from governance.models import ApiToken, Membership


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keywords = ("bearer", "token")

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode().lower() not in self.keywords:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Invalid Authorization header.")
        secret = header[1].decode(errors="replace")
        token = (
            ApiToken.objects.select_related("user", "tenant")
            .filter(key_hash=token_hash(secret), revoked_at__isnull=True)
            .first()
        )
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
