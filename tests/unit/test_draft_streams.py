"""Seeded requests stay lossless under block verification: the random streams the MTP worker
draws its drafts from are never reused across steps.

Block verification reads every draft of a chain, also those past the accepted ones; if the
next step drew its d_1 from the stream that drew an examined draft before (the same uniform),
that draft would no longer be distributed as its recorded probabilities and the emitted tokens
would drift from the target. The check drives the real `MTPWorker` (its drafting, its stream
keys) over fake model handles whose target and draft distributions are fixed and divergent
(p = [.6, .3, .1], q = [.2, .3, .5], the same after every prefix): lossless decoding then
emits i.i.d. tokens from p. Verification is `block_verify` with the target streams keyed as
`MTPDecoder._accept` keys them (one per step, by the output length at its start).

Power: TOKENS emitted tokens give each frequency a standard deviation of at most
sqrt(.25 / TOKENS) = 0.00088; the check fails beyond 4 of them (0.0035), so a shift of 0.005
in any frequency is caught with probability 0.95. The control keys the draft streams as the
defective worker did (one stream per output position: a step after one that accepted at most
K - 2 drafts draws its d_1 with an examined draft's uniform) and must fail the same check; on
this pair it shifts token 2 by 0.0074 (token 2 of the first emitted token after such a step
by 0.017), 4.5 sd past the threshold.

A round launched under overlap knows its generated count as a range only (`Counts`): its draft
steps, acceptance uniforms and next d_1 must be drawn from the streams a serial round with the
exact count draws from (`test_a_round_launched_ahead_draws_what_a_serial_round_draws`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from srt_ascend.layers.sampler import draw_uniforms, processed_probs
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo, seeded_generator
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.speculative import mtp_worker
from srt_ascend.speculative.acceptance import AcceptResult, block_verify
from srt_ascend.speculative.mtp_decoder import draft_step_kinds
from srt_ascend.speculative.mtp_worker import DraftHandles, MTPWorker

TARGET = torch.tensor([0.6, 0.3, 0.1])
DRAFT = torch.tensor([0.2, 0.3, 0.5])
V, K = 3, 3
BATCH, TOKENS = 4000, 320_000
THRESHOLD = 4 * (0.25 / TOKENS) ** 0.5


@dataclass
class FakeReq:
    """The parts of a scheduler Req the worker and the sampling code read."""

    sampling_params: SamplingParams
    output_ids: list[int] = field(default_factory=lambda: [0])
    origin_input_ids: list[int] = field(default_factory=lambda: [0])
    req_pool_idx: int = 0
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    grammar: None = None
    decoder_state: object = None
    finished: bool = False

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


def _worker(eos_ids: tuple[int, ...] = ()) -> MTPWorker:
    """The real worker over handles whose MTP head always predicts DRAFT."""
    draft_logits = DRAFT.log()
    handles = DraftHandles(
        forward=lambda fb, hidden, step, kind: torch.zeros(fb, 1),
        forward_logits=lambda fb, hidden, step, kind, rows: (
            torch.zeros(fb, 1),
            draft_logits.expand(len(rows), V).clone(),
        ),
        build_forward_batch=lambda mode, ids, rows, seq, ext, loc, *more: len(ids),
        req_to_token=torch.zeros(1, 1, dtype=torch.int64),
        vocab_size=V,
        eos_ids=list(eos_ids),
    )
    return MTPWorker(handles, {K: None}, draft_step_kinds(lambda j: 0, K, None))  # one layer


def _emitted_frequencies() -> torch.Tensor:
    """[V] frequencies of the tokens that seeded requests emit, steps of K drafts verified by
    block verification, TOKENS tokens in all (the first one, never sampled, left out)."""
    worker, k1 = _worker(), K + 1
    reqs = [FakeReq(SamplingParams(seed=s)) for s in range(BATCH)]
    loc = torch.zeros(BATCH, k1, dtype=torch.int64)
    hidden = torch.zeros(BATCH * k1, 1)
    none = torch.zeros(BATCH, dtype=torch.int64)  # the first d_1: after no accepted draft
    first = AcceptResult(none, torch.cat([none.view(-1, 1), none.new_full((BATCH, K), -1)], 1))
    worker.draft_after_verify(reqs, [0] * BATCH, loc, hidden, first, None)
    target_logits = TARGET.log().expand(BATCH, V)
    counts = torch.zeros(V, dtype=torch.int64)
    while int(counts.sum()) < TOKENS:
        drafts = worker.draft_chain(reqs, loc)
        params, lens = [r.sampling_params for r in reqs], [len(r.output_ids) for r in reqs]
        info = SamplingBatchInfo.from_params(params, V, "cpu", seed_offsets=lens)
        target = torch.stack([processed_probs(target_logits, info)] * k1, dim=1)
        res = block_verify(drafts.tokens, drafts.probs, target, generators=list(info.generators))
        # the next d_1 is drawn before the round is committed, as MTPDecoder.step draws it
        starts = [0] * BATCH  # positions are not read by the fake forward
        worker.draft_after_verify(reqs, starts, loc, hidden, res, lens)
        for r, n, row in zip(reqs, res.accept_len.tolist(), res.emitted.tolist()):
            r.output_ids.extend(row[: n + 1])
        emitted = res.emitted[res.emitted >= 0]
        counts += torch.bincount(emitted, minlength=V)
    return counts.to(torch.float64) / counts.sum()


def _old_draft_seed_offset(start_len: int, j: int) -> int:
    """The defective keying: one stream per output position (1_000_003 + position)."""
    return 1_000_003 + start_len + j - 1


@pytest.mark.parametrize("keys", ["fixed", "control"])
def test_seeded_block_verification_emits_the_target(keys, monkeypatch) -> None:
    if keys == "control":
        monkeypatch.setattr(mtp_worker, "draft_seed_offset", _old_draft_seed_offset)
    shift = (_emitted_frequencies() - TARGET.double()).abs().max().item()
    if keys == "control":
        assert shift > THRESHOLD, f"the control went unseen: shift {shift:.4f}"
    else:
        assert shift <= THRESHOLD, f"emitted frequencies off the target by {shift:.4f}"


def test_first_draft_drawn_ahead_is_the_one_drawn_after_the_commit() -> None:
    """A round's next d_1 is drawn before the round is committed (from the accept lengths on
    the device) and must be the d_1 drawn after the commit: for every accept length, the
    seeded stream of the output length it leads to, and the min_new_tokens stop mask (EOS =
    token 2, DRAFT's most likely one) where that length is still below it."""
    k1, batch = K + 1, 240
    accept = torch.tensor([i % k1 for i in range(batch)])
    emitted = torch.where(torch.arange(k1).view(1, -1) <= accept.view(-1, 1), 1, -1)
    verdict = AcceptResult(accept, emitted)
    loc = torch.zeros(batch, k1, dtype=torch.int64)
    hidden = torch.zeros(batch * k1, 1)

    def requests() -> list[FakeReq]:
        reqs = []
        for i in range(batch):  # seeded samples, and greedy rows (the mask decides them)
            p = SamplingParams(temperature=0.0 if i % 5 == 0 else 1.0, seed=i)
            p.min_new_tokens = 1 + (i // k1) % (K + 4)  # reached, decided by the accept, not
            reqs.append(FakeReq(p, output_ids=[0, 0]))
        return reqs

    ahead, after = requests(), requests()
    _worker((2,)).draft_after_verify(ahead, [0] * batch, loc, hidden, verdict, [2] * batch)
    for r, n in zip(after, accept.tolist()):
        r.output_ids.extend([1] * (n + 1))
    _worker((2,)).draft_after_verify(after, [0] * batch, loc, hidden, verdict, None)
    drawn = [int(r.decoder_state.token) for r in ahead]
    assert drawn == [int(r.decoder_state.token) for r in after]
    assert 2 in drawn and len(set(drawn)) == 3  # sampled rows, and rows still masked


def test_a_round_launched_ahead_draws_what_a_serial_round_draws() -> None:
    """A round launched before the round ahead of it is read (MTP under overlap) knows its
    requests' generated counts as ranges only: low + extra, extra (that round's accept
    length) on the device (`Counts`). Its draft steps d_2..d_K, its acceptance uniforms and
    its next d_1 must be those a round with the exact count draws, for every extra: the
    seeded sampled rows' equal (unseeded rows draw from the global RNG, greedy ones by
    argmax)."""
    k1, batch, low = K + 1, 60, 3
    extra = torch.tensor([i % k1 for i in range(batch)])

    def requests() -> list[FakeReq]:
        reqs = []
        for i in range(batch):
            kind = i % 6
            p = SamplingParams(
                temperature=0.0 if kind == 5 else 0.6 + 0.1 * kind,
                top_p=0.9 if kind == 1 else 1.0,
                top_k=2 if kind == 2 else -1,
                seed=None if kind == 4 else 100 + i,
            )
            p.normalize()
            reqs.append(FakeReq(p, output_ids=[0] * (low + int(extra[i]))))
        return reqs

    seeded = [i for i in range(batch) if i % 6 < 4]
    serial, ahead = requests(), requests()
    counts = mtp_worker.Counts([low] * batch, extra, k1)
    worker = _worker()
    loc = torch.zeros(batch, k1, dtype=torch.int64)
    zeros = torch.zeros(batch, dtype=torch.int64)
    first = mtp_worker.FirstDrafts(zeros, DRAFT.expand(batch, V).clone(), torch.zeros(batch, 1))
    chains = [
        worker.draft_chain(serial, loc, first).tokens,  # counts from output_ids
        worker.draft_chain(ahead, loc, first, generated=counts).tokens,
    ]
    assert torch.equal(chains[0][seeded], chains[1][seeded])
    assert len(set(chains[0][seeded, 1:].flatten().tolist())) == V  # sampled drafts
    # the acceptance uniforms: those of the generator at the exact count
    gens = [
        seeded_generator(r.sampling_params.seed, len(r.output_ids)) if i in seeded else None
        for i, r in enumerate(serial)
    ]
    uniforms = [draw_uniforms(gens, k1, "cpu"), mtp_worker.stream_uniforms(ahead, counts, 0, k1)]
    assert torch.equal(uniforms[0][seeded], uniforms[1][seeded])
    # the next round's range overlaps this one's: the draws kept for it are the same numbers
    later = (extra + 1) % k1
    again = mtp_worker.stream_uniforms(
        ahead, mtp_worker.Counts([low + 1] * batch, later, k1), 0, k1
    )
    for i in seeded:
        seed = serial[i].sampling_params.seed
        gen = seeded_generator(seed, low + 1 + int(later[i]))
        assert torch.equal(again[i], draw_uniforms([gen], k1, "cpu")[0])
    # the next d_1, drawn before this round's read too
    accept = torch.tensor([(i // k1) % k1 for i in range(batch)])
    emitted = torch.where(torch.arange(k1).view(1, -1) <= accept.view(-1, 1), 1, -1)
    verdict = AcceptResult(accept, emitted)
    hidden = torch.zeros(batch * k1, 1)
    exact = [len(r.output_ids) for r in serial]
    worker.draft_after_verify(serial, [0] * batch, loc, hidden, verdict, exact)
    worker.draft_after_verify(ahead, [0] * batch, loc, hidden, verdict, counts)
    drawn = [[int(r.decoder_state.token) for r in reqs] for reqs in (serial, ahead)]
    assert [drawn[0][i] for i in seeded] == [drawn[1][i] for i in seeded]
    assert len({drawn[0][i] for i in seeded}) == V
