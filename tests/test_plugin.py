"""The vLLM entry point: declared, loadable by vLLM's own loader, idempotent, lazy, CUDA-free."""

import importlib.metadata
import logging
import subprocess
import sys

import vllm_sm121


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "sm121"]
    assert len(ours) == 1 and ours[0].value == "vllm_sm121:register"
    assert ours[0].load() is vllm_sm121.register


def test_register_is_idempotent_and_logs_once():
    """One line through vLLM's own logger tree ("vllm.sm121" -> vLLM's handlers), however often called."""
    import vllm.logger  # noqa: F401  (vLLM's logging dictConfig resets handlers of loggers made before it)

    records = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("vllm.sm121")
    handler, level = Grab(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        vllm_sm121._registered = None
        first = vllm_sm121.register()
        second = vllm_sm121.register()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert first == second and first, first
    assert len(records) == 1 and "vllm-sm121" in records[0].getMessage() and "SM121" in records[0].getMessage()


def test_vllm_loads_plugin_without_cuda_or_heavy_imports():
    """vLLM's loader finds and runs the plugin; no CUDA context, no kernel import at load time."""
    code = (
        "import sys, torch\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm_sm121\n"
        "assert vllm_sm121._registered is not None, 'plugin did not run'\n"
        "assert not torch.cuda.is_initialized(), 'register() initialised CUDA'\n"
        "assert 'triton' not in sys.modules or 'vllm_sm121.kernels' not in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"VLLM_PLUGINS": "sm121", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_platform_families():
    from vllm_sm121 import platform

    assert platform.arch_family(12, 1) == platform.SM12X
    assert platform.arch_family(12, 0) == platform.SM12X
    assert platform.arch_family(9, 0) == platform.SM90
    assert platform.arch_family(8, 0) is None and platform.arch_family(10, 0) is None
