"""Sampling inside a captured MTP round (issue 43 item 3, the sampled half).

A round graph's sampled variant draws its drafts, runs the lossless acceptance rule and draws
the next d_1 on the device, from one static float32 block of per-row inputs the host fills
before the replay (one packed copy, `host_block`):

    temperature | top_p | min_p | top_k | greedy | renorm | pin | U_chain | U_verify | U_next

- the sampling settings `SamplingBatchInfo` tensorises (top_k as a float: exact below 2^24);
- `renorm` and `pin` (the same in every row): the batch-wide choices `processed_probs` makes
  on the host (`need_top_p_top_k or need_min_p`: renormalise after the masks; `need_top_p_top_k`:
  pin greedy rows to the one-hot argmax), so each row's distribution has the bits the
  per-forward path gives it in the same batch (`static_probs`);
- the uniforms in (0, 1], `1 - rand` as `draw_uniforms` / `uniforms_among` make them, for
  every count the row may have (one in a serial round; an overlapped round's range,
  `Counts`, picked on the device at `extra`): draft step j's (seeded: the stream
  `draft_seed_offset(count, j+1)`), the verify's U_1..U_{K+1} (seeded: the stream of the
  count), and the next d_1's, one per count the round may leave (seeded:
  `draft_seed_offset(count + a + 1, 1)`), picked at extra + the accept length. Seeded rows
  take `stream_draws` (the numbers the per-forward path draws); the others the host's
  global RNG.

Which batches: no logprobs, and nothing that modifies the logits (`plain_sampling`: no
penalties, logit bias, grammar, nor min_new_tokens ahead)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt_ascend.decoding.base import StepRequest
from srt_ascend.layers.linear import sum_last
from srt_ascend.layers.sampler import inverse_cdf_sample, over_temperature, top_k_top_p_keep_mask
from srt_ascend.sampling.penalty_state import has_penalties
from srt_ascend.speculative.mtp_worker import stream_draws

SETTINGS = 7  # temperature, top_p, min_p, top_k, greedy, renorm, pin


def plain_sampling(reqs: Sequence[StepRequest], generated: Sequence[int]) -> bool:
    """Every request samples from its raw logits (greedy or not) and asks no logprobs: no
    penalties, logit bias nor grammar, min_new_tokens reached (`all_plain_greedy`'s rule
    without its greedy condition)."""
    for r, n in zip(reqs, generated):
        p = r.sampling_params
        if r.return_logprob or r.grammar is not None or n < p.min_new_tokens:
            return False
        if p.logit_bias or has_penalties(p):
            return False
    return True


def columns(k_max: int) -> int:
    """Width of the block for rounds of up to `k_max` drafts: the settings, then per count
    candidate (C = k_max + 1 of them) draft steps' and the verify's uniforms, then the next
    d_1's candidates (C + k_max)."""
    c = k_max + 1
    return SETTINGS + c * (k_max - 1) + c * (k_max + 1) + c + k_max


def padding_rows(n: int, k_max: int, device="cpu") -> torch.Tensor:
    """`n` padding rows of the block: greedy (top_k 1), temperature 1, every uniform 1."""
    rows = torch.ones(n, columns(k_max), dtype=torch.float32, device=device)
    rows[:, 5:7] = 0.0
    return rows


def host_block(
    reqs: Sequence[StepRequest],
    low: Sequence[int],  # tokens each generated before the round: the lowest count it may have
    span: int,  # counts low .. low+span-1 (1: exact; an overlapped round's range: `Counts`)
    k: int,
    k_max: int,
    bucket: int,
    vocab: int,
) -> torch.Tensor:  # [bucket, columns(k_max)] float32 on the host
    """The block the sampled round graph reads: its rows' settings and, for each count the
    row may have, its uniforms (module docstring); padding rows past the batch. A seeded
    row's are its streams' (`stream_draws`, as `stream_uniforms` draws them)."""
    block = padding_rows(bucket, k_max)
    c = k_max + 1
    chain = SETTINGS
    verify = chain + c * (k_max - 1)
    nxt = verify + c * (k_max + 1)
    top_ks, top_ps, min_ps = [], [], []
    for i, (r, g) in enumerate(zip(reqs, low)):
        p = r.sampling_params
        top_k = 1 if p.is_greedy else p.top_k
        top_k = vocab if top_k < 1 or top_k > vocab else top_k
        top_ks.append(top_k)
        top_ps.append(float(p.top_p))
        min_ps.append(float(p.min_p))
        row = block[i]
        row[0], row[1], row[2] = p.sampling_temperature, p.top_p, p.min_p
        row[3], row[4] = float(top_k), float(p.is_greedy)
        steps = row[chain:verify].view(c, k_max - 1)
        verifies = row[verify:nxt].view(c, k_max + 1)
        if p.seed is None or p.is_greedy:  # the global RNG (a greedy row's decide nothing)
            steps[:span, : k - 1] = 1.0 - torch.rand(span, k - 1)
            verifies[:span, : k + 1] = 1.0 - torch.rand(span, k + 1)
            row[nxt : nxt + span + k] = 1.0 - torch.rand(span + k)
            continue
        for j in range(1, k):  # draft step j draws draft j+1
            steps[:span, j - 1] = 1.0 - stream_draws(r, j + 1, 1, g, span)[:, 0]
        verifies[:span, : k + 1] = 1.0 - stream_draws(r, 0, k + 1, g, span)
        row[nxt : nxt + span + k] = 1.0 - stream_draws(r, 1, 1, g + 1, span + k)[:, 0]
    pin = any(t < vocab for t in top_ks) or any(t < 1.0 for t in top_ps)
    renorm = pin or any(m > 0.0 for m in min_ps)
    block[: len(reqs), 5] = float(renorm)
    block[: len(reqs), 6] = float(pin)
    return block


