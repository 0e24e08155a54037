"""The tenant manager scopes by itself (governance.tenancy.TenantManager): Model.objects on a
tenant model filters by the current scope's tenant, and raises outside any scope."""

from __future__ import annotations

import pytest

from governance.models import Agent
from governance.tenancy import TenantScopeError, system_context, tenant_context


@pytest.fixture
def agents(tenant, other_tenant):
    with tenant_context(tenant):
        Agent.objects.create(tenant=tenant, name="a-agent")
    with tenant_context(other_tenant):
        Agent.objects.create(tenant=other_tenant, name="g-agent")


@pytest.mark.django_db
def test_unscoped_read_raises_naming_the_model(agents, settings):
    settings.STEWARD_UNSCOPED_TEST_CALLERS = ()  # as in production
    with pytest.raises(TenantScopeError, match="Agent"):
        Agent.objects.all()


@pytest.mark.django_db
def test_unscoped_product_code_raises_even_in_the_test_suite(agents, tenant):
    from governance.views.datasets import agent_names  # product code, called without a scope

    with pytest.raises(TenantScopeError, match="Agent"):
        agent_names(tenant)
    with tenant_context(tenant):
        assert list(agent_names(tenant).values()) == ["a-agent"]


@pytest.mark.django_db
def test_a_tenant_scope_sees_only_its_rows(agents, tenant, other_tenant):
    with tenant_context(tenant):
        assert [a.name for a in Agent.objects.all()] == ["a-agent"]
        assert [a.name for a in tenant.agents.all()] == ["a-agent"]  # reverse relation
        assert not Agent.objects.for_tenant(other_tenant).exists()
    with tenant_context(other_tenant):
        assert [a.name for a in Agent.objects.all()] == ["g-agent"]


@pytest.mark.django_db
def test_system_scope_sees_all(agents):
    with system_context("test: the system scope reads across tenants"):
        assert sorted(Agent.objects.values_list("name", flat=True)) == ["a-agent", "g-agent"]


@pytest.mark.django_db
def test_writing_another_tenants_row_inside_a_scope_is_refused(agents, tenant, other_tenant):
    with tenant_context(tenant):
        with pytest.raises(TenantScopeError):
            Agent.objects.create(tenant=other_tenant, name="smuggled")
        with pytest.raises(TenantScopeError):
            Agent.objects.bulk_create([Agent(tenant=other_tenant, name="smuggled")])
        with pytest.raises(TenantScopeError):
            Agent.objects.filter(name="a-agent").update(tenant=other_tenant)
    assert not Agent.objects.filter(name="smuggled").exists()


@pytest.mark.django_db
def test_the_test_allowance_reads_across_tenants(agents):
    # The test suite's own named path (config/test_settings.py): fixtures and assertions.
    assert Agent.objects.count() == 2
