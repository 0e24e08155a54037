"""Steward's data model: tenants and roles, keys, ATDP trajectories and steps, raw interactions,
late-bound rewards and the hash-chained audit log.

Every table that carries tenant data has a `tenant` foreign key and is read through its default
manager, governance.tenancy.TenantManager, which filters by the transaction's tenant scope (and
raises outside any) — the one place tenant scoping lives (see governance/api.py for the DRF
side).
"""

from __future__ import annotations

import logging
import re
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.core.exceptions import ObjectDoesNotExist
from django.db import DataError, models
from django.db.models import Lookup

from governance.capture.presets import deflate, inflate
from governance.subject_keys import OPCLASS, UUID_OPCLASS

# The scoped manager of every tenant model: it filters by the current tenant scope itself.
from governance.tenancy import TenantManager, TenantQuerySet  # noqa: F401
from wire.openai import responses_message

log = logging.getLogger(__name__)


class Role(models.TextChoices):
    ADMIN = "admin", "Tenant admin"
    STEWARD = "steward", "Data steward"
    COMPLIANCE = "compliance", "Compliance officer"
    AUDITOR = "auditor", "Auditor"


class Tenant(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    # The tenant's sanitizer policy overrides (governance.sanitizer.Policy.to_dict() shape:
    # operators per entity type, allow/deny lists, score threshold); {} = the defaults. Read by
    # governance.sanitizer.policy_for_tenant; changed through services.set_sanitizer_policy.
    sanitizer_policy = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class Agent(models.Model):
    """An agent (a program calling the LLM) of a tenant; proxy keys are issued per agent."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="agents")
    name = models.CharField(max_length=128)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="agent_tenant_name"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"


class ProxyKey(models.Model):
    """A `stw_...` key an agent sends as its Bearer token. Only the SHA-256 of the key is kept
    (keys are 240-bit random, so a fast hash is enough); `prefix` identifies it in the console."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="proxy_keys")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="proxy_keys")
    prefix = models.CharField(max_length=16)
    key_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # The proxy polls max(updated_at) to refresh its in-memory key table.
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    objects = TenantManager()

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.agent})"


class ApiToken(models.Model):
    """A REST token (`stwt_...`) of one user in one tenant; stored hashed."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_tokens")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="api_tokens")
    prefix = models.CharField(max_length=16)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = TenantManager()


class DataKey(models.Model):
    """An AES-256-GCM data key, wrapped by the master key: one per subject (keyed hash), or one
    per tenant (subject_hash empty). Destroying it crypto-shreds every payload it encrypted."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="data_keys")
    subject_hash = models.CharField(max_length=64, blank=True, default="")
    wrapped_key = models.BinaryField(null=True)
    created_at = models.DateTimeField(auto_now_add=True)
    destroyed_at = models.DateTimeField(null=True, blank=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "subject_hash"],
                                    name="datakey_tenant_subject"),
        ]


class Consent(models.TextChoices):
    TRAIN = "train", "Training allowed (pending approval)"
    NO_TRAIN = "no-train", "Capture for audit only, never training"


class Trajectory(models.Model):
    """One agent episode: the steps of one session (header) or of one inferred conversation.
    The id is chosen by the proxy (uuid5 of the session, or a new uuid4) so it can be returned
    in `X-Steward-Trajectory` before anything reaches the database."""

    class Source(models.TextChoices):
        SESSION = "session", "X-Steward-Session header"
        PREFIX = "prefix", "Inferred from the conversation prefix"
        PREVIOUS_RESPONSE = "previous_response", "Responses API previous_response_id"
        WINDOW = "window", "Inferred from an earlier call's answer in a sliding window"
        NEW = "new", "First call of a conversation"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="trajectories")
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="trajectories")
    session_id = models.CharField(max_length=256, blank=True, default="")
    source = models.CharField(max_length=24, choices=Source.choices, default=Source.NEW)
    subject_hash = models.CharField(max_length=64, blank=True, default="", db_index=True)
    consent = models.CharField(max_length=16, choices=Consent.choices, default=Consent.TRAIN)
    started_at = models.DateTimeField(db_index=True)
    last_step_at = models.DateTimeField()
    step_count = models.PositiveIntegerField(default=0)
    # governance.sanitizer.PlaceholderState JSON: placeholder numbering of this trajectory
    # (`<PERSON_1>` is the same person in every step), keyed by HMACs under the tenant's
    # secret — never a raw value. This column is the base (what trajectories built before
    # decision 34 held); what each step-builder batch adds is a PlaceholderDelta row, and
    # `sanitizer_state_seq` counts them (capture/placeholders.py). Rewriting the whole state
    # with every batch cost a session of n calls n^2 bytes of dead row versions. Locked
    # (SELECT ... FOR UPDATE) while steps are written.
    sanitizer_state = models.JSONField(default=dict, blank=True)
    sanitizer_state_seq = models.PositiveIntegerField(default=0)
    # The canary route and arm the proxy assigned this trajectory's session to (issue 7;
    # evolution/canary.py compares the arms' rewards). Empty arm: no route applied. A string
    # reference: governance imports nothing of the evolution app that owns the route.
    route = models.ForeignKey("evolution.PolicyRoute", null=True, blank=True,
                              on_delete=models.SET_NULL, related_name="trajectories")
    route_arm = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "-started_at"], name="traj_tenant_started"),
            models.Index(fields=["tenant", "agent", "-started_at"], name="traj_tenant_agent"),
            models.Index(fields=["tenant", "session_id"], name="traj_tenant_session"),
            models.Index(fields=["route", "route_arm"], name="traj_route_arm"),
        ]


