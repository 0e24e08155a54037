"""Settings for the test suite (pytest-django loads this module; see pyproject.toml).

With DATABASE_URL set (.ci/run, a developer's server) this is config.settings unchanged. With
it unset — a fresh machine, nothing running — the suite starts the embedded test PostgreSQL
(config/embedded.py, var/pg-test) and runs on it as its superuser, the role pytest-django needs
to create the test database; with CELERY_BROKER_URL unset too, Celery's broker is kombu's
SQLAlchemy transport in that server's own broker database. Both are exported to os.environ, not
only to the settings, so every process a test starts (proxy, shipper, Celery worker, manage.py)
talks to the same server and broker.
"""

from __future__ import annotations

import os
from pathlib import Path

if not os.environ.get("DATABASE_URL"):
    from config.embedded import TEST_BROKER_DATABASE, test_server_url

    _var = Path(os.environ.get("STEWARD_VAR_DIR") or Path(__file__).resolve().parent.parent / "var")
    os.environ["DATABASE_URL"] = test_server_url(_var)
    os.environ.pop("DATABASE_OWNER_URL", None)  # the embedded appliance's owner role is not here
    if not os.environ.get("CELERY_BROKER_URL"):
        _server = os.environ["DATABASE_URL"].rsplit("/", 1)[0]
        os.environ["CELERY_BROKER_URL"] = (
            f"sqla+{_server.replace('postgresql://', 'postgresql+psycopg://')}/"
            f"{TEST_BROKER_DATABASE}")

from config.settings import *  # noqa: E402, F403

# The test suite's one cross-tenant path (governance.tenancy._unscoped_test_caller): a tenant
# model's manager used outside any scope by code in tests/ (fixtures, assertions) reads across
# tenants instead of raising; product code the tests call still needs its scope. Defined here
# only, never from the environment: production settings have no such path.
STEWARD_UNSCOPED_TEST_CALLERS = (str(Path(__file__).resolve().parent.parent / "tests") + os.sep,)

# No detection cache shared between the suite's processes (or kept from an earlier run: the
# test master key is fixed), so what a test counts as analysed is what it sent; the tests of
# SharedDetections give it a directory of their own.
STEWARD_DETECTION_CACHE_DIR = os.environ.get("STEWARD_TEST_DETECTION_CACHE_DIR", "")
