import logging

from kvx.testing import harness


def _record(msg, exc=None):
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, msg, None, exc_info)


def test_chat_warmup_noise_filter_drops_only_the_tokenizerless_warmup_failure():
    f = harness._NoChatWarmupWithoutTokenizer()
    assert not f.filter(
        _record("Chat template warmup failed", ValueError("Tokenizer not available when `skip_tokenizer_init=True`"))
    )
    assert f.filter(_record("Chat template warmup failed", ValueError("bad template")))
    assert f.filter(_record("Chat template warmup failed", RuntimeError("skip_tokenizer_init")))
    assert f.filter(_record("something else"))


def test_chat_warmup_filter_is_installed_once():
    logger = logging.getLogger("vllm.renderers.base")
    harness._quiet_chat_warmup()
    harness._quiet_chat_warmup()
    assert sum(isinstance(f, harness._NoChatWarmupWithoutTokenizer) for f in logger.filters) == 1
