"""TokenToKVPoolAllocator: slot layout, page continuation, exhaustion and double free."""

from __future__ import annotations

import random

import pytest
import torch

from srt_ascend.mem_cache import TokenToKVPoolAllocator


def _pages(slots: torch.Tensor, page_size: int) -> set[int]:
    return set((slots // page_size).tolist())


def test_alloc_page_size_1_hands_out_1_to_size_and_exhausts():
    alloc = TokenToKVPoolAllocator(size=8)
    a = alloc.alloc(5)
    assert alloc.available_size() == 3
    b = alloc.alloc(3)
    assert sorted(a.tolist() + b.tolist()) == list(range(1, 9))
    assert alloc.alloc(1) is None
    assert alloc.available_size() == 0
    alloc.free(a[:2])
    assert alloc.available_size() == 2
    assert sorted(alloc.alloc(2).tolist()) == sorted(a[:2].tolist())


def test_double_free_and_bad_slots_raise():
    alloc = TokenToKVPoolAllocator(size=8)
    a = alloc.alloc(4)
    alloc.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.tensor([a[1].item(), a[1].item()]))
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([0]))  # the padding slot is never handed out
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([9]))
    assert alloc.available_size() == 5  # failed frees changed nothing


def test_paged_alloc_whole_pages_and_free_by_page():
    alloc = TokenToKVPoolAllocator(size=16, page_size=4)
    assert alloc.num_pages == 4 and alloc.available_size() == 16
    with pytest.raises(ValueError):
        alloc.alloc(3)
    slots = alloc.alloc(8)
    pages = slots.reshape(2, 4)
    assert bool((pages == pages[:, :1] + torch.arange(4)).all())
    assert bool((pages[:, 0] % 4 == 0).all()) and int(slots.min()) >= 4
    assert alloc.available_size() == 8
    # Freeing one slot of a page hands the whole page back; its other slots are then free.
    alloc.free(pages[0, 2:3])
    assert alloc.available_size() == 12
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[0, :1])
    alloc.free(pages[1])  # all slots of one page in one call is one page
    assert alloc.available_size() == 16
    assert alloc.alloc(20) is None


def test_alloc_extend_continues_partial_page_then_takes_new_pages():
    alloc = TokenToKVPoolAllocator(size=32, page_size=4)
    first = alloc.alloc_extend([0], [6], [-1])
    assert first.shape == (6,)
    a, b = int(first[0]) // 4, int(first[4]) // 4
    assert first.tolist() == [a * 4 + i for i in range(4)] + [b * 4, b * 4 + 1]
    assert alloc.available_size() == 32 - 8
    # Continue in page b (positions 6, 7), then one new page for position 8.
    more = alloc.alloc_extend([6], [9], [int(first[-1])])
    assert more[:2].tolist() == [b * 4 + 2, b * 4 + 3]
    c = int(more[2]) // 4
    assert int(more[2]) == c * 4 and c not in (a, b)
    assert alloc.available_size() == 32 - 12
    # Prefix ending exactly at a page end: no continuation.
    at_end = alloc.alloc_extend([8], [9], [b * 4 + 3])
    assert int(at_end[0]) % 4 == 0 and int(at_end[0]) // 4 not in (a, b, c)
    # Extend inside the same page without a new page.
    same = alloc.alloc_extend([9], [10], [int(more[2])])
    assert same.tolist() == [c * 4 + 1]
    assert alloc.available_size() == 32 - 16


def test_alloc_extend_batch_order_and_exhaustion_changes_nothing():
    alloc = TokenToKVPoolAllocator(size=16, page_size=4)
    out = alloc.alloc_extend([0, 0], [3, 5], [-1, -1])
    assert out.shape == (8,)
    assert len(_pages(out[:3], 4)) == 1 and len(_pages(out[3:], 4)) == 2
    assert _pages(out[:3], 4).isdisjoint(_pages(out[3:], 4))
    free_before = alloc.available_size()
    assert free_before == 4
    # Request 0 can continue in its page (1 token) but request 1 needs 2 new pages: fail.
    assert alloc.alloc_extend([3, 5], [4, 13], [int(out[2]), int(out[-1])]) is None
    assert alloc.available_size() == free_before
    ok = alloc.alloc_extend([3], [4], [int(out[2])])
    assert ok.tolist() == [int(out[2]) + 1] and alloc.available_size() == free_before
    assert alloc.alloc_extend([0], [0], [-1]).numel() == 0


