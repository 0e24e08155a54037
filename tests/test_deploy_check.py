"""Production hardening: `manage.py check --deploy` is clean under production settings (and does
flag the embedded defaults, which serve plain http://127.0.0.1); console session cookies are
HttpOnly, SameSite and (when configured) Secure; sessions end after an idle period and, however
active, after an absolute lifetime (governance/session_timeout.py)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.sessions.models import Session
from django.utils import timezone

from governance.session_timeout import LOGIN_AT_KEY

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "correct horse battery staple"

PRODUCTION_ENV = {
    "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
    "STEWARD_DEBUG": "0",
    "STEWARD_ALLOWED_HOSTS": "steward.example.com",
    "STEWARD_CSRF_TRUSTED_ORIGINS": "https://steward.example.com",
    "STEWARD_SECURE_COOKIES": "1",
    "STEWARD_BEHIND_TLS_PROXY": "1",
    "STEWARD_HSTS_SECONDS": "31536000",
}


def _env(extra: dict[str, str]) -> dict[str, str]:
    """The test process's environment without any Django/Steward web setting (a developer's
    shell must not change the verdict), plus `extra`."""
    keep = {k: v for k, v in os.environ.items()
            if not (k.startswith(("STEWARD_", "DJANGO_")) and k not in (
                "STEWARD_MASTER_KEY", "STEWARD_VAR_DIR"))}
    keep["DJANGO_SETTINGS_MODULE"] = "config.settings"
    return {**keep, **extra}


def _check_deploy(extra: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=_env(extra), capture_output=True, text=True, timeout=120)


def _warnings(out: subprocess.CompletedProcess) -> set[str]:
    return set(re.findall(r"\((\w+\.[WE]\d+)\)", out.stdout + out.stderr))


def test_check_deploy_is_clean_under_production_settings():
    out = _check_deploy(PRODUCTION_ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _warnings(out) == set(), out.stdout + out.stderr
    assert "no issues" in out.stdout + out.stderr


def test_check_deploy_flags_the_embedded_defaults():
    """Without production settings (what `steward up` runs on plain http), --deploy must
    complain — about HTTPS, cookies and the fallback secret — or the clean run proves nothing."""
    out = _check_deploy({})
    assert out.returncode != 0
    assert {"security.W004", "security.W008", "security.W009", "security.W012",
            "security.W016"} <= _warnings(out), out.stdout + out.stderr
    # Production settings but the secret forgotten: the fallback key is refused.
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "DJANGO_SECRET_KEY"}
    assert "security.W009" in _warnings(_check_deploy(env))


SAMPLE = ROOT / "deploy" / "steward.env.sample"
SECURITY_SETTINGS = [
    "STEWARD_BEHIND_TLS_PROXY", "STEWARD_SECURE_COOKIES", "STEWARD_SSL_REDIRECT",
    "STEWARD_HSTS_SECONDS", "STEWARD_HSTS_INCLUDE_SUBDOMAINS", "STEWARD_HSTS_PRELOAD",
    "STEWARD_COOKIE_SAMESITE", "STEWARD_SESSION_IDLE_SECONDS",
    "STEWARD_SESSION_ABSOLUTE_SECONDS", "STEWARD_ALLOWED_HOSTS", "STEWARD_DEBUG",
]


def _sample_values() -> dict[str, str]:
    """The settings the shipped env sample sets (uncommented KEY=value lines)."""
    return dict(line.split("=", 1) for line in SAMPLE.read_text().splitlines()
                if re.match(r"^[A-Z][A-Z0-9_]*=", line))


def test_env_sample_documents_the_security_settings_and_passes_check_deploy():
    text = SAMPLE.read_text()
    for name in SECURITY_SETTINGS:
        assert re.search(rf"^#?{name}=", text, re.M), f"{name} is not in {SAMPLE.name}"
    # The sample as an operator fills it in (a secret of their own) is deployment-clean.
    values = {k: v for k, v in _sample_values().items() if v}
    assert values["STEWARD_BEHIND_TLS_PROXY"] == "1"
    out = _check_deploy({**values, "DJANGO_SECRET_KEY": secrets.token_urlsafe(64)})
    assert out.returncode == 0 and _warnings(out) == set(), out.stdout + out.stderr


# The settings module alone (no app loading): what each environment turns into.
SETTINGS_PROBE = """
import json
import config.settings as s
print(json.dumps({k: getattr(s, k, None) for k in (
    "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD", "SECURE_PROXY_SSL_HEADER", "SESSION_COOKIE_SECURE",
    "SESSION_COOKIE_HTTPONLY", "SESSION_COOKIE_SAMESITE", "CSRF_COOKIE_SECURE",
    "CSRF_COOKIE_HTTPONLY", "CSRF_COOKIE_SAMESITE", "SESSION_COOKIE_AGE",
    "SESSION_SAVE_EVERY_REQUEST", "STEWARD_SESSION_ABSOLUTE_SECONDS")}))
