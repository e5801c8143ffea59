"""The random gpt-oss checkpoint writer: real HF MXFP4 names/shapes/dtypes, sane values, determinism.

The expected tensor list is written out here from reading vLLM 0.26's
``vllm/model_executor/models/gpt_oss.py`` (``hf_to_vllm_mapper``, ``_load_weights_mxfp4``) and
``vllm/model_executor/layers/quantization/mxfp4.py`` (``Mxfp4MoEMethod.create_weights``), not
imported from the writer, so the two are independent.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import pytest
import torch
from safetensors import safe_open

from vllm_sm121.testing.checkpoint import dequant_mxfp4, write_random_gpt_oss_checkpoint

MODELS = pathlib.Path(__file__).resolve().parent.parent / "models"
TINY = MODELS / "gpt-oss-tiny"
BF16, U8 = torch.bfloat16, torch.uint8


def expected_tensors(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF tensor the vLLM gpt-oss MXFP4 loader needs for ``cfg`` (nothing more)."""
    h, inter, n_exp = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    n_q, n_kv, d, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    out = {
        "model.embed_tokens.weight": ((vocab, h), BF16),  # -> model.embedding.weight
        "model.norm.weight": ((h,), BF16),
    }
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = ((vocab, h), BF16)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((h,), BF16)
        out[p + "post_attention_layernorm.weight"] = ((h,), BF16)
        # self_attn. -> attn.; q/k/v stack into qkv_proj (QKVParallelLinear, bias=True)
        for proj, rows in (("q_proj", n_q * d), ("k_proj", n_kv * d), ("v_proj", n_kv * d)):
            out[p + f"self_attn.{proj}.weight"] = ((rows, h), BF16)
            out[p + f"self_attn.{proj}.bias"] = ((rows,), BF16)
        out[p + "self_attn.o_proj.weight"] = ((h, n_q * d), BF16)
        out[p + "self_attn.o_proj.bias"] = ((h,), BF16)
        out[p + "self_attn.sinks"] = ((n_q,), BF16)  # narrowed per TP rank along dim 0
        out[p + "mlp.router.weight"] = ((n_exp, h), BF16)
        out[p + "mlp.router.bias"] = ((n_exp,), BF16)
        e = p + "mlp.experts."
        # w13_weight: view(E, 2I, -1) must give create_weights' [E, 2I, H/2] uint8
        out[e + "gate_up_proj_blocks"] = ((n_exp, 2 * inter, h // 32, 16), U8)
        out[e + "gate_up_proj_scales"] = ((n_exp, 2 * inter, h // 32), U8)
        out[e + "gate_up_proj_bias"] = ((n_exp, 2 * inter), BF16)
        # w2_weight: view(E, -1, I/2) must give [E, H, I/2] uint8
        out[e + "down_proj_blocks"] = ((n_exp, h, inter // 32, 16), U8)
        out[e + "down_proj_scales"] = ((n_exp, h, inter // 32), U8)
        out[e + "down_proj_bias"] = ((n_exp, h), BF16)
    return out


def load_all(path: pathlib.Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[pathlib.Path, float]:
    out = tmp_path_factory.mktemp("gpt-oss-tiny-random")
    t0 = time.perf_counter()
    ret = write_random_gpt_oss_checkpoint(str(TINY), str(out), seed=0)
    elapsed = time.perf_counter() - t0
    assert pathlib.Path(ret) == out
    return out, elapsed


@pytest.fixture(scope="module")
def tiny_tensors(tiny) -> dict[str, torch.Tensor]:
    return load_all(tiny[0])


def test_files_and_config(tiny):
    out, elapsed = tiny
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == (TINY / "config.json").read_bytes()
    # < 2 s on a workstation; a loose bound so a slow shared CI box does not flake.
    assert elapsed < 30, f"tiny checkpoint took {elapsed:.1f} s"


def test_every_loader_tensor_has_real_shape_and_dtype(tiny_tensors):
    cfg = json.loads((TINY / "config.json").read_text())
    want = expected_tensors(cfg)
    assert set(tiny_tensors) == set(want), (
        f"missing {sorted(set(want) - set(tiny_tensors))}, extra {sorted(set(tiny_tensors) - set(want))}"
    )
    for name, (shape, dtype) in want.items():
        t = tiny_tensors[name]
        assert tuple(t.shape) == shape and t.dtype == dtype, (name, tuple(t.shape), t.dtype, shape, dtype)


def test_loader_reshapes_fit_create_weights(tiny_tensors):
    cfg = json.loads((TINY / "config.json").read_text())
    h, inter, n_exp = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    e = "model.layers.0.mlp.experts."
    # the views _load_weights_mxfp4 applies before copying into the MoE parameters
    assert tiny_tensors[e + "gate_up_proj_blocks"].view(n_exp, 2 * inter, -1).shape == (n_exp, 2 * inter, h // 2)
    assert tiny_tensors[e + "down_proj_blocks"].view(n_exp, -1, inter // 2).shape == (n_exp, h, inter // 2)


def test_names_map_onto_vllm_parameters(tiny_tensors):
    gpt_oss = pytest.importorskip("vllm.model_executor.models.gpt_oss")
    mapped = dict(gpt_oss.GptOssForCausalLM.hf_to_vllm_mapper.apply((n, n) for n in tiny_tensors))
    assert len(mapped) == len(tiny_tensors)
    suffixes = (
        ".embedding.weight", ".norm.weight", "lm_head.weight", "layernorm.weight",
        ".attn.q_proj.weight", ".attn.q_proj.bias", ".attn.k_proj.weight", ".attn.k_proj.bias",
        ".attn.v_proj.weight", ".attn.v_proj.bias", ".attn.o_proj.weight", ".attn.o_proj.bias",
        ".attn.sinks", ".router.weight", ".router.bias",
        ".experts.w13_weight", ".experts.w13_weight_scale", ".experts.w13_bias",
        ".experts.w2_weight", ".experts.w2_weight_scale", ".experts.w2_bias",
    )  # fmt: skip
    for vllm_name in mapped:
        assert vllm_name.endswith(suffixes), vllm_name
    assert sum(n.endswith(".experts.w13_weight") for n in mapped) == json.loads((TINY / "config.json").read_text())[
        "num_hidden_layers"
    ]


def test_dequant_nibble_order_low_first():
    blocks = torch.zeros(1, 16, dtype=U8)  # one block of 32 codes -> 32 values
    blocks[0, 0] = 0x21  # low nibble 1 (+0.5) is element 0, high nibble 2 (+1.0) element 1
    blocks[0, 1] = 0xF9  # low 9 (-0.5), high 15 (-6.0)
    ref = torch.zeros(32)
    ref[:4] = torch.tensor([0.5, 1.0, -0.5, -6.0])
    assert torch.equal(dequant_mxfp4(blocks, torch.tensor([127], dtype=U8)), ref)
    assert torch.equal(dequant_mxfp4(blocks, torch.tensor([128], dtype=U8)), 2 * ref)
    assert torch.equal(dequant_mxfp4(blocks, torch.tensor([120], dtype=U8)), ref / 128)


def test_dequant_matches_triton_kernels_reference(tiny_tensors):
    mxfp = pytest.importorskip("vllm.third_party.triton_kernels.numerics_details.mxfp")
    e = "model.layers.1.mlp.experts."
    blocks = tiny_tensors[e + "down_proj_blocks"][2, :64]  # [64, I/32, 16]
    scales = tiny_tensors[e + "down_proj_scales"][2, :64]
    ref = mxfp.upcast_from_mxfp_torch(blocks.flatten(-2), scales, torch.float32, axis=-1)
    torch.testing.assert_close(dequant_mxfp4(blocks, scales), ref, rtol=0, atol=0)


@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_expert_weights_dequantize_to_realistic_scale(tiny_tensors, proj):
    cfg = json.loads((TINY / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    e = "model.layers.0.mlp.experts."
    w = dequant_mxfp4(tiny_tensors[e + f"{proj}_blocks"][0], tiny_tensors[e + f"{proj}_scales"][0])
    assert w.shape == ((2 * inter, h) if proj == "gate_up_proj" else (h, inter))
    assert torch.isfinite(w).all()
    assert 0.01 <= w.std().item() <= 0.04, w.std().item()
    scales = tiny_tensors[e + f"{proj}_scales"]
    assert scales.min() >= 100 and scales.max() <= 140  # no 0/255 (e8m0 NaN) or wild exponents


def test_dense_tensor_statistics(tiny_tensors):
    for name, t in tiny_tensors.items():
        if t.dtype == U8:
            continue
        x = t.float()
        assert torch.isfinite(x).all(), name
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            assert abs(x.mean().item() - 1.0) < 0.01 and x.std().item() < 0.05, name
        elif name.endswith(".sinks"):
            assert x.abs().max().item() < 8, name  # N(0, 1), 64 heads
        elif x.numel() >= 256:  # N(0, 0.02) weights and biases
            assert abs(x.mean().item()) < 0.01 and 0.015 <= x.std().item() <= 0.025, name
        else:  # e.g. the router bias, one value per expert
            assert x.abs().max().item() < 0.2, name


def test_num_layers_override_and_determinism(tmp_path):
    a = write_random_gpt_oss_checkpoint(str(TINY), str(tmp_path / "a"), seed=7, num_layers=1)
    b = write_random_gpt_oss_checkpoint(str(TINY), str(tmp_path / "b"), seed=7, num_layers=1)
    c = write_random_gpt_oss_checkpoint(str(TINY), str(tmp_path / "c"), seed=8, num_layers=1)
    cfg = json.loads((pathlib.Path(a) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["layer_types"] == ["sliding_attention"]
    src = json.loads((TINY / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "layer_types")} == {
        k: v for k, v in src.items() if k not in ("num_hidden_layers", "layer_types")
    }

    def digest(d: str) -> str:
        return hashlib.sha256((pathlib.Path(d) / "model.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    tensors = load_all(pathlib.Path(a))
    assert set(tensors) == set(expected_tensors(cfg))
    assert not any(n.startswith("model.layers.1.") for n in tensors)


def test_num_layers_longer_than_config_alternates(tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    small = json.loads((TINY / "config.json").read_text())
    small.update(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 vocab_size=128, num_local_experts=2)  # fmt: skip
    (cfg_dir / "config.json").write_text(json.dumps(small))
    out = write_random_gpt_oss_checkpoint(str(cfg_dir), str(tmp_path / "out"), num_layers=6)
    cfg = json.loads((pathlib.Path(out) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 6
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 3
    tensors = load_all(pathlib.Path(out))
    want = expected_tensors(cfg)
    assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == want


def test_tied_embeddings_drop_lm_head(tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    small = json.loads((TINY / "config.json").read_text())
    small.update(hidden_size=64, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 vocab_size=128, num_local_experts=2, tie_word_embeddings=True)  # fmt: skip
    (cfg_dir / "config.json").write_text(json.dumps(small))
    out = write_random_gpt_oss_checkpoint(str(cfg_dir), str(tmp_path / "out"), num_layers=2)
    tensors = load_all(pathlib.Path(out))
    assert "lm_head.weight" not in tensors
    assert set(tensors) == set(expected_tensors(json.loads((pathlib.Path(out) / "config.json").read_text())))


def test_rejects_unquantized_or_unblocked_configs(tmp_path):
    cfg = json.loads((TINY / "config.json").read_text())
    for bad in ({"quantization_config": None}, {"intermediate_size": 100}):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError):
            write_random_gpt_oss_checkpoint(str(d), str(d / "out"), num_layers=1)
