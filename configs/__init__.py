"""xhc's YAML configs, shipped as package data so that an installed xhc finds them from any directory.

``configs/models/`` holds the zoo presets, ``configs/pretrain/`` the pre-training runs and
``configs/finetune/`` the PEFT finetuning runs, ``configs/sweeps/`` the scaling-law sweeps and
``configs/lm_eval/`` the local lm-eval task.  :func:`config_dir` locates one of them through
``importlib.resources`` (the checkout in a development install, ``site-packages/configs`` in a
wheel install); :func:`resolve_config` turns what a user passed to ``--config`` into a file.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import List

__all__ = ["KINDS", "config_dir", "packaged_configs", "resolve_config"]

KINDS = ("models", "pretrain", "finetune", "sweeps", "lm_eval")


def config_dir(kind: str) -> Path:
    """The directory of the packaged ``kind`` configs (one of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"config kind {kind!r}: expected one of {', '.join(KINDS)}")
    return Path(str(files(__name__) / kind))


def packaged_configs(kind: str) -> List[str]:
    """Names (without ``.yaml``) of the packaged ``kind`` configs, sorted."""
    return sorted(p.stem for p in config_dir(kind).glob("*.yaml") if not p.name.startswith("_"))


def resolve_config(path: str, kind: str) -> str:
    """``path`` if it is a file; else the packaged config it names; else ``path`` unchanged.

    A packaged config can be named as ``configs/<kind>/<name>.yaml`` (the path inside a checkout,
    so README commands work from any directory), ``<name>.yaml`` or ``<name>``.
    """
    if os.path.isfile(path):
        return path
    rel = Path(path)
    parts = rel.parts
    if len(parts) >= 2 and parts[-2] == kind:
        rel = Path(parts[-1])
    name = rel.name if len(rel.parts) == 1 else None
    if name:
        for cand in (name, f"{name}.yaml"):
            p = config_dir(kind) / cand
            if p.is_file():
                return str(p)
    return path
