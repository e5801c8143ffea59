"""Test set-up: CPU runs use Triton's interpreter; GPU tests are marked ``gpu`` and skip without CUDA.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is created, so it is decided
here, before the kernel modules are imported by the tests.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cuda" if HAS_CUDA else "cpu",
        help="device for kernel tests: cpu (Triton interpreter) or cuda",
    )


@pytest.fixture
def device(request) -> str:
    return request.config.getoption("--device")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def exact_moe_products(monkeypatch):
    """Pin the MoE FMA GEMVs to the exact fp32 products ($VLLM_SM121_MOE_FMA_F16X2=0) for tests that
    hold them to the exact rules (FC1 within one e4m3 step of the reference): on a GPU the packed
    fp16 products are the default; a test of those sets the variable itself."""
    monkeypatch.setenv("VLLM_SM121_MOE_FMA_F16X2", "0")
