"""The run manifest: what was run, with which code, where.

Pure data: the harness probes the environment, the git state and the engine version
(harness/environment.py) and passes them in.
"""

from __future__ import annotations

from datetime import datetime, timezone

MANIFEST_FORMAT = "deepinfer-manifest/1"


def build_manifest(*, engine: dict, checkpoint: dict, suite: dict, seeds: dict, variant: dict, environment: dict,
                   git: dict, engine_version: str) -> dict:
    """The manifest.json of a run."""
    return {
        "format": MANIFEST_FORMAT,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "engine_version": engine_version,
        "git": git,
        "environment": environment,
        "engine": engine,
        "checkpoint": checkpoint,
        "suite": suite,
        "seeds": seeds,
        "variant": variant,
    }


def describe_protocol(protocol: object) -> str:
    """A manifest's `checkpoint.protocol` (what prompts are rendered with) in words, for messages:
    "the v4 encoding (deepseek-recipe 0.2.0)"; "no recorded protocol" for manifests written before it."""
    if not isinstance(protocol, dict):
        return "no recorded protocol"
    encoding = f"the {protocol.get('encoding')} encoding" if protocol.get("encoding") else "no official encoding"
    recipe = f"deepseek-recipe {protocol['recipe']}" if protocol.get("recipe") else "deepseek-recipe not installed"
    return f"{encoding} ({recipe})"
