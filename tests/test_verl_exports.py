"""verl itself reads both parquet exports (verl 0.9.1, pinned in the dev group like TRL).

The exports are only useful if verl's own dataset classes load them: `RLHFDataset` (RL, read
through HF datasets) and `MultiTurnSFTDataset` (SFT, read through pandas with the pyarrow
backend, tokenized turn by turn and checked against the whole conversation's template). Both are
driven here on every row, with trajectories that offered tools (two different tool schemas) and
ones that did not, with a tokenizer built offline whose chat template renders `tools` the way
Qwen2.5's does (the JSON of each tool inside <tools></tools>), so a tool's `parameters` that
reached the template as JSON text instead of an object shows up as a quoted string."""

from __future__ import annotations

import json
import re
import string

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from governance import services as gov
from governance.models import Step
from tests.govdata import make_trajectory
from trainer import services

ADD = {"type": "function", "function": {
    "name": "add", "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "a city name"}}}}}

# Qwen2.5's chat template, as its tokenizer_config.json ships it (default system prompt, tools
# as JSON lines in the system turn, tool calls in <tool_call>, tool results as a user turn),
# with Qwen3's handling of tool-call arguments: JSON text (OpenAI's shape, which the export
# keeps: it is what the model generated) is written as is, an object as its JSON.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>"
    " XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{%- if tool_call.arguments is string %}"
    "{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer():
    """A character-level fast tokenizer (every printable character one token, the chat markers
    special tokens) carrying the template above: nothing comes from a hub. Character-level
    keeps verl's check exact: the turns tokenized one by one concatenate to the whole."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|unk|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


def chat_trajectory(tenant, agent, i: int, tools: list | None):
    """A one-step trajectory; with tools, its conversation holds an assistant tool call and the
    tool's result before the final answer, the way an agent sends it on its next call."""
    traj = make_trajectory(tenant, agent, steps=1)
    messages = [{"role": "system", "content": "you add"},
                {"role": "user", "content": f"{i}+{i}="}]
    if tools:
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "add",
                              "arguments": json.dumps({"a": i, "b": i})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(2 * i)}]
    observation = {"messages": messages, "params": {}}
    if tools:
        observation["tools"] = tools
    Step.objects.filter(trajectory=traj).update(
        observation_rest=observation,
        action={"messages": [{"role": "assistant", "content": str(2 * i)}],
                "finish_reason": "stop"})
    gov.record_reward("system:test", tenant, value=1.0, trajectory_id=traj.pk,
                      name="reference", comment=str(2 * i))
    return traj


@pytest.fixture
def exported(tenant, people, settings, tmp_path):
    """An approved version of five trajectories (one with the add tool, one with both tools,
    three without), exported as verl RL and SFT parquet."""
    settings.VAR_DIR = tmp_path / "var"
    users, _ = people
    agent = gov.ensure_agent("system:test", tenant, "bot-verl")
    offered = [[ADD], [WEATHER, ADD], None, None, None]
    trajs = [chat_trajectory(tenant, agent, i, tools) for i, tools in enumerate(offered)]
    ds = gov.create_dataset(users["steward"], tenant, name="verl", agent_ids=[agent.pk])
    version = gov.freeze_dataset_version(users["steward"], ds)
    gov.request_approval(users["steward"], version)
    gov.approve_version(users["compliance"], version, "reviewed the sample")
    version.refresh_from_db()
    out = {}
    for fmt in ("verl-rl", "verl-sft"):
        out[fmt] = tmp_path / f"{fmt}.parquet"
        result = services.export_dataset_version(users["steward"], version, fmt, out[fmt])
        assert result["rows"] == 5, result
    tools_by_id = {str(t.pk): tools for t, tools in zip(trajs, offered, strict=True)}
    answers = {str(t.pk): str(2 * i) for i, t in enumerate(trajs)}
    return out, tools_by_id, answers


def rendered_tools(text: str) -> list:
    """The tools a rendered prompt carries: one JSON document per line inside <tools>."""
    block = re.search(r"<tools>\n(.*)\n</tools>", text, re.S)
    return [json.loads(line) for line in block.group(1).splitlines()] if block else []


