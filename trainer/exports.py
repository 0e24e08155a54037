"""Exports of an approved dataset version, for training at cluster scale on verl (or anything
that reads ATDP). The writers only write; trainer.services.export_dataset_version checks the
version, runs them in the tenant's scope and audits the export.

verl-rl (parquet, one row per member trajectory that has a reference answer; see
trainer/taskdata.py for the reference convention), verl's RL dataset columns:
    data_source   string   "steward/<tenant slug>/<dataset name>"
    prompt        list<MESSAGE>   the conversation up to the assistant turn
    ability       string   "agent"
    reward_model  struct<style: string = "rule", ground_truth: string>
    extra_info    EXTRA_INFO

verl-sft (parquet, verl's multi-turn SFT dataset: messages_key "messages", tools_key "tools";
one row per member trajectory with a logged assistant reply):
    messages      list<MESSAGE>   the prompt plus the assistant reply the agent got
    tools         list<TOOL>      empty for a trajectory that offered none — never null: verl
                                  (0.9.1) reads the file with pandas' pyarrow backend, a null
                                  becomes pd.NA and apply_chat_template(tools=NA) raises
    extra_info    EXTRA_INFO

    MESSAGE    struct<role, content, tool_calls: list<struct<id, type,
               function: struct<name, arguments>>>, tool_call_id, name>   (strings; tool call
               arguments are JSON text, as in the OpenAI API: they are what the model generated,
               valid JSON or not; Qwen3-style templates write a string as is)
    TOOL       struct<type, function: struct<name, description, parameters: PARAMETERS>>
    PARAMETERS the tool's JSON Schema as a nested struct, so it reaches the chat template as an
               object (verl hands the column to apply_chat_template untouched; JSON text would
               be rendered as a quoted string). Parquet holds one type per column, so the struct
               is the union of every tool's schema in the file: a keyword or property another
               tool has and this one lacks reads back as null. When the schemas cannot share
               one type (a keyword that is a string in one tool and a list in another, an empty
               object) the whole file falls back to JSON text and the summary says
               "tool_parameters": "json-text" with the reason.
    EXTRA_INFO struct<trajectory_id: string, approval_id: int64, content_hash: string,
               index: int64, split: string = "train">   (uniform over every row)

atdp-jsonl: one ATDP v1 trajectory document (governance.capture.atdp.trajectory_document) per
line, in
trajectory id order, limited to the steps the version pinned at its freeze, with
governance.approval filled in.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from governance.capture.atdp import trajectory_document
from governance.models import DatasetVersion, Trajectory
from trainer.taskdata import (
    Example,
    ground_truth_text,
    iter_examples,
    member_trajectory_ids,
)

FORMATS = ("verl-rl", "verl-sft", "atdp-jsonl")
CONTENT_TYPES = {"verl-rl": "application/vnd.apache.parquet",
                 "verl-sft": "application/vnd.apache.parquet",
                 "atdp-jsonl": "application/x-ndjson"}
EXTENSIONS = {"verl-rl": "parquet", "verl-sft": "parquet", "atdp-jsonl": "jsonl"}
SPLIT = "train"


def _schemas(parameters: Any = None) -> dict[str, Any]:
    """The Arrow schemas; `parameters` is the type of TOOL.function.parameters (see
    _tool_parameters_type), JSON text when not given."""
    import pyarrow as pa

    s = pa.string()
    tool_call = pa.struct([("id", s), ("type", s),
                           ("function", pa.struct([("name", s), ("arguments", s)]))])
    message = pa.struct([("role", s), ("content", s), ("tool_calls", pa.list_(tool_call)),
                         ("tool_call_id", s), ("name", s)])
    tool = pa.struct([("type", s), ("function", pa.struct([("name", s), ("description", s),
                                                           ("parameters", parameters or s)]))])
    extra = pa.struct([("trajectory_id", s), ("approval_id", pa.int64()),
                       ("content_hash", s), ("index", pa.int64()), ("split", s)])
    rl = pa.schema([("data_source", s), ("prompt", pa.list_(message)), ("ability", s),
                    ("reward_model", pa.struct([("style", s), ("ground_truth", s)])),
                    ("extra_info", extra)])
    sft = pa.schema([("messages", pa.list_(message)), ("tools", pa.list_(tool)),
                     ("extra_info", extra)])
    return {"rl": rl, "sft": sft}


def _tool(tool: Any) -> dict[str, Any] | None:
    """One offered tool in the TOOL shape, `parameters` still a dict (the JSON Schema)."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    params = fn.get("parameters")
    return {"type": str(tool.get("type") or "function"),
            "function": {"name": str(fn.get("name") or ""),
                         "description": str(fn.get("description") or ""),
                         "parameters": params if isinstance(params, dict) else {}}}