class PlaceholderDelta(models.Model):
    """What one step-builder batch added to a trajectory's placeholder state: the labels and
    aliases it numbered (keyed HMACs -> `PERSON_3`, never a value) and the counters after it.
    Append-only; `seq` is the trajectory's sanitizer_state_seq it made. Read back in order on
    top of Trajectory.sanitizer_state (capture/placeholders.py). Deleted with its trajectory
    (erasure deletes them with SQL before the trajectory rows)."""

    # No index of their own: (trajectory, seq)'s unique index serves every lookup and the
    # cascade from the trajectory; a tenant is deleted (rarely) through its trajectories.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+",
                               db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE,
                                   related_name="placeholder_deltas", db_index=False)
    seq = models.PositiveIntegerField()
    # The delta ({"v", "labels", "aliases", "counters"}) in binary (capture/delta_codec.py,
    # decision 39): 64-bit keys as 8 bytes, labels as (type, number) — ~10 bytes an entry
    # against ~23 for the zlib'd JSON of format 1 (decision 37), which still reads.
    data = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["trajectory", "seq"], name="phdelta_traj_seq"),
        ]

    @staticmethod
    def pack(delta: dict) -> bytes:
        from governance.capture.delta_codec import pack

        return pack(delta)

    @staticmethod
    def unpack(data: bytes | memoryview) -> dict:
        from governance.capture.delta_codec import unpack

        return unpack(data)

    def delta(self) -> dict:
        """The delta this row holds (what `pack` packed)."""
        return self.unpack(self.data)


class Interaction(models.Model):
    """The raw captured exchange, as shipped from the proxy's spool. The request and response
    (headers and bodies) are one AES-GCM ciphertext under `data_key`; the columns here are the
    metadata needed without decrypting. `flow_id` makes shipping idempotent."""

    class State(models.TextChoices):
        CAPTURED = "captured", "Captured, step not built yet"
        PROCESSED = "processed", "Step built"
        QUARANTINED = "quarantined", "Quarantined (processing failed)"

    # Unique across partitions: in the database (flow_id, started_at) and (step_id,
    # started_at), plus a trigger refusing either id stored with another started_at
    # (migration 0017). The table is partitioned by month on `started_at`.
    flow_id = models.CharField(max_length=64, unique=True)
    # Every index here costs bytes and a write on every captured call (decision 37): no
    # tenant index (ia_tenant_started leads with it), no subject-hash index but the partial
    # interaction_subject_traj (erasure's lookup, always per tenant), and none of Django's
    # varchar_pattern_ops twins (nothing runs LIKE on these columns; migration 0022).
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="interactions",
                               db_index=False)
    # No agent or data-key index (migration 0024, decision 38): nothing looks interactions up
    # by either; the foreign keys' own checks run only when an agent or a data key row is
    # deleted, which Steward never does (keys are shredded in place; agents are kept).
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="interactions",
                              db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE,
                                   related_name="interactions")
    step_id = models.UUIDField(unique=True)
    endpoint = models.CharField(max_length=32)  # chat.completions | completions | responses
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=512)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    is_stream = models.BooleanField(default=False)
    request_is_json = models.BooleanField(default=True)
    error_kind = models.CharField(max_length=32, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    subject_hash = models.CharField(max_length=64, blank=True, default="")
    consent = models.CharField(max_length=16, choices=Consent.choices, default=Consent.TRAIN)
    started_at = models.DateTimeField()
    first_byte_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    data_key = models.ForeignKey(DataKey, null=True, on_delete=models.SET_NULL,
                                 related_name="interactions", db_index=False)
    raw_ciphertext = models.BinaryField(null=True)
    # The flow whose request body this payload's is a delta of (capture/rawstore.py: the
    # previous call of the trajectory under the same data key); "" for a whole payload.
    # Looked up within the doomed flows' trajectories (rawstore.rebase_dependents): no index.
    raw_base_flow = models.CharField(max_length=64, blank=True, default="")
    raw_expires_at = models.DateTimeField(null=True, blank=True)
    # No state column: a call not built yet or quarantined has a PendingInteraction row
    # (`state` below reads it); building the step deletes that row rather than updating this
    # one (decision 39).
    proxy_instance = models.CharField(max_length=128, blank=True, default="")
    shipped_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        # The console's overview buckets the last 24 hours of calls per agent.
        indexes = [models.Index(fields=["tenant", "started_at"], name="ia_tenant_started")]

    @property
    def state(self) -> str:
        """captured, quarantined (its PendingInteraction row's state) or processed (none)."""
        pending = self._pending()
        return pending.state if pending is not None else self.State.PROCESSED

    @property
    def state_reason(self) -> str:
        pending = self._pending()
        return pending.reason if pending is not None else ""

    def _pending(self) -> PendingInteraction | None:
        try:
            return self.pending
        except ObjectDoesNotExist:
            return None


class PendingInteraction(models.Model):
    """A shipped call whose step is not built: `captured` (the step builder has not taken it
    yet) or `quarantined` (refused; `reason` says why). A built call has no row here, and reads
    as processed (Interaction.state).

    Why a table of its own: building a step used to update the interaction's state, and an
    update writes a new version of the whole row — with every index entry again, and with a
    raw payload small enough to be kept inline — ~0.4 KB a captured call (decision 39).
    Deleting this small row instead leaves the interaction as it was inserted. Looked up by
    interaction (the primary key), by tenant and state (the claim's coalescing, the backlog,
    the sweeper with the interaction's shipped_at); deleted with its interaction (the
    collector, and explicitly where erasure and retention delete interactions with SQL)."""

    class State(models.TextChoices):
        CAPTURED = "captured", "Captured, step not built yet"
        QUARANTINED = "quarantined", "Quarantined (processing failed)"

    # No constraint into the partitioned interactions table (its key is (id, started_at)).
    interaction = models.OneToOneField(Interaction, primary_key=True, on_delete=models.CASCADE,
                                       related_name="pending", db_constraint=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+",
                               db_index=False)
    # The interaction's: erasure deletes by trajectory, retention by month (no index: the
    # table holds only what is unbuilt or quarantined).
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="+",
                                   db_index=False)
    started_at = models.DateTimeField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.CAPTURED)
    reason = models.TextField(blank=True, default="")

    objects = TenantManager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "state", "interaction"],
                                name="pending_tenant_state")]