def test_verl_multiturn_sft_dataset_reads_every_row_with_and_without_tools(exported):
    from omegaconf import OmegaConf
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    files, tools_by_id, _ = exported
    tokenizer = chat_tokenizer()
    dataset = MultiTurnSFTDataset(
        str(files["verl-sft"]), tokenizer,
        OmegaConf.create({"max_length": 2048, "truncation": "error",
                          "messages_key": "messages", "tools_key": "tools"}))
    assert len(dataset) == 5
    seen_with_tools = 0
    for i in range(len(dataset)):
        item = dataset[i]  # verl tokenizes turn by turn and asserts it equals the whole
        row = dataset.dataframe.iloc[i].to_dict()
        offered = tools_by_id[row["extra_info"]["trajectory_id"]]
        ids = item["input_ids"][item["attention_mask"].bool()]
        text = tokenizer.decode(ids)
        # The assistant's reply is the part trained on, and only it.
        trained = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
        assert trained.endswith(row["messages"][-1]["content"] + "<|im_end|>\n")
        assert "you add" not in trained and "<tool_response>" not in trained
        if offered is None:
            assert "<tools>" not in text
            continue
        seen_with_tools += 1
        # Each tool reaches the template as an object: its parameters are the schema the
        # agent sent (keywords another tool of the export has but this one lacks are null:
        # parquet holds one struct type per column), never a JSON string.
        got = rendered_tools(text)
        assert [t["function"]["name"] for t in got] == [t["function"]["name"] for t in offered]
        for tool, original in zip(got, offered, strict=True):
            params = tool["function"]["parameters"]
            assert isinstance(params, dict)
            assert drop_nulls(params) == original["function"]["parameters"]
        assert '<tool_call>\n{"name": "add", "arguments": {"a": ' in text
    assert seen_with_tools == 2


def drop_nulls(value):
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def test_verl_rlhf_dataset_reads_every_row(exported, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    files, tools_by_id, answers = exported
    tokenizer = chat_tokenizer()
    # verl drops a row whose prompt fails to render as "too long" (it prints the error and
    # moves on), so the count is the check that every row rendered.
    dataset = RLHFDataset(
        str(files["verl-rl"]), tokenizer,
        OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 2048,
                          "filter_overlong_prompts": True,
                          "filter_overlong_prompts_workers": 1,
                          "cache_dir": str(tmp_path / "verl-cache")}))
    assert len(dataset) == 5
    for i in range(len(dataset)):
        row = dataset[i]
        tid = row["extra_info"]["trajectory_id"]
        offered = tools_by_id[tid]
        text = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True,
                                             tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")
        assert row["reward_model"]["ground_truth"] == answers[tid]
        if offered:
            assert '<tool_call>\n{"name": "add", "arguments": {"a": ' in text
            assert "<tool_response>" in text


def test_tool_schemas_that_cannot_share_one_parquet_type_fall_back_to_json_text(
        tenant, people, settings, tmp_path):
    """A no-argument tool's `properties: {}` is a struct without fields, which parquet cannot
    store: the file keeps every row, writes the parameters as JSON text and says so."""
    settings.VAR_DIR = tmp_path / "var"
    users, _ = people
    agent = gov.ensure_agent("system:test", tenant, "bot-noargs")
    noargs = {"type": "function", "function": {
        "name": "now", "description": "the time", "parameters": {"type": "object",
                                                                 "properties": {}}}}
    chat_trajectory(tenant, agent, 1, [noargs])
    chat_trajectory(tenant, agent, 2, None)
    ds = gov.create_dataset(users["steward"], tenant, name="noargs", agent_ids=[agent.pk])
    version = gov.freeze_dataset_version(users["steward"], ds)
    gov.request_approval(users["steward"], version)
    gov.approve_version(users["compliance"], version, "ok")
    version.refresh_from_db()
    out = tmp_path / "sft.parquet"
    summary = services.export_dataset_version(users["steward"], version, "verl-sft", out)
    assert summary["rows"] == 2 and summary["tool_parameters"] == "json-text"
    assert "empty object" in summary["tool_parameters_reason"]
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    [tool] = [t for r in rows for t in r["tools"]]
    assert json.loads(tool["function"]["parameters"]) == noargs["function"]["parameters"]
