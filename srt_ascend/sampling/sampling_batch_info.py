"""Batched, tensorised sampling parameters: one row per sampled position.

A decode batch has one row per request. A speculative verify batch has 1+K rows per request
(one per verified position); build it from the per-request info with `repeat_interleave(K+1)`,
and pick rows out again with `index(select)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.utils import to_device

_MASK64 = (1 << 64) - 1
# The smallest repetition penalty the logits are divided by: a smaller one (its range is
# (0, 2]) overflows float32 (every seen positive logit +inf, tied) where this one leaves any
# logit below 3e8 finite, in its order and far above the others: the same choice as r -> 0.
REPETITION_PENALTY_FLOOR = 1e-30


def mix_seed(seed: int, offset: int) -> int:
    """Seed for the `offset`-th step of a request seeded with `seed` (a SplitMix64 hash).

    Rule: the same (seed, offset) always gives the same generator state, and different offsets
    give unrelated streams, so step k of a seeded request draws the same numbers whatever
    batch, retraction or restart it went through.
    """
    x = (seed + (offset + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def effective_top_k(p, vocab_size: int) -> int:
    """The top_k the sampler applies for params `p`: 1 for a greedy request, the whole
    vocabulary where unset (< 1) or past it."""
    top_k = 1 if p.is_greedy else p.top_k
    return vocab_size if top_k < 1 or top_k > vocab_size else top_k


@dataclass(frozen=True)
class SamplingBatchInfo:
    """Sampling parameters of a batch as tensors on the model's device.

    Flags are conservative: True means "this batch may need the step"; False means no row does.
    Rows derived by `index`/`repeat_interleave` inherit the parent's flags (no device sync).
    Greedy rows have top_k == 1 and temperature == 1.
    """

    temperatures: torch.Tensor  # [B, 1] float32, > 0
    top_ps: torch.Tensor  # [B] float32, in (0, 1]
    top_ks: torch.Tensor  # [B] int64, in [1, vocab_size]
    min_ps: torch.Tensor  # [B] float32, in [0, 1]
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    generators: tuple[torch.Generator | None, ...]  # [B]; None = global RNG
    vocab_size: int
    is_all_greedy: bool
    need_top_p_top_k: bool
    need_min_p: bool
    need_penalties: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        *,
        seed_offsets: Sequence[int] | None = None,
        generators: bool = True,
    ) -> SamplingBatchInfo:
        """Tensorise `params` (one row each; normalized or not) onto `device`.

        Seeded requests get a fresh host `torch.Generator` (the same numbers on every device;
        `layers.sampler.draw_uniforms` copies them over) seeded with
        `mix_seed(seed, seed_offsets[i])`; pass the request's number of output tokens so far as
        its offset so every step draws new numbers (default offset 0). Others get None, and
        every row with `generators=False` (the caller draws its uniforms itself).
        """
        temps, top_ks, gens = [], [], []
        for i, p in enumerate(params):
            temps.append(p.sampling_temperature)
            top_ks.append(effective_top_k(p, vocab_size))
            offset = 0 if seed_offsets is None else int(seed_offsets[i])
            seeded = p.seed is not None and generators
            gens.append(seeded_generator(p.seed, offset) if seeded else None)
        top_ps = [float(p.top_p) for p in params]
        min_ps = [float(p.min_p) for p in params]
        freq = [float(p.frequency_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        rep = [max(float(p.repetition_penalty), REPETITION_PENALTY_FLOOR) for p in params]

        def f32(values: list[float]) -> torch.Tensor:
            return to_device(values, device, torch.float32)

        return cls(
            temperatures=f32(temps).view(-1, 1),
            top_ps=f32(top_ps),
            top_ks=to_device(top_ks, device),
            min_ps=f32(min_ps),
            frequency_penalties=f32(freq),
            presence_penalties=f32(pres),
            repetition_penalties=f32(rep),
            generators=tuple(gens),
            vocab_size=vocab_size,
            is_all_greedy=all(k == 1 for k in top_ks),
            need_top_p_top_k=any(k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps),
            need_min_p=any(m > 0.0 for m in min_ps),
            need_penalties=any(f != 0.0 for f in freq)
            or any(p != 0.0 for p in pres)
            or any(r != 1.0 for r in rep),
        )

    @property
    def batch_size(self) -> int:
        return self.top_ps.shape[0]

    @property
    def device(self) -> torch.device:
        return self.top_ps.device

    @property
    def is_greedy(self) -> torch.Tensor:
        """[B] bool: rows decoded by argmax."""
        return self.top_ks == 1

    @property
    def has_seeded_rows(self) -> bool:
        return any(g is not None for g in self.generators)

    def index(self, select: torch.Tensor | Sequence[int]) -> SamplingBatchInfo:
        """New info with rows `select` (int indices, repeats allowed); generators are shared,
        not copied. Syncs the device only when `select` is a tensor and some row is seeded."""
        idx = to_device(select, self.device)
        if self.has_seeded_rows:
            rows = select.tolist() if isinstance(select, torch.Tensor) else list(select)
            gens = tuple(self.generators[r] for r in rows)
        else:
            gens = (None,) * idx.shape[0]
        return self._with_rows(lambda t: t.index_select(0, idx), gens)

    def repeat_interleave(self, repeats: int | Sequence[int]) -> SamplingBatchInfo:
        """New info with row i repeated `repeats` (or `repeats[i]`) times, consecutively:
        request i of a verify batch owns rows [sum(repeats[:i]), sum(repeats[:i+1]))."""
        counts = [repeats] * self.batch_size if isinstance(repeats, int) else list(repeats)
        if len(counts) != self.batch_size:
            raise ValueError(f"repeats has {len(counts)} entries for {self.batch_size} rows.")
        total = sum(counts)
        reps = to_device(counts, self.device)
        gens = tuple(g for g, c in zip(self.generators, counts, strict=True) for _ in range(c))
        return self._with_rows(lambda t: t.repeat_interleave(reps, dim=0, output_size=total), gens)

    def _with_rows(
        self,
        pick: Callable[[torch.Tensor], torch.Tensor],
        gens: tuple[torch.Generator | None, ...],
    ) -> SamplingBatchInfo:
        return SamplingBatchInfo(
            temperatures=pick(self.temperatures),
            top_ps=pick(self.top_ps),
            top_ks=pick(self.top_ks),
            min_ps=pick(self.min_ps),
            frequency_penalties=pick(self.frequency_penalties),
            presence_penalties=pick(self.presence_penalties),
            repetition_penalties=pick(self.repetition_penalties),
            generators=gens,
            vocab_size=self.vocab_size,
            is_all_greedy=self.is_all_greedy,
            need_top_p_top_k=self.need_top_p_top_k,
            need_min_p=self.need_min_p,
            need_penalties=self.need_penalties,
        )


def seeded_generator(seed: int, offset: int) -> torch.Generator:
    """A host generator for step `offset` of a request seeded with `seed` (`mix_seed`)."""
    generator = torch.Generator()
    generator.manual_seed(mix_seed(seed, offset))
    return generator


__all__ = ["SamplingBatchInfo", "mix_seed", "seeded_generator"]
