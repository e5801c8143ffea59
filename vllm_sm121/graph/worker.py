"""The worker of the whole-model graph mode: vLLM's GPU worker building ``WholeModelRunner``.

vLLM 0.26's ``Worker.init_device`` imports ``GPUModelRunner`` inside the method (no runner
class hook; patch to stage: ``model_runner_cls``, design section 2.1), so the module attribute is
bound to the plugin's runner for the duration of that call only.
"""

from __future__ import annotations

import threading

from vllm.v1.worker.gpu_worker import Worker

_lock = threading.Lock()


class WholeModelWorker(Worker):
    def init_device(self):
        if self.use_v2_model_runner:
            from .tail import SECTION_OPTION

            raise ValueError(f"{SECTION_OPTION} extends vLLM's V1 model runner; VLLM_USE_V2_MODEL_RUNNER=1 "
                             "is not supported")
        import vllm.v1.worker.gpu_model_runner as runner_module

        from .runner import WholeModelRunner

        with _lock:
            stock = runner_module.GPUModelRunner
            runner_module.GPUModelRunner = WholeModelRunner
            try:
                return super().init_device()
            finally:
                runner_module.GPUModelRunner = stock

    def sm121_graph_stats(self) -> dict:
        """For ``LLM.collective_rpc("sm121_graph_stats")``: the runner's counters."""
        return self.model_runner.sm121_graph_stats()

    def sm121_graph_verify(self, on: bool = True) -> None:
        """For ``LLM.collective_rpc("sm121_graph_verify", args=(True,))``: see the runner."""
        self.model_runner.sm121_graph_verify(on)

    def sm121_graph_enable(self, on: bool = True) -> None:
        """For ``LLM.collective_rpc("sm121_graph_enable", args=(False,))``: the mode off / on at run
        time (see the runner)."""
        self.model_runner.sm121_graph_enable(on)
