"""Tenancy's second wall: the PostgreSQL row-level security (RLS) context of each transaction.

Every table with tenant data (a foreign key to Tenant) has RLS ENABLEd and FORCEd (migration
0004) with one policy, `tenant_isolation`:

    tenant_id = nullif(current_setting('steward.tenant_id', true), '')::bigint
    OR current_setting('steward.system', true) = 'on'

and the services connect as a role that owns nothing and has NOBYPASSRLS. So a query sees (and
may write) only the rows of the tenant set for its transaction; with no tenant set it sees
nothing. The first wall (TenantQuerySet.for_tenant, TenantScopedViewSet) stays: RLS is what still
holds when a filter is forgotten.

The settings are only ever set transaction-locally (set_config(..., true)): they end with the
transaction, so a pooled or persistent connection never carries a tenant into the next one.
Python keeps the matching stack of scopes per connection, so nested scopes restore the outer one
and a scope for tenant B inside one for tenant A is refused (TenantScopeError) instead of
silently switching.

The ways in (each one opens, or joins, a transaction):
- `tenant_context(tenant)`: Celery tasks, the shipper (one per tenant group, several in one
  transaction), retention batches, services (`tenant_atomic`), management commands.
- `request_scope(...)` + `set_request_tenant(...)`: one transaction per web request, opened by
  governance.middleware.TenantMiddleware with the console tenant, switched by
  governance.auth.ApiTokenAuthentication to the API token's tenant.
- `system_context(reason)`: reads across tenants. Used by the audit chain verifier (it
  hashes the one chain of all tenants, and records its checkpoint) and by the audit of a
  console login lockout for a username that is no account (a tenant-less event,
  governance/login_throttle.py); see docs/decisions.md.
- SECURITY DEFINER functions (migration 0004) for the narrow cross-tenant lookups that happen
  before a tenant is known: the API token (`steward_api_token_lookup`), a user's memberships
  (`steward_user_memberships`), the audit chain head (`steward_audit_head`), the tenants of
  interaction ids (`steward_interaction_tenants`) and the proxy's key table
  (`steward_proxy_keys`).

`STEWARD_DB_SCOPE_ROLE` (settings; tests only): a role every scope also assumes
(set_config('role', ...) locally). The test suite connects as the superuser that created the test
database and sets it to the NOBYPASSRLS app role, so everything run inside a scope is subject to
RLS and the app role's grants exactly as in production, while fixtures and assertions outside
any scope keep working as the superuser. Production leaves it empty: the connection's own role
(DATABASE_URL) applies.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.models import signals

TENANT_SETTING = "steward.tenant_id"
SYSTEM_SETTING = "steward.system"
POLICY_NAME = "tenant_isolation"

F = TypeVar("F", bound=Callable[..., Any])


class TenantScopeError(RuntimeError):
    """A scope was entered that would mix tenants (or a request scope is missing)."""


@dataclass(frozen=True)
class Scope:
    kind: str  # "tenant" | "system" | "anonymous" (a request without a tenant yet)
    tenant_id: int | None = None
    request: bool = False  # opened by request_scope: set_request_tenant may replace it
    reason: str = ""


def _tenant_id(tenant: Any) -> int:
    value = tenant if isinstance(tenant, int) else getattr(tenant, "pk", tenant)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a tenant or tenant id is needed, got {tenant!r}")
    return value


def _stack(using: str = DEFAULT_DB_ALIAS) -> list[Scope]:
    conn = connections[using]
    stack = getattr(conn, "_steward_scopes", None)
    if stack is None:
        stack = []
        conn._steward_scopes = stack
    return stack


def current_scope(using: str = DEFAULT_DB_ALIAS) -> Scope | None:
    """The innermost active scope on this thread's connection, None outside any."""
    stack = _stack(using)
    return stack[-1] if stack else None


def _apply(scope: Scope | None, using: str = DEFAULT_DB_ALIAS) -> None:
    """Make the database's transaction-local settings match `scope` (None: no scope)."""
    conn = connections[using]
    tenant = str(scope.tenant_id) if scope is not None and scope.tenant_id is not None else ""
    system = "on" if scope is not None and scope.kind == "system" else "off"
    sql = "SELECT set_config(%s, %s, true), set_config(%s, %s, true)"
    params: list[Any] = [TENANT_SETTING, tenant, SYSTEM_SETTING, system]
    role = getattr(settings, "STEWARD_DB_SCOPE_ROLE", "") or ""
    if role:
        sql += ", set_config('role', %s, true)"
        params.append(role if scope is not None else "none")
    with conn.cursor() as cursor:
        cursor.execute(sql, params)


