"""Grammar-constrained generation below the scheduler, for both grammar backends (xgrammar and
llguidance): compiles are cached and refusals carry the library's messages, per-request
matchers look ahead over drafts without moving, bitmasks cut logits exactly as xgrammar's own
kernel does, and sampling parameters carry one grammar."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from srt_ascend.constrained import (
    Grammar,
    GrammarBackend,
    GrammarError,
    GrammarOptions,
    apply_token_bitmask,
    fill_grammar_bitmask,
)
from srt_ascend.sampling.sample_step import penalised_logits
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import SHIPPED_MODEL

VOCAB = 8192
EOS = 1


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(tokenizer, request):
    b = GrammarBackend(tokenizer, VOCAB, [EOS], GrammarOptions(backend=request.param))
    yield b
    b.shutdown()


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    logits = apply_token_bitmask(torch.zeros(bitmask.shape[0], VOCAB), bitmask)
    return set(torch.nonzero(logits[row] == 0).flatten().tolist())


def tid(tokenizer, text: str) -> int:
    return tokenizer.convert_tokens_to_ids(text)


def test_bitmask_matches_xgrammar_kernel():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, VOCAB // 32), generator=gen, dtype=torch.int32)
    logits = torch.randn(3, VOCAB, generator=gen)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = apply_token_bitmask(logits, bitmask)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


XGRAMMAR_ERRORS = {
    ("regex", "(a|b"): "invalid regex: Regex parsing error at position 5: The parenthesis",
    ("json_schema", "{not json"): "invalid json_schema: Failed to parse JSON",
    ("json_schema", '{"type": "foo"}'): 'invalid json_schema: Unsupported type "foo"',
    ("ebnf", "root ::= "): "invalid ebnf: EBNF parser error",
    ("structural_tag", "[]"): "invalid structural_tag",
}
LLGUIDANCE_ERRORS = {
    ("regex", "(a|b"): "invalid regex: ",
    ("json_schema", "{not json"): "invalid json_schema: ",
    ("json_schema", '{"type": "foo"}'): "invalid json_schema: ",
    ("ebnf", "root ::= ("): "invalid ebnf: ",
    ("structural_tag", "[]"): "structural_tag is not served by --grammar-backend llguidance",
}


def test_compile_is_cached_and_errors_carry_the_librarys_messages(backend):
    spec = ("regex", "(a|b|c)d?")
    assert backend.compile(spec) is backend.compile(spec)
    assert backend.compile(spec).result() is not None
    errors = XGRAMMAR_ERRORS if backend.options.backend == "xgrammar" else LLGUIDANCE_ERRORS
    for spec, message in errors.items():
        with pytest.raises(GrammarError) as e:
            backend.compile(spec).result()
        assert str(e.value).startswith(message), str(e.value)
        assert ".cc:" not in str(e.value)


def test_matcher_looks_ahead_without_moving(backend, tokenizer):
    a, d, b = (tid(tokenizer, t) for t in "adb")
    g = Grammar(backend.compile(("regex", "(a|b|c)d?")).result())
    bitmask = torch.zeros(4, VOCAB // 32, dtype=torch.int32)
    g.fill_bitmask(bitmask, 0, [])
    first = allowed(bitmask, 0)
    assert {a, b} <= first and d not in first and EOS not in first
    g.fill_bitmask(bitmask, 1, [a])
    assert d in allowed(bitmask, 1) and EOS in allowed(bitmask, 1) and a not in allowed(bitmask, 1)
    g.fill_bitmask(bitmask, 2, [a, d])
    assert allowed(bitmask, 2) == {EOS}
    # past the stop token, or past a token the grammar forbids: all allowed (never emitted)
    g.fill_bitmask(bitmask, 3, [a, d, EOS])
    assert len(allowed(bitmask, 3)) == VOCAB
    g.fill_bitmask(bitmask, 3, [d])
    assert len(allowed(bitmask, 3)) == VOCAB
    g.fill_bitmask(bitmask, 0, [])
    assert allowed(bitmask, 0) == first  # the lookaheads left no trace
    assert g.accept(a) and not g.accept(a) and g.accept(d) and not g.is_terminated
    assert g.accept(EOS) and g.is_terminated


def test_batch_bitmask_leaves_rows_without_grammar_open(backend, tokenizer):
    g = Grammar(backend.compile(("regex", "[0-9]+")).result())
    assert fill_grammar_bitmask([None, None], [[], []], VOCAB) is None
    bitmask = fill_grammar_bitmask([None, g], [[], []], VOCAB)
    assert len(allowed(bitmask, 0)) == VOCAB
    digits = allowed(bitmask, 1)
    assert tid(tokenizer, "7") in digits and tid(tokenizer, "a") not in digits


class _Req:
    def __init__(self, params: SamplingParams, grammar: Grammar | None) -> None:
        self.sampling_params = params.normalize()
        self.origin_input_ids = [5, 6]
        self.output_ids: list[int] = []
        self.return_logprob = False
        self.top_logprobs_num = 0
        self.token_ids_logprob = None
        self.grammar = grammar
        self.penalty_state = None


def test_penalised_logits_mask_each_position_after_its_drafts(backend, tokenizer):
    a, d = tid(tokenizer, "a"), tid(tokenizer, "d")
    reqs = [_Req(SamplingParams(regex="(a|b|c)d?"), None), _Req(SamplingParams(), None)]
    reqs[0].grammar = Grammar(backend.compile(("regex", "(a|b|c)d?")).result())
    info = SamplingBatchInfo.from_params([r.sampling_params for r in reqs], VOCAB, "cpu")
    logits = torch.zeros(2, VOCAB)
    first = penalised_logits(logits, reqs, info, [EOS])
    after_ad = penalised_logits(logits, reqs, info, [EOS], torch.tensor([[a, d], [a, d]]))
    assert torch.isinf(first[0]).sum() == VOCAB - len(allowed_row(first[0]))
    assert allowed_row(after_ad[0]) == {EOS}
    assert not torch.isinf(first[1]).any() and not torch.isinf(after_ad[1]).any()


def allowed_row(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(~torch.isinf(row)).flatten().tolist())


def test_sampling_params_take_at_most_one_grammar():
    p = SamplingParams.from_dict({"json_schema": '{"type": "object"}'})
    p.verify(VOCAB)
    assert p.grammar_spec == ("json_schema", '{"type": "object"}')
    assert SamplingParams().grammar_spec is None
    with pytest.raises(ValueError, match="Only one of json_schema, regex, ebnf, structural_tag"):
        SamplingParams(regex="a", ebnf='root ::= "a"').verify(VOCAB)
    with pytest.raises(ValueError, match="regex must be a string"):
        SamplingParams(regex=["a"]).verify(VOCAB)


NOTHING = {  # a grammar that allows no text, in each library's syntax
    "xgrammar": ("ebnf", r"root ::= [^\x00-\U0010FFFF]"),
    "llguidance": ("regex", r"[^\x00-\x{10FFFF}]"),
}


def test_a_grammar_that_allows_nothing_allows_only_stop_tokens(backend):
    g = Grammar(backend.compile(NOTHING[backend.options.backend]).result())
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    g.fill_bitmask(bitmask, 0, [])
    assert allowed(bitmask) == {EOS}
    assert not g.accept(EOS)  # the grammar refuses it: the request ends with an error


def test_verify_logits_mask_every_position_at_once(backend, tokenizer):
    from srt_ascend.sampling.sample_step import verify_logits

    a, d = tid(tokenizer, "a"), tid(tokenizer, "d")
    reqs = [_Req(SamplingParams(repetition_penalty=1.2), None), _Req(SamplingParams(), None)]
    reqs[0].grammar = Grammar(backend.compile(("regex", "(a|b|c)d?")).result())
    info = SamplingBatchInfo.from_params([r.sampling_params for r in reqs], VOCAB, "cpu")
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([[a, d], [d, a]])
    got = verify_logits(logits, reqs, info, [EOS], drafts)
    for j in range(3):
        want = penalised_logits(logits[:, j], reqs, info, [EOS], drafts[:, :j])
        assert torch.equal(got[:, j], want)
    assert allowed_row(got[0, 2]) == {EOS}