def _tool_parameters_type(rows: list[dict[str, Any]]) -> tuple[Any, str | None]:
    """The one Arrow struct type every tool's parameter schema in `rows` fits (pyarrow's
    inference: the union of their keys), or (None, why) when they cannot share one or parquet
    cannot hold it (an empty object is a struct without fields)."""
    import pyarrow as pa

    schemas = [t["function"]["parameters"] for r in rows for t in r["tools"]]
    if not schemas:
        return None, None
    try:
        inferred = pa.array(schemas).type
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        return None, f"the tools' parameter schemas do not share one type: {exc}"

    def has_empty_struct(t: Any) -> bool:
        if pa.types.is_struct(t):
            return t.num_fields == 0 or any(has_empty_struct(f.type) for f in t)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return has_empty_struct(t.value_type)
        return False

    if has_empty_struct(inferred) or pa.types.is_null(inferred):
        return None, "a tool's parameter schema holds an empty object, which parquet cannot store"
    return inferred, None


def data_source(version: DatasetVersion) -> str:
    return f"steward/{version.tenant.slug}/{version.dataset.name}"


def _extra(version: DatasetVersion, ex: Example, index: int) -> dict[str, Any]:
    return {"trajectory_id": ex.trajectory_id, "approval_id": version.approval.pk,
            "content_hash": version.content_hash, "index": index, "split": SPLIT}


def write_verl_rl(version: DatasetVersion, out: Path, reference_reward: str = "reference"
                  ) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    skipped: Counter[str] = Counter()
    rows = []
    source = data_source(version)
    for ex in iter_examples(version, reference_reward=reference_reward, skipped=skipped):
        if ex.reference is None:
            skipped["no reference"] += 1
            continue
        rows.append({"data_source": source, "prompt": ex.prompt, "ability": "agent",
                     "reward_model": {"style": "rule",
                                      "ground_truth": ground_truth_text(ex.reference)},
                     "extra_info": _extra(version, ex, len(rows))})
    pq.write_table(pa.Table.from_pylist(rows, schema=_schemas()["rl"]), out)
    return {"rows": len(rows), "skipped": dict(skipped)}


def write_verl_sft(version: DatasetVersion, out: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    skipped: Counter[str] = Counter()
    rows = []
    for ex in iter_examples(version, skipped=skipped):
        if ex.completion is None:
            skipped["no assistant reply"] += 1
            continue
        tools = [t for t in (_tool(t) for t in ex.tools or []) if t is not None]
        rows.append({"messages": [*ex.prompt, ex.completion], "tools": tools,
                     "extra_info": _extra(version, ex, len(rows))})
    parameters, why_text = _tool_parameters_type(rows)
    summary: dict[str, Any] = {"rows": len(rows), "skipped": dict(skipped),
                               "tool_parameters": "struct"}
    if why_text:
        summary.update(tool_parameters="json-text", tool_parameters_reason=why_text)
        for row in rows:
            for tool in row["tools"]:
                fn = tool["function"]
                fn["parameters"] = json.dumps(fn["parameters"], sort_keys=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_schemas(parameters)["sft"]), out)
    return summary


def write_atdp_jsonl(version: DatasetVersion, out: Path) -> dict[str, Any]:
    from governance.models import Step

    approval = version.approval
    approval_doc = {"id": approval.pk, "dataset_version": version.pk,
                    "dataset": version.dataset_id, "number": version.number,
                    "content_hash": version.content_hash,
                    "decided_at": approval.decided_at.isoformat()}
    ids = member_trajectory_ids(version)
    rows = 0
    with open(out, "w", encoding="utf-8") as f:
        for start in range(0, len(ids), 200):
            chunk = ids[start:start + 200]
            pinned = {str(s) for s in Step.objects.filter(
                trajectory_id__in=chunk, created_at__lte=version.created_at)
                .values_list("id", flat=True)}
            trajs = (Trajectory.objects.filter(pk__in=chunk).select_related("tenant", "agent")
                     .order_by("pk"))
            for traj in trajs:
                doc = trajectory_document(traj)
                doc["steps"] = [s for s in doc["steps"] if s["id"] in pinned]
                doc["step_count"] = len(doc["steps"])
                doc["governance"]["approval"] = approval_doc
                f.write(json.dumps(doc, sort_keys=True, ensure_ascii=False) + "\n")
                rows += 1
    return {"rows": rows, "skipped": {}}


def write_export(version: DatasetVersion, fmt: str, out: Path,
                 reference_reward: str = "reference") -> dict[str, Any]:
    if fmt == "verl-rl":
        return write_verl_rl(version, out, reference_reward)
    if fmt == "verl-sft":
        return write_verl_sft(version, out)
    if fmt == "atdp-jsonl":
        return write_atdp_jsonl(version, out)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}")