class PackedJSONField(models.BinaryField):
    """A JSON value stored as zlib over its compact JSON (a bytea), read back as the value.

    For values written once and read whole, never queried into with SQL: conversation items
    (decision 40). PostgreSQL compresses a JSONB value with pglz, and only once its row passes
    ~2 KB; zlib keeps ~30 % fewer bytes of the bench's messages, small ones included. The
    blob is a zlib stream (first byte 0x78); another first byte would be another format."""

    description = "JSON, zlib-compressed"
    # A NUL character in a JSON string: `\u0000` after an even number of backslashes (an odd
    # number in all starts the escape).
    _NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")

    @classmethod
    def pack(cls, value: Any) -> bytes:
        """zlib over the value's JSON. Refuses, as JSONB does (DataError), a string holding
        NUL: what PostgreSQL cannot hold as JSON stays refused at the same place (the step
        builder quarantines that call), nothing later copies one into a JSONB column, and
        migration 0033's reverse never meets one."""
        return zlib.compress(cls._json(value), 6)

    @classmethod
    def _json(cls, value: Any) -> bytes:
        data = orjson.dumps(value)
        if cls._NUL.search(data):
            raise DataError("unsupported Unicode escape sequence: \\u0000 cannot be stored "
                            "in a JSON value")
        return data

    @classmethod
    def unpack(cls, blob: bytes | memoryview) -> Any:
        return orjson.loads(zlib.decompress(bytes(blob)))

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return None if value is None else self.unpack(value)

    def to_python(self, value: Any) -> Any:
        # A str is a JSON value like any other here (an `instructions` item is one), never a
        # serialized form: value_to_string hands serializers the value itself, as JSONField.
        if isinstance(value, (bytes, memoryview)):
            return self.unpack(value)
        return value

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        if value is None:
            return None
        return super().get_db_prep_value(self.pack(value), connection, prepared)

    def value_to_string(self, obj: Any) -> Any:
        return self.value_from_object(obj)


# The preset dictionary of StepJSONField's format 1 (decision 60): the OpenAI wire vocabulary
# and the shapes of a step's action, usage, timings and versions, most common last (deflate
# codes nearer matches in fewer bits). Rows packed with it can only be read with these exact
# bytes: never edit it; a better dictionary is format 2, with its own first byte.
STEP_JSON_DICTIONARY_1 = orjson.dumps([
    {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "text": None},
    {"context_update": {"id": 1, "version": 1, "hash": ""}, "context_updates": [
        {"id": 1, "version": 1, "hash": "", "kind": "system_prompt"}],
     "route": {"id": 1, "arm": "canary"}, "gen_ai.request.model": "",
     "gen_ai.response.model": "", "system_prompt_hash": None, "tool_schema_hash": None},
    {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0},
    {"finish_reason": "stop", "status": "completed", "output": [
        {"type": "reasoning", "id": "rs_", "summary": [{"type": "summary_text", "text": ""}],
         "encrypted_content": None},
        {"type": "function_call", "id": "fc_", "call_id": "call_", "name": "",
         "arguments": "{\"", "status": "completed"},
        {"type": "message", "id": "msg_", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}]},
    {"raw": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
             "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
             "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                           "accepted_prediction_tokens": 0,
                                           "rejected_prediction_tokens": 0}}},
    {"messages": [{"role": "assistant", "content": "", "refusal": None, "annotations": []}],
     "finish_reason": "stop"},
    {"harness_version": "steward-proxy/0.1"},
    {"ttfb_ms": 0.0, "duration_ms": 0.0},
    {"raw": {"total_tokens": 0, "prompt_tokens": 0, "completion_tokens": 0}},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_", "type": "function", "function": {"name": "", "arguments": "{\""}}]}],
     "finish_reason": "tool_calls"},
])
STEP_JSON_FORMAT_1 = b"\x01"
# A JSON text starts with one of these (after no whitespace: orjson writes none; a string, as
# instructions too short to pack are kept); no format byte (0x01, 0x02, zlib's 0x78 'x') is one.
_JSON_START = frozenset(b'{["-0123456789tfn"')


class StepJSONField(PackedJSONField):
    """The small JSON values of a step row (action, usage, timings, versions) in a bytea,
    compressed against a preset dictionary (decision 60). As JSONB they were ~620 bytes of a
    1 KB step row on recorded support sessions (tau-bench): JSONB keeps every key and an
    offset table, and PostgreSQL compresses nothing under ~2 KB; against the dictionary the
    same values take ~210. Written once, read whole, never queried into with SQL.

    The blob's first byte says its format: 0x01, raw deflate with STEP_JSON_DICTIONARY_1 as
    preset dictionary; a JSON text as it is (what migration 0036 turned the JSONB rows into,
    and any value the dictionary does not make smaller, such as {}); 0x78, a zlib stream
    (PackedJSONField's, read for completeness)."""

    description = "JSON, compressed against a preset dictionary"
    # What pack writes: the format byte and its dictionary. A subclass with another
    # dictionary sets these two; unpack reads every format in _PRESET_FORMATS either way.
    FORMAT: ClassVar[bytes] = STEP_JSON_FORMAT_1
    DICTIONARY: ClassVar[bytes] = STEP_JSON_DICTIONARY_1

    @classmethod
    def pack(cls, value: Any) -> bytes:
        plain = cls._json(value)
        packed = cls.FORMAT + deflate(plain, cls.DICTIONARY)
        return packed if len(packed) < len(plain) else plain

    @classmethod
    def unpack(cls, blob: bytes | memoryview) -> Any:
        data = bytes(blob)
        preset = _PRESET_FORMATS.get(data[:1])
        if preset is not None:
            dictionary, what = preset
            return orjson.loads(inflate(data[1:], dictionary, what))
        if data[:1] == b"\x78":
            return orjson.loads(zlib.decompress(data))
        if data[:1] and data[0] in _JSON_START:
            return orjson.loads(data)
        raise ValueError(f"a packed JSON value of unknown format (first byte {data[:1]!r})")


