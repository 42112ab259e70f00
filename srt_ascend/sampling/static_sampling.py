"""Sampling inside a captured graph: `processed_probs` and `sample_from_probs` over settings
held in a static float32 block the host fills before the replay (one packed copy), so a graph
can end with the sampled tokens (plain decoding's `decode_sampled`, GraphKind.sampled) or draw
inside an MTP round (speculative/round_sampling).

A block row starts with the SETTINGS columns

    temperature | top_p | min_p | top_k | greedy | renorm | pin

the values `SamplingBatchInfo` tensorises (top_k as a float: exact below 2^24) and the
batch-wide choices `processed_probs` makes on the host (`renorm`: need_top_p_top_k or
need_min_p, renormalise after the masks; `pin`: need_top_p_top_k, pin greedy rows to the
one-hot argmax), the same in every row: each row's distribution then has the bits the eager
path gives it in the same batch (`static_probs`). A decode block adds one uniform per row,
in (0, 1] as `draw_uniforms` makes it (`decode_block`).

Which batches: no logprobs, and nothing that modifies the logits (`plain_sampling`: no
penalties, logit bias, grammar, nor min_new_tokens ahead)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt_ascend.layers.linear import sum_last
from srt_ascend.layers.sampler import inverse_cdf_sample, over_temperature, top_k_top_p_keep_mask
from srt_ascend.sampling.sample_step import SamplingRequest, raw_logits
from srt_ascend.sampling.sampling_batch_info import effective_top_k, seeded_generator

SETTINGS = 7  # temperature, top_p, min_p, top_k, greedy, renorm, pin


def plain_sampling(reqs: Sequence[SamplingRequest], generated: Sequence[int]) -> bool:
    """Every request samples from its `raw_logits` (greedy or not) and asks no logprobs."""
    return raw_logits(reqs, generated) and not any(r.return_logprob for r in reqs)


def fill_settings(block: torch.Tensor, reqs: Sequence[SamplingRequest], vocab: int) -> None:
    """The settings columns of the block's first rows, one per request (`SamplingBatchInfo`'s
    values, and the batch's `renorm` and `pin` choices), written at once."""
    rows = []
    for r in reqs:
        p = r.sampling_params
        top_k = effective_top_k(p, vocab)
        rows.append([p.sampling_temperature, p.top_p, p.min_p, top_k, p.is_greedy, 0.0, 0.0])
    if not rows:
        return
    pin = any(row[3] < vocab or row[1] < 1.0 for row in rows)
    renorm = pin or any(row[2] > 0.0 for row in rows)
    settings = torch.tensor(rows, dtype=torch.float32)
    settings[:, 5], settings[:, 6] = float(renorm), float(pin)
    block[: len(rows), :SETTINGS] = settings


def padding_block(rows: int, device, width: int = SETTINGS + 1) -> torch.Tensor:
    """A block's static buffer (a decode block's `decode_block` rows, or a round's, copied
    into its first rows): rows past a batch are greedy (top_k 1), temperature 1, every
    uniform 1, renorm and pin off."""
    block = torch.ones(rows, width, dtype=torch.float32, device=device)
    block[:, 5:7] = 0.0
    return block


def decode_block(
    reqs: Sequence[SamplingRequest], generated: Sequence[int], vocab: int
) -> torch.Tensor:  # [B, SETTINGS + 1] float32 on the host
    """A plain decode step's block (GraphKind.sampled): the settings and each row's uniform,
    `draw_uniforms`' (seeded: `seeded_generator(seed, generated)`, the stream `sample_tokens`
    draws from; the others the host's global RNG)."""
    block = torch.ones(len(reqs), SETTINGS + 1, dtype=torch.float32)
    fill_settings(block, reqs, vocab)
    block[:, SETTINGS] = 1.0 - torch.rand(len(reqs))  # one draw for the unseeded rows
    for i, (r, g) in enumerate(zip(reqs, generated)):
        seed = r.sampling_params.seed
        if seed is not None:
            block[i, SETTINGS] = 1.0 - torch.rand(1, generator=seeded_generator(seed, g))[0]
    return block


def needs_filter(reqs: Sequence[SamplingRequest], vocab: int) -> bool:
    """Whether a batch needs the top-k / top-p masks (`need_top_p_top_k`: some row has top_k
    or top_p set, a greedy row included), which sort every row: a graph variant apart
    (`Settings.filtered`), as `processed_probs` skips the sort where none needs it. Read
    from the requests, never from a block (a host value, no tensor read)."""
    for r in reqs:
        p = r.sampling_params
        if effective_top_k(p, vocab) < vocab or p.top_p < 1.0:
            return True
    return False


class Settings:
    """The settings columns of a block's rows, inside a graph: `processed_probs` and
    `sample_from_probs` over them; `filtered`: the variant for batches with top-k / top-p
    (`filtered`), else no sort (and no greedy row, which would set top_k 1)."""

    def __init__(self, rows: torch.Tensor, filtered: bool = True) -> None:
        self.filtered = filtered
        self.temperatures = rows[:, 0:1]
        self.top_ps, self.min_ps = rows[:, 1], rows[:, 2]
        self.top_ks = rows[:, 3].to(torch.int64)
        self.greedy = rows[:, 4] > 0
        self.renorm = rows[:, 5:6] > 0
        self.pin = rows[:, 6:7] > 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] float32
        return static_probs(logits, self)

    def sample(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # [B]
        """`sample_from_probs`: argmax for greedy rows, else the inverse CDF at `uniforms`."""
        return torch.where(self.greedy, probs.argmax(dim=-1), inverse_cdf_sample(probs, uniforms))


def sample_rows(
    logits: torch.Tensor, block: torch.Tensor, filtered: bool
) -> torch.Tensor:  # [B] int64
    """A decode step's tokens from its logits [B, V] (the vocabulary's columns) and its block
    rows (`decode_block`): what `sample_tokens` draws for a batch `plain_sampling` accepts."""
    settings = Settings(block, filtered)
    return settings.sample(settings.probs(logits), block[:, SETTINGS])


def static_probs(logits: torch.Tensor, s: Settings) -> torch.Tensor:
    """`processed_probs` with its batch-wide branches as device selections (`s.renorm`,
    `s.pin`): every mask computed, each row's value the one the host's branch gives it. A
    row whose settings keep every token gets an all-true mask, so the masks of the branches
    not taken change nothing."""
    logits = logits.to(torch.float32)
    probs = torch.softmax(over_temperature(logits, s.temperatures), dim=-1)
    keep = probs >= probs.amax(dim=-1, keepdim=True) * s.min_ps.view(-1, 1)
    if s.filtered:
        keep &= top_k_top_p_keep_mask(probs, s.top_ks, s.top_ps)
    masked = probs.masked_fill(~keep, 0.0)
    masked = masked / sum_last(masked)
    probs = torch.where(s.renorm, masked, probs)
    if not s.filtered:  # no row pinned: need_top_p_top_k is False
        return probs
    greedy = one_hot(logits.argmax(dim=-1), logits.shape[-1])
    return torch.where(s.pin & s.greedy.view(-1, 1), greedy, probs)


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # [B, V] float32
    """`one_hot_probs` by a scatter: the same values, and no range check that reads the
    tokens on the host (one_hot's off CUDA), which a captured graph cannot do."""
    out = torch.zeros(tokens.shape[0], vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_(1, tokens.view(-1, 1), 1.0)