def test_alloc_extend_rejects_misaligned_last_loc():
    alloc = TokenToKVPoolAllocator(size=16, page_size=4)
    out = alloc.alloc_extend([0], [2], [-1])
    with pytest.raises(ValueError):
        alloc.alloc_extend([2], [3], [int(out[0])])  # slot of position 0, not 1
    with pytest.raises(ValueError):
        alloc.alloc_extend([0], [3], [int(out[1])])  # empty prefix needs -1


def test_alloc_decode_continuation_new_page_and_exhaustion():
    alloc = TokenToKVPoolAllocator(size=8, page_size=4)
    r0 = alloc.alloc_extend([0], [3], [-1])
    r1 = alloc.alloc_extend([0], [4], [-1])
    assert alloc.available_size() == 0
    # r0 continues in its page (position 3); r1 is at a page end and needs a new page.
    assert alloc.alloc_decode([4, 5], [int(r0[-1]), int(r1[-1])]) is None
    out = alloc.alloc_decode([4], [int(r0[-1])])
    assert out.tolist() == [int(r0[-1]) + 1]
    alloc.free(r0)
    out = alloc.alloc_decode(torch.tensor([5]), torch.tensor([int(r1[-1])]))
    assert int(out[0]) % 4 == 0 and int(out[0]) // 4 == int(r0[0]) // 4
    assert alloc.available_size() == 0


def test_alloc_decode_page_size_1_takes_one_slot_each():
    alloc = TokenToKVPoolAllocator(size=4)
    out = alloc.alloc_decode([1, 1, 1], [-1, -1, -1])
    assert sorted(out.tolist()) == sorted(set(out.tolist())) and alloc.available_size() == 1
    assert alloc.alloc_decode([2, 2], out[:2]) is None
    assert alloc.available_size() == 1


def test_free_group_defers_and_checks_double_free():
    alloc = TokenToKVPoolAllocator(size=8)
    a = alloc.alloc(4)
    alloc.free_group_begin()
    alloc.free(a[:2])
    alloc.free(a[2:])
    assert alloc.available_size() == 4
    alloc.free_group_end()
    assert alloc.available_size() == 8
    b = alloc.alloc(2)
    alloc.free_group_begin()
    alloc.free(b[:1])
    alloc.free(b[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free_group_end()


def test_clear_restores_everything():
    alloc = TokenToKVPoolAllocator(size=12, page_size=4)
    alloc.alloc(8)
    alloc.clear()
    assert alloc.available_size() == 12
    assert sorted((alloc.alloc(12) // 4).unique().tolist()) == [1, 2, 3]


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_requests_never_share_pages_and_stay_aligned(page_size):
    rng = random.Random(page_size)
    alloc = TokenToKVPoolAllocator(size=64, page_size=page_size)
    reqs: list[list[int]] = []  # each request's slots for positions 0..n-1
    for _ in range(400):
        if reqs and rng.random() < 0.3:
            alloc.free(torch.tensor(reqs.pop(rng.randrange(len(reqs)))))
        elif reqs and rng.random() < 0.5:
            req = reqs[rng.randrange(len(reqs))]
            out = alloc.alloc_decode([len(req) + 1], [req[-1]])
            if out is not None:
                req.append(int(out[0]))
        else:
            n = rng.randint(1, 11)
            out = alloc.alloc_extend([0], [n], [-1])
            if out is not None:
                reqs.append(out.tolist())
        owned_pages = [{s // page_size for s in req} for req in reqs]
        for pos_slots in reqs:
            for pos, slot in enumerate(pos_slots):
                assert slot % page_size == pos % page_size
                assert slot // page_size == pos_slots[pos - pos % page_size] // page_size
        assert sum(len(p) for p in owned_pages) == len(set().union(*owned_pages))
        assert alloc.available_size() == 64 - page_size * sum(len(p) for p in owned_pages)
    for req in reqs:
        alloc.free(torch.tensor(req))
    assert alloc.available_size() == 64
