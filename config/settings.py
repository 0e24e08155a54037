"""Steward settings: one file, every value from the environment (see deploy/steward.env.sample)."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from wire import env

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("STEWARD_VAR_DIR", BASE_DIR / "var"))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool = False) -> bool:
    """A yes/no setting. Unset or empty keeps the default; anything outside the two spellings
    is refused rather than read as "no", so a typo such as STEWARD_DEBUG=ture cannot silently
    switch a safety setting the other way."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={os.environ[name]!r} is not a yes/no value: use one of "
        f"{', '.join(sorted(_TRUE))} or {', '.join(sorted(_FALSE))}"
    )


def env_int(name: str, default: int) -> int:
    return env.env_int(name, default, ImproperlyConfigured)


def env_float(name: str, default: float) -> float:
    return env.env_float(name, default, ImproperlyConfigured)


DEBUG = env_bool("STEWARD_DEBUG", False)
# The embedded appliance generates a secret under var/ on first start; production sets it.
# The fallback's "django-insecure-" prefix makes `manage.py check --deploy` flag it
# (security.W009) if a deployment forgot to set one.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or os.environ.get(
    "STEWARD_SECRET_KEY", "django-insecure-steward-dev-key-set-DJANGO_SECRET_KEY-in-production"
)
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("STEWARD_ALLOWED_HOSTS", "*").split(",") if h]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("STEWARD_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "drf_spectacular",
    "django_htmx",
    "axes",
    "governance",
    "trainer",
    "evolution",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "governance.input_checks.QueryStringCheckMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "governance.session_timeout.AbsoluteSessionTimeoutMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "governance.middleware.TenantMiddleware",
    # Last, as django-axes asks: answers a locked-out login with its page (429).
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "governance.views.common.console_nav",
            ],
        },
    },
]