class RowSettings:
    """Views of the block (`host_block`) for the first `bs` rows of a round of K drafts,
    inside the graph; `extra` [B]: each row's count past its lowest (0 in a serial round)."""

    def __init__(self, block: torch.Tensor, extra: torch.Tensor, k: int, k_max: int) -> None:
        bs, c = extra.shape[0], k_max + 1
        rows = block[:bs]
        self.temperatures = rows[:, 0:1]
        self.top_ps, self.min_ps = rows[:, 1], rows[:, 2]
        self.top_ks = rows[:, 3].to(torch.int64)
        self.greedy = rows[:, 4] > 0
        self.renorm = rows[:, 5:6] > 0
        self.pin = rows[:, 6:7] > 0
        chain = SETTINGS
        verify = chain + c * (k_max - 1)
        nxt = verify + c * (k_max + 1)
        self.extra = extra
        self.u_chain = _at(rows[:, chain:verify].reshape(bs, c, k_max - 1), extra)[:, : k - 1]
        self.u_verify = _at(rows[:, verify:nxt].reshape(bs, c, k_max + 1), extra)[:, : k + 1]
        self._next = rows[:, nxt : nxt + c + k_max]

    def u_next(self, accept_len: torch.Tensor) -> torch.Tensor:  # [B]
        """The next d_1's uniform: the candidate of the count the round leaves."""
        return self._next.gather(1, (self.extra + accept_len).view(-1, 1)).squeeze(1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] float32
        return static_probs(logits, self)

    def sample(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # [B]
        """`sample_from_probs`: argmax for greedy rows, else the inverse CDF at `uniforms`."""
        return torch.where(self.greedy, probs.argmax(dim=-1), inverse_cdf_sample(probs, uniforms))


def _at(candidates: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """[B, C, n] -> [B, n]: each row's candidate `pick` [B]."""
    index = pick.view(-1, 1, 1).expand(-1, 1, candidates.shape[-1])
    return candidates.gather(1, index).squeeze(1)


def static_probs(logits: torch.Tensor, s: RowSettings) -> torch.Tensor:
    """`processed_probs` with its batch-wide branches as device selections (`s.renorm`,
    `s.pin`): every mask computed, each row's value the one the host's branch gives it. A
    row whose settings keep every token gets an all-true mask, so the masks of the branches
    not taken change nothing."""
    logits = logits.to(torch.float32)
    probs = torch.softmax(over_temperature(logits, s.temperatures), dim=-1)
    keep = top_k_top_p_keep_mask(probs, s.top_ks, s.top_ps)
    keep &= probs >= probs.amax(dim=-1, keepdim=True) * s.min_ps.view(-1, 1)
    masked = probs.masked_fill(~keep, 0.0)
    masked = masked / sum_last(masked)
    probs = torch.where(s.renorm, masked, probs)
    greedy = one_hot(logits.argmax(dim=-1), logits.shape[-1])
    return torch.where(s.pin & s.greedy.view(-1, 1), greedy, probs)


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # [B, V] float32
    """`one_hot_probs` by a scatter: the same values, and no range check that reads the
    tokens on the host (one_hot's off CUDA), which a captured graph cannot do."""
    out = torch.zeros(tokens.shape[0], vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_(1, tokens.view(-1, 1), 1.0)
