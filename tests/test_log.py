"""kvx.log: kvx's lines go through vLLM's handler and level; repeated failures are aggregated."""

import logging
import subprocess
import sys
import textwrap

from kvx.log import Throttle, attach_to_vllm, get_logger


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_throttle_logs_once_per_cause_per_interval_with_a_count(caplog):
    clock = Clock()
    th = Throttle(logging.getLogger("kvx.test.throttle"), interval_s=30, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvx.test.throttle"):
        for i in range(124):  # one full disk, 124 chunk writes
            th.warning("disk write: OSError: No space left on device", "writing chunk %d failed", i)
        th.warning("load: ChunkError: not on disk", "chunk %d not loaded", 7)  # another cause: its own line
        clock.t = 31
        th.warning("disk write: OSError: No space left on device", "writing chunk %d failed", 124)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "writing chunk 0 failed",
        "chunk 7 not loaded",
        "writing chunk 124 failed (and 123 more like it in the last 30 s)",
    ]
    assert th.held() == {}


def test_module_loggers_live_under_kvx():
    assert get_logger("kvx.connector.worker").name == "kvx.connector.worker"
    assert get_logger("something").name == "kvx.something"


def test_kvx_lines_carry_vllms_level_time_and_process():
    """In a fresh process (vLLM configures logging on import): an INFO line of kvx's shows, formatted by
    vLLM's handler, and a DEBUG line does not (VLLM_LOGGING_LEVEL=INFO)."""
    code = textwrap.dedent("""
        from kvx.log import attach_to_vllm, get_logger
        assert attach_to_vllm()                 # before vLLM configured its logging, as the plugin does
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed
        configure_logging_if_needed(LoggingConfig())
        log = get_logger("kvx.connector.worker")
        log.info("kvx: hello %d", 42)
        log.debug("kvx: hidden")
    """)
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"VLLM_LOGGING_LEVEL": "INFO", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout + p.stderr
    line = next(ln for ln in out.splitlines() if "kvx: hello 42" in ln)
    assert "INFO" in line and "pid=" in line
    assert any(c.isdigit() for c in line.split("INFO", 1)[1][:20])  # a timestamp follows the level
    assert "hidden" not in out


def test_attach_is_idempotent():
    assert attach_to_vllm() and attach_to_vllm()
    kvx = logging.getLogger("kvx")
    assert kvx.parent is logging.getLogger("vllm") and not kvx.handlers
