"""Serving tools: the ``kvx`` command (:mod:`.cli`, the console script) and the prefill/decode proxy
(:mod:`.pd_proxy`, ``kvx pd-proxy``). Each runs in a process of its own, beside the vLLM servers.
"""