"""


def _settings_under(extra: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", SETTINGS_PROBE], cwd=ROOT, env=_env(extra),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_http_defaults_and_production_settings():
    """`make up` on http://127.0.0.1 keeps working: nothing requires HTTPS by default. Behind
    the TLS front everything HTTPS-only is on, and each part can still be set on its own."""
    plain = _settings_under({})
    assert (plain["SECURE_SSL_REDIRECT"], plain["SECURE_HSTS_SECONDS"],
            plain["SESSION_COOKIE_SECURE"], plain["CSRF_COOKIE_SECURE"],
            plain["SECURE_PROXY_SSL_HEADER"]) == (False, 0, False, False, None)
    assert plain["SESSION_COOKIE_HTTPONLY"] and plain["CSRF_COOKIE_HTTPONLY"]
    assert plain["SESSION_COOKIE_SAMESITE"] == plain["CSRF_COOKIE_SAMESITE"] == "Lax"
    assert (plain["SESSION_COOKIE_AGE"], plain["SESSION_SAVE_EVERY_REQUEST"],
            plain["STEWARD_SESSION_ABSOLUTE_SECONDS"]) == (1800, True, 43200)

    tls = _settings_under({"STEWARD_BEHIND_TLS_PROXY": "1"})
    assert (tls["SECURE_SSL_REDIRECT"], tls["SECURE_HSTS_SECONDS"],
            tls["SECURE_HSTS_INCLUDE_SUBDOMAINS"], tls["SECURE_HSTS_PRELOAD"],
            tls["SESSION_COOKIE_SECURE"], tls["CSRF_COOKIE_SECURE"]) == (
        True, 31536000, True, True, True, True)
    assert tls["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]

    tuned = _settings_under({"STEWARD_BEHIND_TLS_PROXY": "1", "STEWARD_SSL_REDIRECT": "0",
                             "STEWARD_HSTS_SECONDS": "0", "STEWARD_COOKIE_SAMESITE": "strict",
                             "STEWARD_SESSION_IDLE_SECONDS": "600",
                             "STEWARD_SESSION_ABSOLUTE_SECONDS": "3600"})
    assert (tuned["SECURE_SSL_REDIRECT"], tuned["SECURE_HSTS_SECONDS"],
            tuned["SESSION_COOKIE_SECURE"], tuned["SESSION_COOKIE_SAMESITE"],
            tuned["SESSION_COOKIE_AGE"], tuned["STEWARD_SESSION_ABSOLUTE_SECONDS"]) == (
        False, 0, True, "Strict", 600, 3600)
    bad = subprocess.run([sys.executable, "-c", SETTINGS_PROBE], cwd=ROOT,
                         env=_env({"STEWARD_COOKIE_SAMESITE": "None"}), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "STEWARD_COOKIE_SAMESITE" in bad.stderr


# --- the console session, in-process ----------------------------------------------------------


@pytest.fixture
def member(make_member):
    return make_member("steward", "sam")


def _login(client) -> None:
    response = client.post("/login/", {"username": "sam", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/", response.content[:300]


def _logged_in(client) -> bool:
    response = client.get("/")
    if response.status_code == 302:
        assert response["Location"].startswith("/login/")
        return False
    assert response.status_code == 200
    return True


def test_session_cookie_attributes_over_https(client, member, settings):
    """Behind the TLS front: the session and CSRF cookies are Secure, HttpOnly, SameSite=Lax,
    and the session cookie lives for the idle period."""
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = True
    settings.SECURE_HSTS_SECONDS = 31536000  # read by SecurityMiddleware when it is built
    page = client.get("/login/", headers={"x-forwarded-proto": "https"})
    csrf = page.cookies[settings.CSRF_COOKIE_NAME]
    assert csrf["secure"] and csrf["httponly"] and csrf["samesite"] == "Lax"
    response = client.post("/login/", {"username": "sam", "password": PASSWORD},
                           headers={"x-forwarded-proto": "https"})
    assert response.status_code == 302
    cookie = response.cookies[settings.SESSION_COOKIE_NAME]
    assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Lax"
    assert int(cookie["max-age"]) == settings.SESSION_COOKIE_AGE == 1800
    # HSTS is sent over HTTPS (only), with subdomains and preload.
    assert "Strict-Transport-Security" not in client.get("/")
    assert client.get("/", headers={"x-forwarded-proto": "https"}
                      )["Strict-Transport-Security"] == (
        "max-age=31536000; includeSubDomains; preload")


def test_idle_timeout_is_renewed_by_activity_and_ends_the_session(client, member):
    _login(client)
    key = client.session.session_key
    first = Session.objects.get(session_key=key).expire_date
    time.sleep(0.05)
    assert _logged_in(client)
    renewed = Session.objects.get(session_key=key).expire_date
    assert renewed > first  # every request pushes the idle deadline forward
    assert renewed - timezone.now() <= timedelta(seconds=1800)
    # No request for longer than the idle period: the session is gone.
    Session.objects.filter(session_key=key).update(
        expire_date=timezone.now() - timedelta(seconds=1))
    assert not _logged_in(client)


def test_absolute_timeout_ends_even_an_active_session(client, member, settings):
    _login(client)
    stamped = client.session[LOGIN_AT_KEY]
    assert abs(stamped - time.time()) < 60  # stamped at login
    limit = settings.STEWARD_SESSION_ABSOLUTE_SECONDS
    assert limit == 12 * 3600

    def started(seconds_ago: float) -> None:
        session = client.session
        session[LOGIN_AT_KEY] = time.time() - seconds_ago
        session.save()

    started(limit - 120)  # active for almost the whole lifetime: still in
    assert _logged_in(client)
    started(limit + 1)  # past it: logged out on the next request, however recent
    assert not _logged_in(client)
    assert not _logged_in(client)  # and stays out (the session was flushed)
    # Logging in again starts a new lifetime.
    _login(client)
    assert _logged_in(client)
    assert time.time() - client.session[LOGIN_AT_KEY] < 60


def test_absolute_timeout_stamps_sessions_without_a_login_time(client, member, settings):
    """A session from before the middleware (or a login the signal did not see) gets its
    clock started at its first request instead of living for ever; a forged future stamp is
    not trusted either."""
    client.force_login(member)
    session = client.session
    session.pop(LOGIN_AT_KEY, None)
    session.save()
    assert _logged_in(client)
    assert abs(client.session[LOGIN_AT_KEY] - time.time()) < 60
    session = client.session
    session[LOGIN_AT_KEY] = time.time() + 10 * 24 * 3600
    session.save()
    assert _logged_in(client)
    assert client.session[LOGIN_AT_KEY] <= time.time()
    settings.STEWARD_SESSION_ABSOLUTE_SECONDS = 1
    time.sleep(1.1)
    assert not _logged_in(client)
