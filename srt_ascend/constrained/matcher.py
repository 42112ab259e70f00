"""A request's grammar state and the token bitmasks it puts on logits.

Bitmask layout (xgrammar's): int32 words [rows, ceil(V / 32)], bit b of word w set when token
32 * w + b is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from srt_ascend.constrained.compilers import LLGuidanceGrammar
from srt_ascend.utils import to_device

_BITS = 32
# bit b of an int32 word as an int32 value (bit 31 is the sign bit)
_BIT_VALUES = [1 << b for b in range(_BITS - 1)] + [-(1 << (_BITS - 1))]


class Grammar:
    """One request's position in its grammar: advanced over every token it commits; drafts
    not yet verified are looked ahead over and rolled back (`fill_bitmask`)."""

    def __init__(self, compiled: xgr.CompiledGrammar | LLGuidanceGrammar) -> None:
        """A matcher at the grammar's start, of the library that compiled it (`MATCHERS`)."""
        self._matcher = MATCHERS[type(compiled)](compiled)

    def accept(self, token: int) -> bool:
        """Advances over a committed token; False (state unchanged) if the grammar forbids it."""
        return self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, lookahead: Sequence[int]) -> None:
        """Writes into `bitmask[row]` the tokens allowed after the committed tokens followed by
        `lookahead`; the state is left as it was (the lookahead is rolled back).

        Where the lookahead leaves the grammar (a token it forbids, or anything after its stop
        token), every token is allowed: such a position is never emitted, because its draft had
        probability zero under the mask before it, or the request stopped at the stop token.
        Where the grammar allows no token at all, the stop tokens are allowed: the grammar
        then refuses the one sampled and the request ends with that error, alone."""
        m, n = self._matcher, 0
        for token in lookahead:
            if m.is_terminated() or not m.accept_token(token):
                bitmask[row].fill_(-1)
                break
            n += 1
        else:
            if m.is_terminated():
                bitmask[row].fill_(-1)
            else:
                m.fill_next_token_bitmask(bitmask, row)
                if not bitmask[row].any():
                    _allow_only(bitmask, row, m.stop_token_ids)
        if n:
            m.rollback(n)


class LLGuidanceMatcher:
    """llguidance's matcher behind xgrammar's GrammarMatcher interface (the one Grammar uses):
    a token the grammar forbids is refused without moving (llguidance's matcher would enter
    its error state for good), and a stop token is accepted where the grammar may end and
    terminates it. Stop tokens are kept here, never given to llguidance (which takes one
    after its grammar is complete without counting it), so rollbacks count alike."""

    def __init__(self, compiled: LLGuidanceGrammar) -> None:
        self._m = compiled.matcher.deep_copy()
        self.stop_token_ids = compiled.stop_token_ids
        self._stops = set(compiled.stop_token_ids)
        self._ended = False  # a stop token accepted: the last token, held here

    def accept_token(self, token: int) -> bool:
        if self._ended:
            return False
        if token in self._stops:
            m = self._m  # the grammar may end here: complete, and nothing must follow
            self._ended = m.is_accepting() and (m.is_stopped() or m.validate_tokens([token]) == 1)
            return self._ended
        return self._m.validate_tokens([token]) == 1 and self._m.consume_token(token)

    def is_terminated(self) -> bool:
        return self._ended

    def rollback(self, n: int) -> None:
        if self._ended:
            self._ended, n = False, n - 1
        if n:
            self._m.rollback(n)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)


MATCHERS = {xgr.CompiledGrammar: xgr.GrammarMatcher, LLGuidanceGrammar: LLGuidanceMatcher}


def _allow_only(bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> None:
    bitmask[row].zero_()
    for t in tokens:
        bitmask[row, t // _BITS] |= _BIT_VALUES[t % _BITS]


def fill_grammar_bitmask(
    grammars: Sequence[Grammar | None],
    lookaheads: Sequence[Sequence[int]],  # per row: draft tokens past the committed ones
    vocab_size: int,
) -> torch.Tensor | None:  # [B, ceil(V/32)] int32 on the host; None when no row has a grammar
    """The bitmask of a batch: each grammar row as its grammar allows, other rows all ones."""
    if all(g is None for g in grammars):
        return None
    words = (vocab_size + _BITS - 1) // _BITS
    bitmask = torch.full((len(grammars), words), -1, dtype=torch.int32)
    for i, (g, ahead) in enumerate(zip(grammars, lookaheads)):
        if g is not None:
            g.fill_bitmask(bitmask, i, ahead)
    return bitmask


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V]
    bitmask: torch.Tensor,  # [B, ceil(V/32)] int32, any device
) -> torch.Tensor:  # [B, V], a new tensor; `logits` is not modified
    """Returns logits with every token whose bit is clear set to -inf (plain torch ops, so
    the same code runs on every device)."""
    vocab = logits.shape[-1]
    words = to_device(bitmask, logits.device, torch.int32)
    bits = to_device(_BIT_VALUES, logits.device, torch.int32)
    allowed = (words.unsqueeze(-1) & bits).view(words.shape[0], -1)[:, :vocab] != 0
    return torch.where(allowed, logits, float("-inf"))
