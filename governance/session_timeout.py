"""Absolute lifetime of a console session: STEWARD_SESSION_ABSOLUTE_SECONDS (default 12 h) after
login the session is logged out, however active it has been. Django only has the idle timeout
(SESSION_COOKIE_AGE, renewed on every request with SESSION_SAVE_EVERY_REQUEST); a session kept
busy — or a stolen cookie kept warm — would otherwise live for ever.

The login time is stamped into the session by the `user_logged_in` signal (connected when this
module is imported, i.e. when Django loads the middleware at start-up). A logged-in session
without a stamp (created before this middleware was deployed, or by a login made before the
middleware chain was loaded) is stamped at its first request. REST calls authenticate with
tokens, not sessions, and are not affected."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth import logout
from django.contrib.auth.signals import user_logged_in
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse

log = logging.getLogger("steward.session")

LOGIN_AT_KEY = "steward_login_at"


def _now() -> float:
    return time.time()


@receiver(user_logged_in, dispatch_uid="steward_session_login_at")
def stamp_login(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    # Every login restarts the clock, also a re-login of the same user into the same session
    # (login() keeps the session's data when the user does not change).
    if request is not None and hasattr(request, "session"):
        request.session[LOGIN_AT_KEY] = _now()


class AbsoluteSessionTimeoutMiddleware:
    """After AuthenticationMiddleware: logs the session's user out once the absolute lifetime
    has passed, so the rest of the request runs anonymous (console pages redirect to login)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            self._enforce(request, user)
        return self.get_response(request)

    def _enforce(self, request: HttpRequest, user: Any) -> None:
        now = _now()
        started = request.session.get(LOGIN_AT_KEY)
        # A missing or unusable stamp (also one from the future: clock skew between hosts)
        # starts the clock now rather than trusting it.
        if not isinstance(started, int | float) or isinstance(started, bool) or started > now:
            request.session[LOGIN_AT_KEY] = now
            return
        limit = settings.STEWARD_SESSION_ABSOLUTE_SECONDS
        if limit > 0 and now - started >= limit:
            log.info("session of user %s ended: %d s since login (limit %d s)",
                     user.pk, int(now - started), limit)
            logout(request)  # flushes the session, sets AnonymousUser
