"""The console in real headless Chromium (tests/browser.py), against the live server, with data
captured through the real proxy by the official openai client."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def capture_through_proxy(steward_proxy, proxy_key, messages: list[str], **headers: str
                          ) -> list[str]:
    """Each message as one call through the proxy; ship the spool and build the steps the way
    the shipper and the Celery task do. Returns the trajectory ids."""
    import openai

    from governance.tasks import build_steps
    from proxy.shipper import ship_once
    from tests.live import master_key

    client = openai.OpenAI(base_url=steward_proxy.base_url, api_key=proxy_key.secret,
                           max_retries=0)
    ids = []
    for text in messages:
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": text}],
            extra_headers=headers or None)
        ids.append(raw.headers["x-steward-trajectory"])
    steward_proxy.wait_for_records(len(messages))
    steward_proxy.stop()  # closes the segment so shipping takes it
    shipped: list[int] = []
    ship_once(steward_proxy.spool_dir, master_key=master_key(), enqueue=shipped.extend)
    assert len(shipped) == len(messages)
    build_steps(shipped)
    return ids


def test_login_and_read_a_trajectory_captured_through_the_proxy(
        console, steward_proxy, proxy_key, make_member):
    steward = make_member("steward", "sam-steward")
    [trajectory_id] = capture_through_proxy(
        steward_proxy, proxy_key, ["My email is jane.doe@example.com; where is my parcel?"])

    cp = console(steward)
    page = cp.page
    assert page.get_by_role("navigation", name="Main").get_by_role(
        "link", name="Trajectories").is_visible()
    cp.shot("overview")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Trajectories").click()
    page.wait_for_url("**/trajectories/**")
    row_link = page.locator(f"a[href='/trajectories/{trajectory_id}/']")
    assert row_link.count() == 1
    cp.shot("trajectories")
    row_link.click()
    page.wait_for_url(f"**/trajectories/{trajectory_id}/")
    body = page.locator("main").inner_text()
    assert "where is my parcel?" in body
    assert "jane.doe@example.com" not in body  # the steward reads the sanitized step only
    cp.shot("trajectory")
    cp.assert_clean()