# The preset dictionary of ItemJSONField's format 2 (decision 61): what conversation items say
# besides their text — the chat and Responses message shapes in the orders clients write them,
# tool schemas, the placeholders the sanitizer writes — most common last. Never edit it (rows
# packed with it read only with these bytes); a better one is another format byte.
ITEM_JSON_DICTIONARY_1 = orjson.dumps([
    [{"type": "integer", "description": ""}, {"type": "number", "description": ""},
     {"type": "boolean", "description": ""}, {"type": "array", "description": "", "items": {
         "type": "object", "properties": {}}}, {"type": "string", "description": "",
                                                "enum": [""]}],
    [{"type": "function", "function": {"name": "", "description": "", "parameters": {
        "type": "object", "properties": {"": {"type": "string", "description": ""}},
        "required": [""], "additionalProperties": False}, "strict": True}}],
    [{"type": "function", "name": "", "description": "", "parameters": {
        "type": "object", "properties": {}, "required": []}, "strict": True}],
    {"type": "reasoning", "id": "rs_", "summary": [{"type": "summary_text", "text": ""}],
     "encrypted_content": None},
    {"type": "function_call", "id": "fc_", "call_id": "call_", "name": "", "arguments": "{\"",
     "status": "completed"},
    {"type": "function_call_output", "call_id": "call_", "output": ""},
    {"type": "message", "id": "msg_", "status": "completed", "role": "assistant", "content": [
        {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]},
    {"role": "user", "content": [{"type": "input_text", "text": ""}]},
    {"role": "system", "content": ""}, {"role": "developer", "content": ""},
    "<SECRET> <IP_ADDRESS_1> <IBAN_CODE_1> <CREDIT_CARD_1> <US_SSN_1> <DATE_OF_BIRTH_1> "
    "<STREET_ADDRESS_1> <PHONE_NUMBER_1> <EMAIL_ADDRESS_1> <SUBJECT_ID_1> <LOCATION_1> "
    "<DATE_TIME_1> <PERSON_1>",
    {"role": "assistant", "content": None, "refusal": None, "annotations": [], "tool_calls": [
        {"id": "call_", "type": "function", "function": {"name": "", "arguments": "{\""}}]},
    {"content": None, "role": "assistant", "tool_calls": [
        {"function": {"arguments": "{\"", "name": ""}, "id": "call_", "type": "function"}]},
    {"content": "", "role": "assistant"}, {"role": "assistant", "content": ""},
    {"content": "", "name": "", "role": "tool", "tool_call_id": "call_"},
    {"role": "tool", "tool_call_id": "call_", "content": ""},
    {"content": "", "role": "user"}, {"role": "user", "content": ""},
])
ITEM_JSON_FORMAT_1 = b"\x02"
# Every preset-dictionary format a packed value may carry: its dictionary, and what to call
# the value when the bytes are damaged.
_PRESET_FORMATS: dict[bytes, tuple[bytes, str]] = {
    STEP_JSON_FORMAT_1: (STEP_JSON_DICTIONARY_1, "step JSON value"),
    ITEM_JSON_FORMAT_1: (ITEM_JSON_DICTIONARY_1, "conversation item"),
}


class ItemJSONField(StepJSONField):
    """A conversation item's content (a message, a tool schema list, instructions) in a bytea,
    compressed against ITEM_JSON_DICTIONARY_1 (decision 61): on recorded support sessions
    (tau-bench) items are a few hundred bytes, where zlib alone (PackedJSONField, their format
    since migration 0033) finds little to copy and adds 6 bytes of header and checksum; against
    the dictionary they take ~13 % less. Format byte 0x02; the rows stored before (zlib,
    first byte 0x78) and StepJSONField's formats are read as they are."""

    description = "JSON, compressed against a conversation item dictionary"
    FORMAT = ITEM_JSON_FORMAT_1
    DICTIONARY = ITEM_JSON_DICTIONARY_1

    @classmethod
    def pack(cls, value: Any) -> bytes:
        if isinstance(value, AnswerRef):
            return ANSWER_REF_FORMAT + value.step_id.bytes + value.index.to_bytes(2, "big")
        return super().pack(value)

    @classmethod
    def unpack(cls, blob: bytes | memoryview) -> Any:
        data = bytes(blob)
        if data[:1] == ANSWER_REF_FORMAT:
            if len(data) != 19:
                raise ValueError(f"a damaged answer reference ({len(data)} bytes, not 19)")
            return AnswerRef(uuid.UUID(bytes=data[1:17]), int.from_bytes(data[17:], "big"))
        return super().unpack(data)


# An item that is an answer sent back (decision 62): format byte, the answering step's id
# (16 bytes), the message's index in its action (2 bytes, big-endian).
ANSWER_REF_FORMAT = b"\x03"


@dataclass(frozen=True)
class AnswerRef:
    """A conversation item's content when it is exactly message `index` of step `step_id`'s
    answer (its action's `messages`): the agent sent the answer it was given back with its next
    call, and the item points at it instead of holding it a second time (decision 62). Readers
    never see one: conversation.resolve_answers puts the message in its place on every read,
    and retention gives an item the message before the step holding it goes
    (conversation.keep_answers_of)."""

    step_id: uuid.UUID
    index: int


class ActionField(StepJSONField):
    """A step's `action`. A Responses API action keeps its native `output` items and
    not the chat-style `messages` read from them: those are a pure function of the items
    (wire.openai.responses_message), dropped on write only when they are exactly that reading
    and rebuilt on every read, so readers see the action as it was built (decision 55). It
    was ~320 bytes a step, the answer's third copy after `output` and the next call's items.
    Actions stored whole (other endpoints, steps built before) are read as they are."""

    @classmethod
    def pack(cls, value: Any) -> bytes:
        if (isinstance(value, dict) and isinstance(value.get("output"), list)
                and value.get("messages") == [responses_message(value["output"])]):
            value = {k: v for k, v in value.items() if k != "messages"}
        return super().pack(value)

    @classmethod
    def unpack(cls, blob: bytes | memoryview) -> Any:
        value = super().unpack(blob)
        if (isinstance(value, dict) and isinstance(value.get("output"), list)
                and "messages" not in value):
            value["messages"] = [responses_message(value["output"])]
        return value


class Step(models.Model):
    """One ATDP v1 step (one LLM call). Content fields hold the OpenAI message objects; served
    as the ATDP document by governance/capture/atdp.py. Never updated after it is built."""

    id = models.UUIDField(primary_key=True)
    # No tenant or trajectory index of their own: step_tenant_started and step_traj_started
    # lead with them (migration 0022, decision 37).
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="steps",
                               db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="steps",
                                   db_index=False)
    # No database constraint: steps and interactions are partitioned by time (decision 33),
    # and PostgreSQL's foreign keys into a partitioned table need its partition key. Django's
    # collector still sets it NULL when the interaction is deleted through the ORM; retention
    # drops a month only when no step outside it points into it.
    interaction = models.OneToOneField(Interaction, null=True, on_delete=models.SET_NULL,
                                       related_name="step", db_constraint=False)
    endpoint = models.CharField(max_length=32)
    # The partition key (monthly ranges, migration 0017); the interaction's started_at.
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    request_model = models.CharField(max_length=256, blank=True, default="")
    response_model = models.CharField(max_length=256, blank=True, default="")
    response_id = models.CharField(max_length=256, blank=True, default="", db_index=True)
    # The observation as stored: everything but what the conversation store holds as items
    # (see below). Read `observation` (the property) for the whole of it.
    observation_rest = models.JSONField(default=dict, db_column="observation")
    hidden_state = models.JSONField(default=dict)  # reasoning content when returned
    # Assistant message(s), tool calls, finish reason (a Responses action: see ActionField).
    action = ActionField(default=dict)
    tokens = models.JSONField(default=dict)  # token ids / logprobs when the upstream returns them
    # Packed against a preset dictionary (StepJSONField, decision 60), as `action` is.
    usage = StepJSONField(default=dict)
    timings = StepJSONField(default=dict)
    versions = StepJSONField(default=dict)
    metadata = models.JSONField(default=dict)
    error = models.JSONField(null=True, blank=True)
    classification = models.CharField(max_length=32, default="internal")
    consent = models.CharField(max_length=16, choices=Consent.choices, default=Consent.TRAIN)
    retention_until = models.DateTimeField(null=True, blank=True)
    # Empty until the sanitizer has run: an unsanitized step is never training-eligible.
    sanitizer_version = models.CharField(max_length=64, blank=True, default="")
    training_eligible = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    # The conversation store (issue 16, governance/capture/conversation.py): the history the
    # request sent (`messages` of chat, a list `input` of the Responses API) is not stored in
    # `observation` but as references to ConversationItem rows — the first `kept` messages of
    # `parent_step`'s history, then the items `appended` — and the tool schemas and
    # instructions as items too (`item_refs`). `conversation.observations()` materializes the
    # full observation on read.
    # `parent_step` is a plain id, not a foreign key: retention re-roots the children of a
    # step it purges (conversation.reroot_children) before the delete.
    parent_step = models.UUIDField(null=True, blank=True)
    kept = models.PositiveIntegerField(default=0)
    appended = ArrayField(models.BigIntegerField(), default=list, blank=True)
    # {"tools": item id, "instructions": item id}: the request's tool schemas and Responses
    # instructions, when it had them.
    item_refs = models.JSONField(default=dict, blank=True)
    # Chained digest of the whole history's item digests (conversation.chain_digests): a later
    # call finds the step it extends by looking up the chain digests of its own prefixes.
    history_digest = models.CharField(max_length=64, blank=True, default="")
    history_length = models.PositiveIntegerField(default=0)

    objects = TenantManager()

    class Meta:
        indexes = [
            models.Index(fields=["trajectory", "history_digest"], name="step_traj_history"),
            models.Index(fields=["trajectory", "started_at"], name="step_traj_started"),
            # The overview's capture lag over the last 24 hours.
            models.Index(fields=["tenant", "started_at"], name="step_tenant_started"),
        ]

    @property
    def observation(self) -> dict:
        """What the agent sent (messages / prompt / input, tools, params), whole: for a step of
        the conversation store materialized from its items on first read (two queries;
        readers of many steps call conversation.materialize_observations first: two queries
        for all of them)."""
        if not self.history_digest and not self.item_refs:
            return self.observation_rest
        full = self.__dict__.get("_full_observation")
        if full is None:
            from governance.capture.conversation import observations
            from governance.tenancy import tenant_context

            # The step's own items, read in its own tenant's scope (the step itself was
            # read in one already).
            with tenant_context(self.tenant_id):
                full = observations([self])[self.pk]
            self.__dict__["_full_observation"] = full
        return full

    @observation.setter
    def observation(self, value: dict) -> None:
        # A step built without the conversation store (tests, tools): stored as it is.
        self.observation_rest = value
        self.__dict__.pop("_full_observation", None)

    def set_full_observation(self, value: dict) -> None:
        """The materialized observation, computed for many steps at once."""
        self.__dict__["_full_observation"] = value

