"""kvx demo's output: kvx's lines and errors by default, vLLM's log with ``--vllm-log``."""

import os
import subprocess
import sys
import textwrap

# A fresh process, as `kvx demo` starts: vLLM, third-party code and kvx each log a warning and an error the
# way the demo's engines do (vLLM's logging set up lazily, kvx's logger put under vLLM's by the connector).
_RUN = textwrap.dedent("""
    import logging, sys, warnings
    from kvx.testing import demo
    if "--vllm-log" not in sys.argv:
        demo.quiet_others()
    import vllm
    from kvx.log import attach_to_vllm, get_logger
    early = logging.getLogger("vllm.triton_utils.importing")
    early.warning("vllm warning before its logging is set up")  # as vLLM's imports log
    attach_to_vllm()
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed, init_logger
    configure_logging_if_needed(LoggingConfig())
    vlog = init_logger("vllm.worker.cpu_worker")
    vlog.warning("vllm warning")
    vlog.error("vllm error")
    warnings.warn_explicit("a FutureWarning of torch's", FutureWarning, "torch/distributed.py", 1, "torch.x")
    klog = get_logger("kvx.connector.worker")
    klog.warning("kvx warning")
    klog.error("kvx error")
""")


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "PYTHONWARNINGS")}
    p = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


def test_default_output_is_kvx_lines_and_errors_only():
    out = _run()
    lines = out.splitlines()
    assert not [ln for ln in lines if "WARNING" in ln and "kvx" not in ln], out  # no vLLM warning lines
    assert "vllm warning" not in out and "FutureWarning" not in out, out
    assert sum("vllm error" in ln for ln in lines) == 1, out
    assert sum("kvx warning" in ln for ln in lines) == 1, out  # once: kvx's handler, not vLLM's too
    assert sum("kvx error" in ln for ln in lines) == 1, out


def test_vllm_log_restores_vllms_warnings():
    out = _run("--vllm-log")
    assert "vllm warning before its logging is set up" in out and "FutureWarning" in out, out
    assert any("WARNING" in ln and "vllm warning" in ln for ln in out.splitlines()), out
    assert "vllm error" in out and "kvx warning" in out and "kvx error" in out, out
