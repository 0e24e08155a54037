"""Lineage: what every checkpoint learned from, as a manifest anyone can re-verify.

Merkle root over a dataset version's trajectory ids (`merkle_root`), defined as:

    leaves   the trajectory ids as canonical lowercase UUID strings, sorted ascending (the
             same order as governance.datasets.content_hash), deduplicated
    leaf     H(0x00 || utf8(id))
    node     H(0x01 || left || right)          (H = SHA-256, 32-byte digests)
    level    pair the nodes left to right; an odd node out at the end of a level is carried
             up unchanged (never paired with itself, so two different id lists can never
             share a root the way Bitcoin's duplicate-last-node rule allows)
    root     the one node left, as lowercase hex; the empty list: H(b"") hex

The 0x00/0x01 prefixes separate leaves from inner nodes (as RFC 6962 does), so no inner node
can pass for a leaf. A member's inclusion is provable with log2(n) sibling hashes; the manifest
stores the root only.

The manifest (`build_manifest`) is plain JSON, stored on the Checkpoint row and written as
manifest.json inside the checkpoint directory; `manifest_sha256` is the SHA-256 of its
canonical form (sorted keys, compact separators, UTF-8).
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
TRAINER_DIR = Path(__file__).resolve().parent
REPO_DIR = TRAINER_DIR.parent


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def merkle_root(trajectory_ids: Iterable[Any]) -> str:
    """The Merkle root (hex) of a set of trajectory ids, as defined in the module docstring."""
    leaves = sorted({str(t).lower() for t in trajectory_ids})
    if not leaves:
        return hashlib.sha256(b"").hexdigest()
    level = [_h(b"\x00" + tid.encode()) for tid in leaves]
    while len(level) > 1:
        nxt = [_h(b"\x01" + level[i] + level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].hex()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode()


def manifest_sha256(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(manifest)).hexdigest()


def trainer_sources_sha256() -> str:
    """SHA-256 over trainer/*.py (relative path + content, sorted): identifies the training
    code even where git is absent (an installed package, a container image)."""
    h = hashlib.sha256(b"steward-trainer-sources-v1\n")
    for path in sorted(TRAINER_DIR.glob("*.py")):
        h.update(path.name.encode() + b"\n")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _git_describe() -> str | None:
    if not (REPO_DIR / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"],  # noqa: S607
                             cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def code_version() -> dict[str, Any]:
    """git describe when the code runs from a checkout, the package version, and the hash of
    the trainer's sources (always)."""
    try:
        package = metadata.version("steward")
    except metadata.PackageNotFoundError:
        package = None
    return {"git": _git_describe(), "package": package,
            "trainer_sources_sha256": trainer_sources_sha256()}


def build_manifest(*, job: Any, version: Any, trajectory_ids: list[str],
                   approval_ids: list[int], sanitizer_versions: list[str],
                   trainer_state: dict[str, Any], parent: Any, config: dict[str, Any],
                   code: dict[str, Any] | None = None) -> dict[str, Any]:
    """The lineage manifest of one checkpoint (plain JSON)."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "tenant": job.tenant_id,
        "job": job.pk,
        "dataset_version": {
            "id": version.pk,
            "dataset": version.dataset_id,
            "number": version.number,
            "content_hash": version.content_hash,
            "size": len(trajectory_ids),
        },
        "trajectories_merkle_root": merkle_root(trajectory_ids),
        "approvals": sorted(approval_ids),
        "sanitizer_versions": sorted(set(sanitizer_versions)),
        "base_model": {"name": job.base_model, "path": job.base_model_path},
        "reward": {"fn": job.reward_fn, "params": job.reward_params,
                   "reference_reward": job.reference_reward},
        "config": config,
        "seed": config.get("seed"),
        "code_version": code or code_version(),
        "step": trainer_state["step"],
        "weight_version": str(trainer_state["weight_version"]),
        "parent_checkpoint": (
            {"id": parent.pk, "step": parent.step, "manifest_sha256": parent.manifest_sha256}
            if parent is not None else None),
        "files": trainer_state.get("files", {}),
        "trainer_state_sha256": trainer_state.get("_sha256"),
    }


def write_manifest(checkpoint_dir: str | Path, manifest: dict[str, Any]) -> Path:
    path = Path(checkpoint_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path