class ConversationItem(models.Model):
    """One distinct message of a trajectory's conversation (or its tool schema set, or the
    Responses API `instructions`), stored once, sanitized: steps reference it (Step.appended,
    Step.item_refs) instead of storing their whole history again (issue 16).

    `digest` is a keyed hash (keyring.content_digest: HMAC under a per-tenant key, so it says
    nothing about the content to whoever reads the table) of the item's exact raw JSON, with
    its kind; `sanitizer_version` includes the policy fingerprint, so a policy change makes new
    items (sanitized lazily, when a step needs them) instead of reusing old ones. The findings
    and subject-index rows of an item belong to `first_step`, the step that first carried it.
    Items migrated from steps built before the store have digests of their sanitized content
    (prefix `s:`): the raw messages were no longer there to hash."""

    class Kind(models.TextChoices):
        MESSAGE = "message", "Message"
        TOOLS = "tools", "Tool schemas"
        INSTRUCTIONS = "instructions", "Instructions"

    # No index of their own (migration 0028, decision 39): every lookup by trajectory uses
    # convitem_traj_digest_version, which leads with it; a tenant is deleted (rarely) through
    # its trajectories, as for placeholder deltas.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="conversation_items", db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE,
                                   related_name="conversation_items", db_index=False)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.MESSAGE)
    digest = models.CharField(max_length=72)
    sanitizer_version = models.CharField(max_length=64)
    # Packed JSON (ItemJSONField, migration 0037; zlib'd rows of 0033 read as they are): read
    # whole, never queried into.
    content = ItemJSONField()
    first_step = models.UUIDField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["trajectory", "digest", "sanitizer_version"],
                                    name="convitem_traj_digest_version"),
        ]


