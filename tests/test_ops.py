"""The plugin's custom ops have a CPU kernel on every machine (the interpreter tests run them on CPU
tensors on GPU machines too) besides the current platform's."""

import pytest
import torch

import vllm_sm121.dense.method  # noqa: F401 (registers its ops)
import vllm_sm121.moe.hook  # noqa: F401

OPS = ("dense_fp8_linear", "dense_fp8_linear_rope", "dense_fp8_linear_rope_kv", "add_rmsnorm_mxfp8",
       "add_rmsnorm_mxfp8_router", "gpt_oss_moe_mxfp8")


@pytest.mark.parametrize("name", OPS)
def test_op_has_cpu_and_platform_kernels(name):
    from vllm.platforms import current_platform

    qual = f"sm121::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"), qual
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, current_platform.dispatch_key), qual
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta"), qual  # the fake
