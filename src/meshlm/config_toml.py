"""Writing a resolved config as TOML (`run.dir/config.toml`, checkpoints, final/).

Hand-written because tomllib only reads, and a flat table of scalars per section needs nothing
more; None values are left out (TOML has no null) and reload as None (config.load_config).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):  # data.blend: a TOML inline array
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    # A JSON string is a TOML basic string: quotes, backslashes, newlines, tabs and every other
    # control character escaped (a prompt from a TOML file may hold any of them), but DEL, which
    # JSON leaves as it is and TOML forbids.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def to_toml(cfg) -> str:
    """The resolved config (meshlm.config.Config) as TOML, one table per section."""
    lines = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