class Finding(models.Model):
    """What the sanitizer found in one place, packed as one row (decision 37,
    governance/capture/findings.py): a conversation item (`item`, its findings found once,
    when the first step carrying it was built: `step`), or a step's request or response
    outside its history (`side`). `counts` ({entity type: n}) and `total` are what the console
    and ATDP show; `spans` holds each finding's detail — what (entity type, recognizer,
    score), where (JSON path of the string, `value_path` inside an embedded JSON document such
    as tool arguments, character offsets in the original string) and what was done
    (operator) — read with `details()`. Never a value itself."""

    class Side(models.TextChoices):
        REQUEST = "request", "Request"
        RESPONSE = "response", "Response"

    # Partitioned by `created_at` (migration 0017, decision 33). Lean on purpose: findings are
    # only ever read through their step (step_id's index) or deleted with their item, so no
    # index on tenant; no interaction (always the step's); the item index only over rows that
    # have an item.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="findings",
                               db_index=False)
    # No database constraint into the partitioned steps table: Django's collector deletes a
    # step's findings with it, erasure and retention's partition drop delete them explicitly.
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="findings",
                             db_constraint=False)
    item = models.ForeignKey(ConversationItem, null=True, blank=True, db_index=False,
                             on_delete=models.CASCADE, related_name="findings")
    side = models.CharField(max_length=8, choices=Side.choices)
    counts = models.JSONField(default=dict)
    total = models.PositiveIntegerField(default=0)
    spans = models.BinaryField(default=b"")
    sanitizer_version = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        indexes = [
            # Deleting conversation items (retention) finds their findings through it.
            models.Index(fields=["item"], condition=models.Q(item__isnull=False),
                         name="finding_item"),
        ]

    def details(self) -> list[dict]:
        """Each finding: entity_type, path, value_path, start, end, score, recognizer,
        operator (plus `side`)."""
        from governance.capture.findings import unpack

        return [{**f, "side": self.side} for f in unpack(self.spans)]


class SubjectIndex(models.Model):
    """Which trajectories are about a data subject, for erasure: the keys (`keys()`: the first
    128 bits of keyring.subject_hash(tenant, normalize_identifier(type, value)), as a uuid) of
    the identifiers (email, phone, name, IBAN, ...) the sanitizer found, packed one row per place
    they were found (`source`):
    - `item`: a conversation item (issue 16) — the row lives as long as the item (step and
      interaction null), not as long as the first step that carried it;
    - `step`: the rest of a step's exchange (the response, the request outside its history);
    - `header`: X-Steward-Subject of an interaction (`step` null when it was quarantined);
    - `scan`: identifiers the erasure scan found in a payload nothing had indexed.
    A GIN index answers `hashes && ARRAY[..]`. A row per identifier cost ~560 bytes with its
    indexes (34 per 3 KB of PII-dense agent traffic: 19 KB a call); packed, ~80 (decision 34).
    64-bit keys in a bigint[] (decision 40, migration 0031; 128 bits in a uuid[] before,
    decision 38): 8 bytes an element in the row and in each GIN entry. A key only has to be
    told apart from the other keys of its tenant when an erasure looks one up: the chance
    that a lookup matches an unrelated key is (keys in the tenant) / 2^64, 5e-11 for a billion
    keys, and such a match would add a trajectory to the erasure's preview, never miss one.
    Keyed hashes only: the index cannot be read back into identifiers."""

    class Source(models.TextChoices):
        HEADER = "header", "X-Steward-Subject header"
        STEP = "step", "Found in the step's exchange"
        ITEM = "item", "Found in a conversation item"
        SCAN = "scan", "Found by an erasure scan"

    # No tenant index (lookups go through the GIN index, deletes through the trajectory) and
    # no plain item index (subjectindex_item is one): migration 0022, decision 37.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="subject_index",
                               db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE,
                                   related_name="subject_index")
    # No database constraints into the partitioned steps and interactions (decision 33):
    # Django's collector, erasure and retention's partition drop delete these rows with them.
    # Their indexes skip rows without one (partial, migration 0030, decision 40): item rows,
    # two in three, have neither; every lookup by them is an equality or IN, which implies
    # IS NOT NULL, so the planner uses the partial index.
    step = models.ForeignKey(Step, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="subject_index", db_constraint=False, db_index=False)
    interaction = models.ForeignKey(Interaction, null=True, blank=True,
                                    on_delete=models.CASCADE, related_name="subject_index",
                                    db_constraint=False, db_index=False)
    item = models.ForeignKey("ConversationItem", null=True, blank=True, db_index=False,
                             on_delete=models.CASCADE, related_name="subject_index")
    source = models.CharField(max_length=8, choices=Source.choices)
    hashes = ArrayField(models.BigIntegerField(), default=list)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        # fastupdate off: GIN's pending list keeps entries uncompressed until a vacuum merges
        # them (about twice the bytes under a steady insert load); inserts here are a few
        # rows per call, cheap to put straight into the tree.
        indexes = [
            GinIndex(fields=["hashes"], name="subjectindex_hashes", fastupdate=False),
            models.Index(fields=["step"], condition=models.Q(step__isnull=False),
                         name="subjectindex_step"),
            models.Index(fields=["interaction"], condition=models.Q(interaction__isnull=False),
                         name="subjectindex_interaction"),
        ]
        constraints = [
            # The step builder inserts with ON CONFLICT DO NOTHING: a rebuilt interaction
            # adds nothing twice. (Scan rows may repeat: each erasure scan adds its own, and
            # the erasure deletes them with the trajectory.)
            models.UniqueConstraint(fields=["interaction", "source"],
                                    condition=models.Q(interaction__isnull=False,
                                                       source__in=["header", "step"]),
                                    name="subjectindex_interaction_source"),
            models.UniqueConstraint(fields=["item"], condition=models.Q(item__isnull=False),
                                    name="subjectindex_item"),
        ]

    @staticmethod
    def keys(hashes: Iterable[str]) -> list[int]:
        """The stored form of keyring.subject_hash values (64 hex digits -> their first 64
        bits as a signed bigint, as PostgreSQL reads `('x' || hex)::bit(64)::bigint`), for
        `hashes__keys_overlap` and the `&&&` of raw SQL (`%s::bigint[]`); anything not a hash
        matches nothing."""
        out = []
        for h in hashes:
            if isinstance(h, str) and len(h) == 64:
                try:
                    raw = bytes.fromhex(h)
                except ValueError:
                    continue
                out.append(int.from_bytes(raw[:8], "big", signed=True))
        return out


# Whether the fallback to `&&` was logged (once per process).
_warned_full_scan = False


