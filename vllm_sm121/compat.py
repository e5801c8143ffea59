"""The only module that touches vLLM private surfaces.

Each touch is an explicit step with a register entry (symbol, why, how, upstream patch, removal
plan) and a matching diff under ``patches/vllm/``; ``tests/test_compat.py`` checks that each
named patch exists and applies to the installed vLLM 0.26.0 source.
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger("vllm_sm121")

BACKEND_NAME = "SM121"
BACKEND_CLASS_PATH = "vllm_sm121.attention.backend.SM121AttentionBackend"


@dataclasses.dataclass(frozen=True)
class Shim:
    symbol: str
    why: str
    how: str
    patch: str  # file under patches/vllm/
    removal: str


SHIMS: list[Shim] = [
    Shim(
        symbol="vllm.v1.attention.backends.registry.AttentionBackendEnum (name lookup)",
        why="`--attention-backend SM121` is resolved with AttentionBackendEnum[name.upper()]; a new "
            "enum member would not survive the spawn of engine/worker processes (they unpickle the "
            "config before plugins load).",
        how="register_backend(CUSTOM, path) (public) + the alias SM121 -> CUSTOM in the enum's "
            "_member_map_ (private), in every process through the general plugin.",
        patch="0001-attention-backend-registry-named-custom-backends.patch",
        removal="once upstream accepts registered names (the patch), register under 'SM121' directly",
    ),
]


def register_attention_backend() -> None:
    """Make ``SM121`` a valid attention-backend name resolving to our backend (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    # Shim 0001: alias the name. CUSTOM pickles by value, so spawned processes see CUSTOM too.
    members = AttentionBackendEnum._member_map_
    if members.get(BACKEND_NAME) not in (None, AttentionBackendEnum.CUSTOM):
        raise RuntimeError(f"attention backend name {BACKEND_NAME} is already taken by {members[BACKEND_NAME]}")
    members[BACKEND_NAME] = AttentionBackendEnum.CUSTOM