@contextmanager
def _scoped(scope: Scope, using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    stack = _stack(using)
    with transaction.atomic(using=using):
        outer = stack[-1] if stack else None
        _apply(scope, using)
        stack.append(scope)
        try:
            yield
        except BaseException:
            # The atomic block rolls back (to its savepoint), which also restores the outer
            # transaction-local settings; only Python's view needs unwinding.
            _pop(stack)
            raise
        _pop(stack)
        # Marked for rollback (a view's database error answered as a 500): the rollback
        # restores the outer settings, and any SQL now would raise on top of the real error.
        if not transaction.get_rollback(using):
            _apply(outer, using)


def _pop(stack: list[Scope]) -> None:
    # set_request_tenant may have replaced our entry in place: pop whatever sits at our level.
    if stack:
        stack.pop()


@contextmanager
def tenant_context(tenant: Any, using: str = DEFAULT_DB_ALIAS) -> Iterator[int]:
    """Run the block in a transaction (a savepoint when nested) that sees only `tenant`'s rows.
    Allowed inside nothing, a system scope, an anonymous request or the same tenant; inside
    another tenant's scope it raises TenantScopeError."""
    tid = _tenant_id(tenant)
    outer = current_scope(using)
    if outer is not None and outer.kind == "tenant" and outer.tenant_id != tid:
        raise TenantScopeError(f"tenant {tid} requested inside the scope of tenant "
                               f"{outer.tenant_id}")
    with _scoped(Scope("tenant", tid), using):
        yield tid


@contextmanager
def system_context(reason: str, using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Run the block in a transaction that reads and writes across tenants. Trusted code paths
    only, each one listed in docs/decisions.md (today: the audit chain verifier)."""
    if not reason:
        raise ValueError("a system context states why it is needed")
    with _scoped(Scope("system", reason=reason), using):
        yield


@contextmanager
def request_scope(tenant: Any = None, using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """The web request's transaction: scoped to `tenant` (the console's choice) or to nothing
    until authentication names one (set_request_tenant)."""
    scope = (Scope("tenant", _tenant_id(tenant), request=True) if tenant is not None
             else Scope("anonymous", request=True))
    with _scoped(scope, using):
        yield


def request_scope_active(using: str = DEFAULT_DB_ALIAS) -> bool:
    """True when the innermost scope is a web request's (set_request_tenant may switch it)."""
    scope = current_scope(using)
    return scope is not None and scope.request and connections[using].in_atomic_block


def set_request_tenant(tenant: Any, using: str = DEFAULT_DB_ALIAS) -> int:
    """Switch the current web request's transaction to `tenant` (API token authentication).
    Only the request scope itself may be switched: inside any nested scope this raises."""
    tid = _tenant_id(tenant)
    stack = _stack(using)
    if not request_scope_active(using):
        raise TenantScopeError("no request scope is active: governance.middleware."
                               "TenantMiddleware must wrap every request")
    stack[-1] = Scope("tenant", tid, request=True)
    _apply(stack[-1], using)
    return tid


def tenant_atomic(path: str) -> Callable[[F], F]:
    """Decorator for services: run the function inside tenant_context() of the tenant found
    at `path` among its arguments, e.g. "tenant", "key.tenant_id", "version.tenant_id"."""
    head, *attrs = path.split(".")

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        if head not in signature.parameters:
            raise TypeError(f"{fn.__name__} has no parameter {head!r}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = signature.bind_partial(*args, **kwargs).arguments[head]
            for attr in attrs:
                value = getattr(value, attr)
            with tenant_context(value):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


# --- the scoped manager: the first wall, applied by the ORM itself ---------------------------
#
# `Model.objects` on every tenant model (TenantManager) reads the scope above when it makes a
# queryset (get_queryset: `Model.objects.filter(...)`, `.all()`, reverse relations such as
# `trajectory.steps`, prefetch_related, DRF and admin alike):
#   tenant scope    -> `tenant_id = <the scope's tenant>`
#   system scope    -> every tenant (the scope names its reason)
#   anonymous scope -> no rows (a request not yet authenticated; RLS would show none either)
#   no scope        -> TenantScopeError naming the model
# It is checked when the queryset is made, not when it is evaluated, so the traceback points at
# the line that forgot its scope, and a queryset made inside a scope keeps that scope's filter.
# Forward foreign keys (`step.trajectory`) and Model.save()'s UPDATE use Django's
# `_base_manager` (a plain Manager, deliberately left alone: Django needs it unfiltered to reach
# related rows of a row already read in scope); RLS still holds there. Writes are checked too:
# a row saved or bulk-created inside a tenant scope must carry that tenant.
# Historical models in migrations get a plain manager (use_in_migrations stays False), so data
# migrations are not affected.


def _unscoped_test_caller() -> bool:
    """True when the code asking for a queryset outside any scope is the test suite's own
    (fixtures, assertions), not product code it calls: the one cross-tenant path for tests.
    STEWARD_UNSCOPED_TEST_CALLERS is defined by config/test_settings.py only (never read
    from the environment), so production has no such path."""
    roots = getattr(settings, "STEWARD_UNSCOPED_TEST_CALLERS", ())
    if not roots:
        return False
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PROJECT_ROOT) and not filename.startswith(_LIBRARY_FILES):
            return filename.startswith(tuple(roots))
        frame = frame.f_back
    return False


_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep
# The project's own files the walk skips to find the caller: this module and the models that
# declare the manager (and the virtual environment, when it lives in the project).
_LIBRARY_FILES = (__file__, str(Path(__file__).with_name("models.py")),
                  _PROJECT_ROOT + ".venv" + os.sep)


def require_scope(model: type, using: str = DEFAULT_DB_ALIAS) -> Scope | None:
    """The scope a query on a tenant model runs under; raises TenantScopeError outside any
    scope (None: the test suite's own unscoped access, see _unscoped_test_caller)."""
    scope = current_scope(using)
    if scope is None and not _unscoped_test_caller():
        raise TenantScopeError(
            f"{model.__name__} is tenant data, read outside any tenant scope: open "
            "tenant_context(tenant), or system_context(reason) for a named cross-tenant path "
            "(governance/tenancy.py)")
    return scope


def check_write(instance: Any, using: str = DEFAULT_DB_ALIAS) -> None:
    """Refuse to write a row of another tenant than the current tenant scope's."""
    scope = require_scope(type(instance), using)
    if scope is None or scope.kind == "system":
        return
    if scope.kind != "tenant" or instance.tenant_id != scope.tenant_id:
        raise TenantScopeError(
            f"{type(instance).__name__} of tenant {instance.tenant_id} written inside the scope "
            f"of {'tenant ' + str(scope.tenant_id) if scope.tenant_id else 'no tenant'}")


class TenantQuerySet(models.QuerySet):
    def for_tenant(self, tenant: Any) -> TenantQuerySet:
        """Narrow to one tenant: a no-op inside that tenant's scope, the way a system scope
        works on one tenant's rows, and nothing at all inside another tenant's scope."""
        return self.filter(tenant_id=_tenant_id(tenant))

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list:
        objs = list(objs)
        for obj in objs:  # bulk_create sends no pre_save signal
            check_write(obj, self.db)
        return super().bulk_create(objs, *args, **kwargs)

    def update(self, **kwargs: Any) -> int:
        if "tenant" in kwargs or "tenant_id" in kwargs:
            raise TenantScopeError(f"{self.model.__name__}: a row never moves to another tenant")
        return super().update(**kwargs)


class TenantManager(models.Manager.from_queryset(TenantQuerySet)):  # type: ignore[misc]
    """The default manager of every tenant model: querysets filtered by the current scope."""

    def get_queryset(self) -> TenantQuerySet:
        qs = super().get_queryset()
        scope = require_scope(self.model, self.db)
        if scope is None or scope.kind == "system":
            return qs
        if scope.kind == "tenant":
            return qs.filter(tenant_id=scope.tenant_id)
        return qs.none()

    def contribute_to_class(self, cls: type, name: str) -> None:
        super().contribute_to_class(cls, name)
        if not cls._meta.abstract:
            signals.pre_save.connect(_check_save, sender=cls, weak=False,
                                     dispatch_uid=f"steward-tenant-write-{cls._meta.label}")


def _check_save(sender: type, instance: Any, using: str = DEFAULT_DB_ALIAS, raw: bool = False,
                **kwargs: Any) -> None:
    if not raw:  # loaddata writes fixtures as they are
        check_write(instance, using)


# --- cross-tenant lookups (SECURITY DEFINER functions of migration 0004) --------------------


def _call(sql: str, params: list[Any], using: str = DEFAULT_DB_ALIAS) -> list[tuple]:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def api_token_lookup(key_hash: str) -> tuple[int, int, int, bool] | None:
    """(token id, tenant id, user id, revoked) of the API token with this hash, any tenant."""
    rows = _call("SELECT token_id, tenant_id, user_id, revoked "
                 "FROM steward_api_token_lookup(%s)", [key_hash])
    return rows[0] if rows else None


def user_memberships(user_id: int) -> list[dict[str, Any]]:
    """Every membership of a user, across tenants, with its tenant's slug and name."""
    cols = ["id", "user_id", "tenant_id", "role", "created_at", "tenant_slug", "tenant_name",
            "tenant_created_at"]
    rows = _call("SELECT membership_id, user_id, tenant_id, role, created_at, tenant_slug, "
                 "tenant_name, tenant_created_at FROM steward_user_memberships(%s)", [user_id])
    return [dict(zip(cols, row, strict=True)) for row in rows]


def audit_head() -> tuple[int, str] | None:
    """(seq, hash) of the last audit event of the one chain (all tenants)."""
    rows = _call("SELECT seq, hash FROM steward_audit_head()", [])
    return rows[0] if rows else None


def interaction_tenants(ids: list[int]) -> dict[int, int]:
    """interaction id -> tenant id, for routing a Celery batch to per-tenant scopes."""
    if not ids:
        return {}
    return dict(_call("SELECT id, tenant_id FROM steward_interaction_tenants(%s)",
                      [list(ids)]))


# --- roles and grants -----------------------------------------------------------------------

# Written to by the app role: everything in the schema, except these refusals.
APP_REVOKES = [
    # Append-only (migration 0003's triggers refuse too): the app role may only read and add.
    ("UPDATE, DELETE, TRUNCATE", "governance_auditevent"),
    ("UPDATE, TRUNCATE", "governance_reward"),
    # Only migrations (the owner) write the migration history.
    ("INSERT, UPDATE, DELETE, TRUNCATE", "django_migrations"),
]


def grant_app_privileges(cursor: Any, role: str) -> None:
    """Grant the app role what the services need on every table and sequence of the schema
    (run as the owner after each migrate, so new tables are covered), minus APP_REVOKES."""
    from psycopg import sql

    ident = sql.Identifier(role)
    cursor.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
    cursor.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public "
                           "TO {}").format(ident))
    cursor.execute(sql.SQL("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {}")
                   .format(ident))
    for privileges, table in APP_REVOKES:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
        if cursor.fetchone()[0]:
            cursor.execute(sql.SQL("REVOKE " + privileges + " ON {} FROM {}")  # noqa: S608
                           .format(sql.Identifier(table), ident))


