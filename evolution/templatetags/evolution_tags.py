"""Template helpers of the evolution pages, for sections they add to other areas' templates
(the checkpoint page's "Evolution" section) without changing those areas' views."""

from __future__ import annotations

from typing import Any

from django import template

from governance.views.common import can

register = template.Library()


@register.simple_tag(takes_context=True)
def can_do(context: Any, permission: str) -> bool:
    """{% can_do "manage_evolution" as allowed %}: the person's role in the console tenant
    grants the permission."""
    request = context.get("request")
    return bool(request is not None and can(request, permission))