def _database_urls() -> tuple[str, str]:
    """(DATABASE_URL, DATABASE_OWNER_URL). The services connect as the app role (not the
    owner, NOBYPASSRLS: row-level security applies); `manage.py migrate` runs as the owner when
    DATABASE_OWNER_URL is set (governance/management/commands/migrate.py)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url, os.environ.get("DATABASE_OWNER_URL", "")
    # No server configured: the embedded PostgreSQL under var/, which has both roles
    # (steward_app and steward_owner; config/embedded.py). It is started by the first database
    # connection (config/embedded_backend), not here, so commands that need no database
    # don't start it.
    from config.embedded import expected_database_urls

    app, owner = expected_database_urls(VAR_DIR)
    return app, os.environ.get("DATABASE_OWNER_URL") or owner


DATABASE_URL, DATABASE_OWNER_URL = _database_urls()
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
if not os.environ.get("DATABASE_URL"):
    DATABASES["default"]["ENGINE"] = "config.embedded_backend"
DATABASES["default"]["TEST"] = {"NAME": os.environ.get("STEWARD_TEST_DATABASE", "test_steward")}
# Tests only: a role every tenant/system/request scope assumes for its transaction (see
# governance/tenancy.py). Production leaves it empty: DATABASE_URL's own role applies.
STEWARD_DB_SCOPE_ROLE = os.environ.get("STEWARD_DB_SCOPE_ROLE", "")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Console login throttling (django-axes; governance/login_throttle.py audits the lockouts):
# STEWARD_LOGIN_FAILURE_LIMIT wrong passwords for one username from one client address lock
# that pair for STEWARD_LOGIN_LOCKOUT_MINUTES; a successful login resets the count.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("STEWARD_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("STEWARD_LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "console/login_locked.html"
AXES_CLIENT_IP_CALLABLE = "governance.login_throttle.client_ip"
# Behind deploy/nginx.conf set to 1: the client address is the last X-Forwarded-For entry.
STEWARD_TRUSTED_PROXY_HOPS = env_int("STEWARD_TRUSTED_PROXY_HOPS", 0)
# axes keeps failed attempts (to count them) but no log of every login: the audit log and the
# session are the record, and a per-login log of addresses and user agents is not needed.
AXES_DISABLE_ACCESS_LOG = True
AXES_ENABLE_ACCESS_FAILURE_LOG = False
AXES_VERBOSE = False
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["governance.auth.ApiTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON with DRF's own parser plus refusals of hostile strings and nesting
    # (governance/input_checks.py); forms as DRF's defaults.
    "DEFAULT_PARSER_CLASSES": ["governance.input_checks.StrictJSONParser",
                               "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.CursorPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_FILTER_BACKENDS": [],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Steward API",
    "DESCRIPTION": "Governed capture of LLM agent traffic: trajectories (ATDP v1), rewards, "
    "erasure, datasets, approvals and training.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The OpenAPI document maps every operation and field: served to an API token only (the
    # REST authentication above), like the API it describes.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # Several models have a `status`: name each choice set after its model, not a hash.
    "ENUM_NAME_OVERRIDES": {
        "DatasetVersionStatusEnum": "governance.models.DatasetVersion.Status",
        "CheckpointStatusEnum": "trainer.models.Checkpoint.Status",
        "TrainingJobStatusEnum": "trainer.models.TrainingJob.Status",
        "ErasureRequestStatusEnum": "governance.models.ErasureRequest.Status",
    },
}

# --- Celery -----------------------------------------------------------------------------
# No broker configured: kombu's SQLAlchemy transport on the same PostgreSQL (no extra server).
# It creates its own tables (kombu_queue, kombu_message; no tenant data) on first use, which the
# app role may not do, so it connects as the owner when DATABASE_OWNER_URL is known.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or re.sub(
    r"^postgres(ql)?(\+\w+)?://", "sqla+postgresql+psycopg://",
    DATABASE_OWNER_URL or DATABASE_URL
)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "capture"
CELERY_TASK_ROUTES = {
    "governance.tasks.build_steps": {"queue": "capture"},
    "governance.tasks.build_pending_steps": {"queue": "capture"},
    "governance.tasks.purge_expired": {"queue": "capture"},
    "governance.tasks.ensure_partitions": {"queue": "capture"},
    "governance.erasure.erase_subject": {"queue": "capture"},
    "governance.erasure.resume_erasures": {"queue": "capture"},
    "trainer.tasks.run_training_job": {"queue": "gpu"},
    "evolution.tasks.run_gates": {"queue": "gpu"},
    "evolution.tasks.push_candidate_weights": {"queue": "gpu"},
    "evolution.tasks.advance_evolution": {"queue": "capture"},
}
CELERY_TASK_ALWAYS_EAGER = env_bool("STEWARD_CELERY_EAGER", False)
CELERY_BEAT_SCHEDULE: dict = {
    # Picks up interactions whose build_steps message was lost (e.g. broker restart).
    "build-pending-steps": {"task": "governance.tasks.build_pending_steps", "schedule": 60.0},
    # Retention: bounded batches, one audit event per batch.
    "purge-expired": {"task": "governance.tasks.purge_expired", "schedule": 3600.0},
    # Monthly time partitions of interactions, steps and findings, created two months ahead
    # (a missed month still works: rows go to the DEFAULT partition and are moved later).
    "ensure-partitions": {"task": "governance.tasks.ensure_partitions", "schedule": 21600.0},
    # Re-sends jobs left in "queued" (launch enqueues on commit; a broker outage loses it).
    "enqueue-queued-training-jobs": {"task": "trainer.tasks.enqueue_queued_jobs",
                                     "schedule": 300.0},
    # Erasure requests whose message was lost or whose worker died.
    "resume-erasures": {"task": "governance.erasure.resume_erasures", "schedule": 60.0},
    # The evolution control plane (issue 7), one tick: canary routes promoted / rolled back
    # from the arms' rewards, then the candidates follow those decisions in the same tick.
    "advance-evolution": {"task": "evolution.tasks.advance_evolution", "schedule": 30.0},
}

# --- Steward ----------------------------------------------------------------------------
STEWARD_WEB_PORT = env_int("STEWARD_WEB_PORT", 8000)
STEWARD_PROXY_PORT = env_int("STEWARD_PROXY_PORT", 8080)
STEWARD_UPSTREAM_URL = os.environ.get("STEWARD_UPSTREAM_URL", "")
STEWARD_SPOOL_DIR = Path(os.environ.get("STEWARD_SPOOL_DIR", VAR_DIR / "spool"))
# How long an erasure waits for the local spool's segments to be shipped (governance/erasure.py).
STEWARD_ERASURE_SPOOL_WAIT_S = env_float("STEWARD_ERASURE_SPOOL_WAIT_S", 60.0)
# Detection results shared by the host's worker processes (governance/sanitizing.py,
# SharedDetections; decision 43): a disk cache of offsets and types under keyed digests, never
# text. Empty disables it (each process then keeps only its own).
STEWARD_DETECTION_CACHE_DIR = os.environ.get("STEWARD_DETECTION_CACHE_DIR",
                                             str(VAR_DIR / "detection-cache"))
STEWARD_DETECTION_CACHE_MB = env_float("STEWARD_DETECTION_CACHE_MB", 256.0)
STEWARD_DETECTION_CACHE_SECONDS = env_float("STEWARD_DETECTION_CACHE_SECONDS", 3600.0)
# Master key (base64, 32 bytes) wraps every data key; from the env or a file.
STEWARD_MASTER_KEY = os.environ.get("STEWARD_MASTER_KEY", "")
STEWARD_MASTER_KEY_FILE = os.environ.get("STEWARD_MASTER_KEY_FILE", str(VAR_DIR / "master.key"))
# Keyed-hash secret for subject identifiers (erasure index). Defaults to one derived from the
# master key so a single secret is enough for the embedded appliance.
STEWARD_RAW_RETENTION_DAYS = env_int("STEWARD_RAW_RETENTION_DAYS", 7)
STEWARD_HARNESS_VERSION = "steward-proxy/0.1"
# SGLang serving the policy on a GPU host (deploy/sglang/launch.sh): promotion and rollback
# push the chosen checkpoint to it. Training never does (its engines are
# STEWARD_ROLLOUT_ENGINES).
STEWARD_SGLANG_URL = os.environ.get("STEWARD_SGLANG_URL", "")
STEWARD_SGLANG_API_KEY = os.environ.get("STEWARD_SGLANG_API_KEY", "")
# An SGLang serving the candidate arm of a weight canary (evolution/services.py).
STEWARD_SGLANG_CANARY_URL = os.environ.get("STEWARD_SGLANG_CANARY_URL", "")
STEWARD_UPSTREAM_API_KEY = os.environ.get("STEWARD_UPSTREAM_API_KEY", "").strip()
# The operator's engines (wire/engines.py): the only URLs a candidate, a baseline, a canary
# route or a training job may name. "name=url" pairs; each one's credential is
# STEWARD_ENGINE_<NAME>_API_KEY. Rollout engines never serve agents.
STEWARD_ENGINE_ALLOWLIST = os.environ.get("STEWARD_ENGINE_ALLOWLIST", "")
STEWARD_ROLLOUT_ENGINES = os.environ.get("STEWARD_ROLLOUT_ENGINES", "")
# A running training job whose heartbeat (every step) is older than this lost its worker: a
# redelivered message takes it over, and cancelling it ends it at once (trainer/services.py).
STEWARD_TRAIN_STALE_SECONDS = env_int("STEWARD_TRAIN_STALE_SECONDS", 900)
# Load the sanitizer when a worker starts (governance/tasks.py); 0 defers it to the first batch.
STEWARD_SANITIZER_PRELOAD = env_bool("STEWARD_SANITIZER_PRELOAD", True)
# CPU priority the workers yield to the proxy and the console (os.nice increment when a worker
# starts, decision 53): background building catches up once the cores are free. 0: none.
STEWARD_WORKER_NICE = env_int("STEWARD_WORKER_NICE", 10)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("STEWARD_LOG_LEVEL", "INFO")},
    # pgserver logs every start, attach and pg_ctl call at INFO: noise in every command.
    "loggers": {"django.db.backends": {"level": "WARNING"}, "pgserver": {"level": "WARNING"},
                # Presidio logs a line at INFO for every string it analyses (the worker runs
                # at INFO): several lines per captured call.
                "presidio-analyzer": {"level": "WARNING"}},
}

# --- HTTPS, cookies, sessions ---------------------------------------------------------------
# `steward up` serves plain http://127.0.0.1, so nothing here may require HTTPS by default.
# Production sits behind the nginx TLS front (deploy/nginx.conf) and sets
# STEWARD_BEHIND_TLS_PROXY=1: the scheme then arrives in X-Forwarded-Proto, and HTTPS-only
# cookies, the HTTPS redirect and HSTS default to on (each can still be turned off alone).
# `manage.py check --deploy` is clean with that (tests/test_deploy_check.py).
BEHIND_TLS_PROXY = env_bool("STEWARD_BEHIND_TLS_PROXY", False)
if BEHIND_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("STEWARD_SSL_REDIRECT", BEHIND_TLS_PROXY)
# HSTS is only sent over HTTPS. One year, subdomains and preload once TLS is configured; 0
# turns it off (e.g. while trying TLS out: browsers remember the header for its lifetime).
SECURE_HSTS_SECONDS = env_int("STEWARD_HSTS_SECONDS", 31_536_000 if BEHIND_TLS_PROXY else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("STEWARD_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("STEWARD_HSTS_PRELOAD", True)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

# Cookies: never readable by scripts (the console sends the CSRF token from the page, see
# templates/base.html), not sent on cross-site subrequests, HTTPS-only when so configured.
SECURE_COOKIES = env_bool("STEWARD_SECURE_COOKIES", BEHIND_TLS_PROXY)
_SAMESITE = os.environ.get("STEWARD_COOKIE_SAMESITE", "Lax").strip().capitalize()
if _SAMESITE not in {"Lax", "Strict"}:
    raise ValueError("STEWARD_COOKIE_SAMESITE must be Lax or Strict")
SESSION_COOKIE_SECURE = SECURE_COOKIES
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = _SAMESITE
CSRF_COOKIE_SECURE = SECURE_COOKIES
CSRF_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = _SAMESITE

# Console sessions end after STEWARD_SESSION_IDLE_SECONDS without a request (the cookie's
# expiry is pushed forward on every request) and, whatever the activity, after
# STEWARD_SESSION_ABSOLUTE_SECONDS since login (governance/session_timeout.py).
SESSION_COOKIE_AGE = env_int("STEWARD_SESSION_IDLE_SECONDS", 30 * 60)
SESSION_SAVE_EVERY_REQUEST = True
STEWARD_SESSION_ABSOLUTE_SECONDS = env_int("STEWARD_SESSION_ABSOLUTE_SECONDS", 12 * 3600)
