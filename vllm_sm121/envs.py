"""Environment variables of vllm-sm121 (all prefixed VLLM_SM121_), read in one place."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    VLLM_SM121_FAULT: str = ""

# VLLM_SM121_FAULT (tests only): deliberately break one attention hyperparameter so end-to-end
# numerics checks can prove they detect it (negative control). "drop_sinks" ignores attention
# sinks; "no_window" ignores sliding windows. Unset in normal use; a set value is logged loudly.
FAULTS = ("", "drop_sinks", "no_window")

environment_variables = {
    "VLLM_SM121_FAULT": lambda: os.environ.get("VLLM_SM121_FAULT", ""),
}


def env_int(name: str, default: int) -> int:
    """Integer environment variable ``name`` (read now), ``default`` when unset or blank; any
    other non-integer text is an error naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r}: expected an integer") from None


def __getattr__(name: str):
    if name in environment_variables:
        value = environment_variables[name]()
        if name == "VLLM_SM121_FAULT" and value not in FAULTS:
            raise ValueError(f"VLLM_SM121_FAULT={value!r} is not supported; supported: {FAULTS[1:]} or unset")
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
