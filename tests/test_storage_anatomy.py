"""tests/bench/storage_anatomy.py on sessions built by the real shipper and step builder: its
rows are the agent's rows, its parts add up to what it reports, an answer the agent sends back
is found as a reference to it (decision 62), and the opening (system prompt, tools) is found
as such."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.bench import storage_anatomy
from tests.pipeline import chat_response, make_record, ship_and_build

SYSTEM = {"role": "system", "content": "You look up customers for the bank's support desk."}
TOOLS = [{"type": "function", "function": {
    "name": "find_customer", "description": "Find a customer by name or email.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
ANSWER = "Found Maria Garcia (maria.garcia@example.com). Shall I open her account?"


@pytest.fixture
def agent(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "anatomy-bot")


@pytest.fixture
def bystander(tenant):
    from governance.services import ensure_agent

    return ensure_agent("system:test", tenant, "other-bot")


def session(tenant, agent, calls: int) -> list[dict]:
    """One conversation of `calls` calls, each sending back the answer it was given."""
    traj, t0 = str(uuid.uuid4()), time.time()
    history = [SYSTEM, {"role": "user", "content": "Who is maria.garcia@example.com?"}]
    records = []
    for i in range(calls):
        answer = f"{ANSWER} ({i})"
        records.append(make_record(
            tenant.pk, agent.pk, trajectory_id=traj, t=t0 + i,
            request={"model": "m", "messages": list(history), "tools": TOOLS},
            response=chat_response(answer)))
        history += [{"role": "assistant", "content": answer},
                    {"role": "user", "content": f"And the next one, please ({i})."}]
    return records


def test_the_anatomy_of_a_session_and_of_one_off_calls(tenant, agent, bystander, tmp_path):
    ship_and_build(tmp_path / "a", session(tenant, agent, 4))
    ship_and_build(tmp_path / "b", session(tenant, bystander, 1) + session(tenant, bystander, 1))

    entries = {e["agent"]: e for e in storage_anatomy.anatomy()}
    assert set(entries) == {"anatomy-bot", "other-bot"}
    mine, other = entries["anatomy-bot"], entries["other-bot"]
    assert (mine["calls"], mine["trajectories"]) == (4, 1)
    assert (other["calls"], other["trajectories"]) == (2, 2)

    tables = mine["tables"]
    assert tables["governance_interaction"]["rows"] == 4
    assert tables["governance_step"]["rows"] == 4
    # Items: system, tools, first user message, then an answer and a user message a call.
    assert tables["governance_conversationitem"]["rows"] == 3 + 2 * 3
    assert tables["governance_trajectory"]["rows"] == 1
    for table, c in tables.items():
        assert c["rows"] == 0 or c["row"] > 0, table
        assert c["index"] == sum(c["indexes"].values())
        assert min(c["payload"], c["slack"], c["index"]) >= 0
    # The raw payloads and items hold data; a trajectory row only keys.
    assert tables["governance_interaction"]["payload"] > 0
    assert tables["governance_conversationitem"]["payload"] > 0
    assert tables["governance_trajectory"]["payload"] == 0
    # Two agents share the tables: each is given its share, not the whole table.
    assert other["tables"]["governance_step"]["index"] < tables["governance_step"]["index"]

    # Calls 2-4 each send back the answer of the call before: three items that reference the
    # answer (decision 62), each with the email's subject-index row and no findings (the
    # answer's step holds them); none kept twice; one-off calls have no parent.
    assert mine["steps_with_parent"] == 3
    assert mine["echoed"]["items"] == 0
    referenced = mine["referenced"]
    assert referenced["items"] == 3 and referenced["finding_bytes"] == 0
    assert referenced["item_bytes"] > 0 and referenced["subject_bytes"] > 0
    assert other["steps_with_parent"] == 0 and other["referenced"]["items"] == 0
    # The opening: the system prompt and the tools, once per trajectory.
    assert mine["opening"]["items"] == 2
    assert other["opening"]["items"] == 4

    text = storage_anatomy.report(mine)
    assert "anatomy-bot: 4 calls in 1 trajectories" in text
    assert "answers kept twice (an appended item equal to the parent step's answer): 0 items " \
           "in 3 steps with a parent" in text
    assert "kept as a reference (decision 62): 3 items; per call" in text
    assert storage_anatomy.anatomy(["other-bot"])[0]["agent"] == "other-bot"


def test_the_command_reads_a_database_by_name_and_says_what_is_missing(capsys):
    assert storage_anatomy._database_url("postgresql://u@h:5/x") == "postgresql://u@h:5/x"
    assert storage_anatomy._database_url("steward_bench_1").endswith("/steward_bench_1")
    with pytest.raises(SystemExit):
        storage_anatomy.main(["--help"])
    assert "page slack" in capsys.readouterr().out
