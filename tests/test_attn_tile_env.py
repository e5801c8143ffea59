"""$VLLM_SM121_ATTN_TILE: per-kind tile overrides of the SM121 attention kernels (sweeps, and the
second equally correct configuration the TP tests measure a quantized KV cache's spread with)."""

from __future__ import annotations

import pytest

from vllm_sm121 import platform as P


def test_env_overrides_named_kinds_only(monkeypatch):
    stock = P.attn_tile(P.SM90, "decode", 64)
    monkeypatch.setenv(P.ATTN_TILE_ENV, "prefill=32,32,4,2; prefill_sw=32,16,4,1")
    assert P.attn_tile(P.SM90, "prefill", 64) == P.AttnTile(32, 32, 4, 2)
    assert P.attn_tile(P.SM12X, "prefill", 256) == P.AttnTile(32, 32, 4, 2)  # every family and head size
    assert P.attn_tile(P.SM90, "prefill_sw", 128) == P.AttnTile(32, 16, 4, 1)
    assert P.attn_tile(P.SM90, "decode", 64) == stock
    monkeypatch.delenv(P.ATTN_TILE_ENV)
    assert P.attn_tile(P.SM90, "prefill", 64) == P.ATTN_TILES[(P.SM90, "prefill", 64)]


@pytest.mark.parametrize("text", ["prefil=32,32,4,2", "prefill=32,32,4", "prefill=24,32,4,2", "prefill=32,8,4,2",
                                  "prefill=32,32,3,2", "prefill=32,32,4,0", "prefill=a,b,c,d"])
def test_bad_values_name_the_variable(text):
    with pytest.raises(ValueError, match="VLLM_SM121_ATTN_TILE"):
        P.parse_attn_tile_env(text)


def test_nvfp4_variants_use_their_base_kind_unless_named(monkeypatch):
    monkeypatch.delenv(P.ATTN_TILE_ENV, raising=False)
    # no table entry of their own (sm_12x, or sm_90 head buckets other than 64): the base kind's tile
    assert P.attn_tile(P.SM12X, "prefill_nvfp4", 64) == P.ATTN_TILES[(P.SM12X, "prefill", 64)]
    assert P.attn_tile(P.SM12X, "prefill_sw_nvfp4", 64) == P.ATTN_TILES[(P.SM12X, "prefill_sw", 64)]
    assert P.attn_tile(P.SM90, "prefill_nvfp4", 128) == P.ATTN_TILES[(P.SM90, "prefill", 128)]
    # own entries (sm_90, gpt-oss's head size 64)
    assert P.attn_tile(P.SM90, "prefill_nvfp4", 64) == P.AttnTile(128, 64, 4, 2)
    assert P.attn_tile(P.SM90, "prefill_sw_nvfp4", 64) == P.AttnTile(128, 64, 4, 2)
    assert P.attn_tile(P.SM90, "decode_nvfp4", 64) == P.ATTN_TILES[(P.SM90, "decode_nvfp4", 64)]  # own entry
    # naming a base kind moves its variants too (the TP tests' nvfp4 spread relies on it) ...
    monkeypatch.setenv(P.ATTN_TILE_ENV, "prefill=32,32,4,2;prefill_sw=32,16,4,2")
    assert P.attn_tile(P.SM90, "prefill_nvfp4", 64) == P.AttnTile(32, 32, 4, 2)
    assert P.attn_tile(P.SM90, "prefill_sw_nvfp4", 64) == P.AttnTile(32, 16, 4, 2)
    # ... unless the variant is named itself
    monkeypatch.setenv(P.ATTN_TILE_ENV, "prefill=32,32,4,2;prefill_nvfp4=128,32,8,2")
    assert P.attn_tile(P.SM90, "prefill_nvfp4", 64) == P.AttnTile(128, 32, 8, 2)
    assert P.attn_tile(P.SM90, "prefill", 64) == P.AttnTile(32, 32, 4, 2)
