"""The Triton copy kernel compiles for GPU targets (sm_80/sm_90) without a GPU.

Builds the exact launches ``kvx.triton_kernels.copy`` issues (via ``_launch_args``), specializes them
the way Triton's JIT does at launch, and compiles to cubin with ``triton.compile(..., target=GPUTarget)``.
Runs in a subprocess without ``TRITON_INTERPRET``. Uses Triton internals of 3.x: skipped with a reason
if this Triton lays them out differently.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as e:
        print("SKIP", e); sys.exit(0)
    import kvx.triton_kernels.copy as C
    from kvx.kernels import ops
    from kvx.kernels.layout import Op, copy_geometry
    from kvx.testing import make_layout

    fn = C._copy_rows_kernel
    if not hasattr(fn, "_pack_args"):
        print("SKIP JITFunction._pack_args missing"); sys.exit(0)
    cases = [("LBNHC", torch.bfloat16, 8, 128, "blocks"), ("LBNHC", torch.bfloat16, 8, 128, "slots"),
             ("LBNHC", torch.bfloat16, 8, 128, "pages"), ("mla", torch.bfloat16, 1, 576, "blocks"),
             ("flash", torch.uint8, 3, 5, "slots")]
    n = 0
    for arch in (90, 80):
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        for name, dtype, heads, hs, kind in cases:
            lay = make_layout(name, num_layers=2, num_blocks=8, block_size=16, num_heads=heads, head_size=hs,
                              dtype=dtype)
            shape = lay.page_shape(3) if kind == "pages" else lay.canonical_shape(3 * 16 if kind == "blocks" else 3)
            buf = torch.empty(shape, dtype=torch.uint8 if kind == "pages" else dtype)
            plan = copy_geometry(Op("gather_" + kind), lay, buf, 3)
            for direction in (0, 1):
                grid, args, meta = C._launch_args(plan, lay.layer_ptrs().tolist(), torch.zeros(3, dtype=torch.int64),
                                                  buf, direction, lay.plane_views(0)[0])
                binder = create_function_from_signature(fn.signature, fn.params, backend)
                bound, spec, options = binder(*args, **meta)
                options, signature, constexprs, attrs = fn._pack_args(backend, dict(meta), bound, spec, options)
                k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                   options=options.__dict__)
                assert k.asm["cubin"], (name, kind)
                n += 1
    print("COMPILED", n)
""")


def test_triton_kernel_compiles_for_sm90_and_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path)
    )
    out = p.stdout + p.stderr
    if p.stdout.startswith("SKIP"):
        pytest.skip(f"this Triton's internals differ: {p.stdout.strip()}")
    assert p.returncode == 0 and "COMPILED 20" in p.stdout, out[-4000:]