def subject_keys_operator(connection: Any = None) -> str:
    """The operator that tests subject-index keys for overlap: `&&&` when subjectindex_hashes
    is built with the leakproof operator class (governance/subject_keys.py), else `&&`
    (the same answer, but read by a full scan under row-level security; logged once). One
    catalog query, not cached: migrations can change the index in a running process."""
    from django.db import connection as default

    with (connection or default).cursor() as cur:
        cur.execute("SELECT o.opcname FROM pg_index i JOIN pg_opclass o "
                    "ON o.oid = i.indclass[0] "
                    "WHERE i.indexrelid = to_regclass('subjectindex_hashes')")
        row = cur.fetchone()
    if row and row[0] in (OPCLASS, UUID_OPCLASS):
        return "&&&"
    global _warned_full_scan
    if not _warned_full_scan:
        _warned_full_scan = True
        log.warning("subject index: no leakproof key operator class (governance/subject_keys.py "
                    "needs a superuser): subject lookups scan the whole index under row-level "
                    "security")
    return "&&"


@ArrayField.register_lookup
class KeysOverlap(Lookup):
    """`hashes__keys_overlap=SubjectIndex.keys(...)`: Django's `__overlap` with the operator
    that can use the GIN index under row-level security (subject_keys_operator)."""

    lookup_name = "keys_overlap"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list]:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        operator = subject_keys_operator(connection)
        return f"{lhs} {operator} ({rhs})::bigint[]", [*lhs_params, *rhs_params]


class Reward(models.Model):
    """A late-bound learning signal. Append-only (a trigger refuses UPDATE and DELETE outside
    erasure/retention): a correction is a new row. It names a trajectory or an upstream response
    id and may arrive before the capture exists; it is joined, never copied, onto steps."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="rewards")
    trajectory_id = models.UUIDField(null=True, blank=True, db_index=True)
    response_id = models.CharField(max_length=256, blank=True, default="", db_index=True)
    name = models.CharField(max_length=64, default="reward")
    value = models.FloatField()
    final = models.BooleanField(default=True)
    source = models.CharField(max_length=64, blank=True, default="api")
    comment = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()


class AuditEvent(models.Model):
    """Append-only, hash-chained log. `seq` is gapless (allocated under an advisory lock);
    `hash` = SHA-256(prev_hash || canonical JSON of the event). Payloads carry pseudonymous ids
    only, so erasure never has to rewrite the chain."""

    seq = models.BigIntegerField(unique=True)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.PROTECT,
                               related_name="audit_events")
    actor = models.CharField(max_length=150)  # "user:<id>", "system:<component>", "token:<id>"
    action = models.CharField(max_length=64)
    object_type = models.CharField(max_length=64, blank=True, default="")
    object_id = models.CharField(max_length=128, blank=True, default="")
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    objects = TenantManager()

    class Meta:
        ordering = ["seq"]


class SanitizerPolicyChange(models.Model):
    """A requested change of a tenant's sanitizer policy that lets more identifying data through
    (governance.sanitizer.policy.weakenings): it takes effect only when a second person
    approves it (four eyes, governance/services.py). `base` is the policy it was requested
    against: approving it after the policy changed otherwise is refused."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending approval"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="sanitizer_policy_changes")
    policy = models.JSONField()
    base = models.JSONField(default=dict)
    weakenings = models.JSONField(default=list)  # what it lets through, in words
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING,
                              db_index=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True,
                                     on_delete=models.SET_NULL, related_name="+")
    requested_at = models.DateTimeField(auto_now_add=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    decided_at = models.DateTimeField(null=True, blank=True)

    objects = TenantManager()


class AuditCheckpoint(models.Model):
    """The outcome of one verification of the audit chain: how far it found the chain intact
    (`seq`, `hash` of that event), or where it found it broken. A console or REST click walks
    only the events after the latest intact checkpoint (governance.audit.verify_new_events);
    `manage.py verify_audit` walks the whole chain. No tenant: the chain is one over every
    tenant, and a checkpoint holds sequence numbers and hashes only."""

    seq = models.BigIntegerField()  # last event found intact (0: none yet)
    hash = models.CharField(max_length=64)
    ok = models.BooleanField()
    first_bad_seq = models.BigIntegerField(null=True, blank=True)
    reason = models.CharField(max_length=200, blank=True, default="")
    full = models.BooleanField(default=False)  # walked from the first event
    created_at = models.DateTimeField(auto_now_add=True)


# Data classifications from least to most restrictive (a step's `classification`); an unknown
# label counts as the most restrictive (governance/capture/atdp.py ranks them the same way).
class Classification(models.TextChoices):
    PUBLIC = "public", "Public"
    INTERNAL = "internal", "Internal"
    CONFIDENTIAL = "confidential", "Confidential"
    RESTRICTED = "restricted", "Restricted"


class Dataset(models.Model):
    """A steward's definition of training data: a filter over the tenant's trajectories.
    Freezing it (governance/datasets.py) makes an immutable DatasetVersion; the filter fields
    are copied onto the version, so editing the definition never changes a frozen version."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True, default="")
    # Agent ids of this tenant (a JSON list of ints); empty: every agent.
    agent_ids = models.JSONField(default=list, blank=True)
    since = models.DateTimeField(null=True, blank=True)  # trajectory started at or after
    until = models.DateTimeField(null=True, blank=True)  # trajectory started before
    # Latest final reward named `reward_name` (by trajectory id or a step's response id) must
    # lie in [reward_min, reward_max]; a trajectory without that reward is left out.
    reward_name = models.CharField(max_length=64, blank=True, default="")
    reward_min = models.FloatField(null=True, blank=True)
    reward_max = models.FloatField(null=True, blank=True)
    # The most restrictive classification a member's steps may carry.
    classification = models.CharField(max_length=32, choices=Classification.choices,
                                      default=Classification.INTERNAL)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="dataset_tenant_name"),
        ]


class DatasetVersion(models.Model):
    """A frozen selection of trajectories: members (DatasetVersionMember), a content hash over
    them, a review sample and the approval state. Approval covers exactly this version; erasure
    or retention of any member invalidates it."""

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        PENDING_APPROVAL = "pending_approval", "Pending approval"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"
        INVALIDATED = "invalidated", "Invalidated"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="dataset_versions")
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    filter = models.JSONField(default=dict)  # the dataset's filter as it was when frozen
    content_hash = models.CharField(max_length=64)
    size = models.PositiveIntegerField(default=0)  # trajectories
    step_count = models.PositiveIntegerField(default=0)
    # Trajectory ids (strings) picked for the reviewer, deterministically from the hash.
    sample_ids = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=24, choices=Status.choices, default=Status.DRAFT,
                              db_index=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                     on_delete=models.SET_NULL, related_name="+")
    requested_at = models.DateTimeField(null=True, blank=True)
    invalidated_at = models.DateTimeField(null=True, blank=True)
    invalidated_reason = models.CharField(max_length=500, blank=True, default="")

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["dataset", "number"],
                                    name="datasetversion_dataset_number"),
        ]


class DatasetVersionMember(models.Model):
    """One trajectory of a frozen version. A table (not an array) so erasure finds the versions
    holding a trajectory with one indexed join, at 1e5+ members per version."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    version = models.ForeignKey(DatasetVersion, on_delete=models.CASCADE,
                                related_name="members")
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE,
                                   related_name="dataset_memberships")

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["version", "trajectory"],
                                    name="dvmember_version_trajectory"),
        ]


