"""Registration of the plugin's custom ops (library ``sm121``)."""

from __future__ import annotations

from torch.library import Library

LIBRARY = "sm121"
lib = Library(LIBRARY, "FRAGMENT")


def register_op(name: str, fn, fake_impl, mutates_args: list[str] | None = None) -> None:
    """``torch.ops.sm121.<name>`` through vLLM's ``direct_register_custom_op`` (the current
    platform's dispatch key, as vLLM's own ops), and on CPU too: the kernels also run on CPU tensors
    under the Triton interpreter, which the interpreter tests use on GPU machines as well."""
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(name, fn, mutates_args=mutates_args or [], fake_impl=fake_impl, target_lib=lib)
    if current_platform.dispatch_key != "CPU":
        lib.impl(name, fn, dispatch_key="CPU")
