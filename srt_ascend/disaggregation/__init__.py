"""Prefill-decode disaggregation (`--disaggregation-mode prefill|decode`, SGLang's flags and
sglang-router's protocol; docs/disaggregation.md).

A decode server reserves a request's row and KV slots and registers them at the prefill
server's bootstrap endpoint (`bootstrap`); the prefill server computes the prompt, writes the
KV of every prompt position (main and MTP layers) into the decode server's pool with
Mooncake's transfer engine (`transfer`), and answers the registration with the first token,
its logprobs and, with MTP, the first draft (`prefill`, `decode`: the two servers' request
state machines, driven by the scheduler).
"""