class Approval(models.Model):
    """A compliance officer's decision on one dataset version (four eyes: never the person who
    froze it or requested approval — enforced in governance/services.py)."""

    class Decision(models.TextChoices):
        APPROVE = "approve", "Approved"
        REJECT = "reject", "Rejected"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="approvals")
    version = models.OneToOneField(DatasetVersion, on_delete=models.PROTECT,
                                   related_name="approval")
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True,
                                   on_delete=models.SET_NULL, related_name="+")
    decision = models.CharField(max_length=8, choices=Decision.choices)
    reason = models.TextField()
    decided_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()


class RetentionPolicy(models.Model):
    """How long a tenant keeps data of one classification ("*": every classification without a
    policy of its own). Without any policy the defaults of governance/retention.py apply.
    Audit retention is recorded and reported but audit rows are never purged: deleting the
    chain's head would break verification, and its payloads hold pseudonymous ids only."""

    ANY = "*"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="retention_policies")
    classification = models.CharField(max_length=32)
    steps_days = models.PositiveIntegerField()
    raw_days = models.PositiveIntegerField()
    findings_days = models.PositiveIntegerField()
    audit_days = models.PositiveIntegerField()
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "classification"],
                                    name="retention_tenant_classification"),
        ]


class ErasureRequest(models.Model):
    """A GDPR Art. 17 erasure of one data subject in one tenant (governance/erasure.py). The
    subject is stored only as keyed hashes: `subject_hash` (keyring.subject_hash of the subject
    as given) and `lookup_hashes` (the same under each identifier type's normalisation — what
    the subject index and the suppression list hold). The job is chunked and resumable: `stage`
    and `progress` are saved with every batch."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        RUNNING = "running", "Running"
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="erasure_requests")
    subject_hash = models.CharField(max_length=64, db_index=True)
    lookup_hashes = models.JSONField(default=list)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                     on_delete=models.SET_NULL, related_name="+")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING,
                              db_index=True)
    stage = models.CharField(max_length=16, blank=True, default="")
    # Counts per kind so far, affected dataset versions and checkpoints, spool state.
    progress = models.JSONField(default=dict, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    task_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    certificate = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")

    objects = TenantManager()

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at"], name="erasure_tenant_created")]


class SuppressedSubject(models.Model):
    """A keyed subject hash whose later captures are kept as metadata only: the shipper stores
    no raw payload for it and the step builder builds no step (interaction quarantined,
    reason "suppressed subject")."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="suppressed_subjects")
    subject_hash = models.CharField(max_length=64)
    erasure_request = models.ForeignKey(ErasureRequest, null=True, blank=True,
                                        on_delete=models.SET_NULL, related_name="suppressions")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "subject_hash"],
                                    name="suppressed_tenant_subject"),
        ]


class DeadLetter(models.Model):
    """A spool record of this tenant the shipper could not store as an Interaction even after
    making its text storable (capture/shipper.py): the database refused it, or its step id is
    another flow's. Kept so nothing accepted is lost, and so shipping goes on past it. The
    record is sealed like a raw payload, under its subject's (or the tenant's) data key with
    the tenant and flow id as associated data; erasure deletes a subject's dead letters and
    destroying the key shreds them. Records with no usable tenant stay in the spool's
    dead-letter file (operators only)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="dead_letters")
    flow_id = models.CharField(max_length=64)
    # As the record claims them; no foreign keys (the point is that something did not fit).
    agent_ref = models.BigIntegerField(null=True, blank=True)
    trajectory_ref = models.CharField(max_length=64, blank=True, default="")
    subject_hash = models.CharField(max_length=64, blank=True, default="", db_index=True)
    reason = models.TextField()
    segment = models.CharField(max_length=128, blank=True, default="")
    data_key = models.ForeignKey(DataKey, null=True, on_delete=models.SET_NULL,
                                 related_name="dead_letters")
    record_ciphertext = models.BinaryField(null=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantManager()

    class Meta:
        constraints = [
            # The shipper is at-least-once for dead letters: a re-read writes nothing twice.
            models.UniqueConstraint(fields=["tenant", "flow_id"], name="deadletter_tenant_flow"),
        ]


class SpoolState(models.Model):
    """What one shipper last saw in the spool directory it ships (capture/shipper.py writes it
    every round): the segments not yet fully shipped. Erasure (governance/erasure.py) reads
    every row to wait for, or name, each spool still holding unshipped data. Not tenant data:
    segment names and counts only."""

    name = models.CharField(max_length=512, unique=True)  # "<host>:<absolute spool dir>"
    pending_segments = models.JSONField(default=list)
    pending_bytes = models.BigIntegerField(default=0)
    # The start of the shipper's last complete pass: every record the spool held then is
    # shipped (or dead-lettered).
    drained_through = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField()


class WorkerHeartbeat(models.Model):
    """One Celery worker that is up, and the queues it consumes (governance/workers.py writes
    it every HEARTBEAT_SECONDS and deletes it on a clean stop). It is how the console knows
    whether anything listens on the `gpu` queue with any broker — kombu's SQLAlchemy
    transport, the embedded default, has no broadcast, so Celery's inspect/ping cannot reach a
    worker there. No tenant data: a host name and queue names."""

    hostname = models.CharField(max_length=255, primary_key=True)
    queues = models.JSONField(default=list)
    started_at = models.DateTimeField()
    seen_at = models.DateTimeField(db_index=True)