def ensure_app_role(cursor: Any, role: str, login: bool = True) -> None:
    """Create the app role if it does not exist, and make sure it can never bypass RLS."""
    from psycopg import sql

    ident = sql.Identifier(role)
    cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
    if cursor.fetchone() is None:
        try:
            with transaction.atomic():
                cursor.execute(sql.SQL("CREATE ROLE {} " + ("LOGIN" if login else "NOLOGIN"))
                               .format(ident))
        except Exception as exc:  # created concurrently (roles are cluster-wide)
            if "already exists" not in str(exc):
                raise
    cursor.execute(sql.SQL("ALTER ROLE {} NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE")
                   .format(ident))


# The tenant policy's expression: rows of the transaction's tenant, or any in the system scope.
TENANT_RLS_EXPR = (f"tenant_id = nullif(current_setting('{TENANT_SETTING}', true), '')::bigint "
                   f"OR current_setting('{SYSTEM_SETTING}', true) = 'on'")


def tenant_rls_sql(table: str) -> tuple[str, str]:
    """(forward, reverse) SQL putting one table behind the tenant policy — for the migration of
    any new table with a tenant foreign key (tests/test_rls.py fails for a table without)."""
    expr = TENANT_RLS_EXPR
    forward = (f'ALTER TABLE "{table}" ENABLE ROW LEVEL SECURITY;\n'
               f'ALTER TABLE "{table}" FORCE ROW LEVEL SECURITY;\n'
               f'DROP POLICY IF EXISTS {POLICY_NAME} ON "{table}";\n'
               f'CREATE POLICY {POLICY_NAME} ON "{table}" USING ({expr}) WITH CHECK ({expr});')
    reverse = (f'DROP POLICY IF EXISTS {POLICY_NAME} ON "{table}";\n'
               f'ALTER TABLE "{table}" NO FORCE ROW LEVEL SECURITY;\n'
               f'ALTER TABLE "{table}" DISABLE ROW LEVEL SECURITY;')
    return forward, reverse
