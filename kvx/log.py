"""kvx's logging: every module logs to ``kvx.<module>``; inside vLLM those lines go through vLLM's own
handler (level, time, process name and pid, file:line, ``VLLM_LOGGING_LEVEL``), and repeated failures
are aggregated.

- :func:`get_logger` is what modules call. It works without vLLM installed (kernels and stores are
  usable alone): the ``kvx`` logger then behaves like any standard-library logger.
- :func:`attach_to_vllm` (called by the plugin entry point and by the connector in every vLLM process)
  puts the ``kvx`` logger under vLLM's, so INFO lines show whenever vLLM's do, formatted alike.
- :class:`Throttle`: a failure that repeats per chunk (a full disk, a store that went away) is logged
  once per cause per interval, with a count, instead of once per chunk and attempt.
"""

from __future__ import annotations

import logging
import threading
import time

ROOT = "kvx"


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``kvx.connector.worker`` -> itself; anything else -> under ``kvx``)."""
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    return logging.getLogger(name)


def attach_to_vllm() -> bool:
    """Make the ``kvx`` logger a child of vLLM's ``vllm`` logger: kvx's records then go through whatever
    handlers and level vLLM's logging has *when they are emitted* (vLLM configures its logging lazily,
    and may reconfigure it), and through the root logger where vLLM leaves logging to the application
    (``VLLM_CONFIGURE_LOGGING=0``). Idempotent; returns False (and changes nothing) without vLLM."""
    try:
        import vllm.logger  # noqa: F401 - vLLM's logging module (configures on first engine use)
    except Exception:  # noqa: BLE001 - no vLLM: standard logging
        return False
    kvx = logging.getLogger(ROOT)
    kvx.parent = logging.getLogger("vllm")  # a top-level logger's parent is the root: re-parent it
    kvx.propagate = True
    return True


class Throttle:
    """Log one line per cause per ``interval_s``, counting what was held back.

    ``warning(cause, msg, *args)`` logs at once the first time ``cause`` is seen in an interval; later
    calls with the same cause only count, and the next line logged for it says how many were held
    back. Thread-safe (the disk writer threads report through it)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0, clock=time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, cause: str, msg: str, *args, stacklevel: int = 2) -> bool:
        """Log ``msg % args`` at ``level`` unless ``cause`` was logged less than ``interval_s`` ago.
        Returns True if a line was written."""
        now = self._clock()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self.interval_s:
                self._held[cause] = self._held.get(cause, 0) + 1
                return False
            held = self._held.pop(cause, 0)
            self._last[cause] = now
        if held:
            msg = f"{msg} (and {held} more like it in the last {self.interval_s:.0f} s)"
        self.logger.log(level, msg, *args, stacklevel=stacklevel)  # file:line of the caller, not this
        return True

    def warning(self, cause: str, msg: str, *args) -> bool:
        return self.log(logging.WARNING, cause, msg, *args, stacklevel=3)

    def error(self, cause: str, msg: str, *args) -> bool:
        return self.log(logging.ERROR, cause, msg, *args, stacklevel=3)

    def held(self) -> dict[str, int]:
        """Counts held back since each cause's last line (for tests and stats)."""
        with self._lock:
            return dict(self._held)
