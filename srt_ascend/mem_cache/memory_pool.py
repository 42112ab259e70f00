"""Memory pools: request rows and the MLA KV cache.

Two pools, two levels of indirection (as in SGLang):

* ``ReqToTokenPool`` hands out *rows*, one per running request. Row ``r`` of ``req_to_token``
  maps the request's token positions to KV slot indices.
* ``MLATokenToKVPool`` holds the KV data itself, one buffer per layer, indexed by KV slot.
  Which slots are free is not tracked here; that is the job of
  :class:`srt_ascend.mem_cache.allocator.TokenToKVPoolAllocator`.

DeepSeek-V3 uses MLA, so a slot stores the compressed latent ``c_kv`` [kv_lora_rank] and the
rope key ``k_pe`` [qk_rope_head_dim]: interleaved in one row of width ``kv_lora_rank +
rope_dim`` (CPU/CUDA), or in two separate contiguous caches (NPU: what FIA takes).
The MTP draft layers are extra layers of the same pool, so one slot index serves the main
model and the draft module alike.
"""

from __future__ import annotations

import torch

from srt_ascend.layers.ops.kv_cache import assign_req_to_token, store_kv
from srt_ascend.utils import to_device


class ReqToTokenPool:
    """Rows mapping each running request's positions to KV slot indices.

    Ownership: a row returned by :meth:`alloc` belongs to the caller (one request) until it is
    given back with :meth:`free`. The pool never reads the row's contents; the caller writes
    ``req_to_token[row, :seq_len]`` (through :meth:`write`, which keeps the host copy ``host``
    in step) and is responsible for the KV slots it names.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"size and max_context_len must be positive: {size=}, {max_context_len=}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # [size, max_context_len] KV slot index of each (request row, position): what the
        # attention kernels read, on the device ...
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int64, device=self.device
        )
        # ... and its host copy, which bookkeeping reads (no device sync); the same tensor on CPU
        self.host = (
            self.req_to_token
            if self.device.type == "cpu"
            else torch.zeros((size, max_context_len), dtype=torch.int64)
        )
        self._free_rows: list[int] = []
        self._is_free: list[bool] = []
        self.clear()

    def available_size(self) -> int:
        """Number of rows that can still be allocated."""
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take ``n`` free rows; returns None (and changes nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} rows")
        if n > len(self._free_rows):
            return None
        rows = self._free_rows[:n]
        del self._free_rows[:n]
        for row in rows:
            self._is_free[row] = False
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Give rows back. Freeing a row that is already free raises ``ValueError``."""
        rows = [int(r) for r in idx] if isinstance(idx, list | tuple) else [int(idx)]
        if len(set(rows)) != len(rows):
            raise ValueError(f"duplicate rows in free: {rows}")
        for row in rows:
            if not 0 <= row < self.size:
                raise ValueError(f"row {row} out of range [0, {self.size})")
            if self._is_free[row]:
                raise ValueError(f"double free of request row {row}")
        for row in rows:
            self._is_free[row] = True
        self._free_rows.extend(rows)

    def write(self, rows: list[int], starts: list[int], slots: torch.Tensor, lens: list[int]):
        """req_to_token[rows[i], starts[i] : starts[i]+lens[i]] = the next lens[i] of `slots`
        (host tensor, in request order), on the host and, with one async copy and the
        `assign_req_to_token` op (the Triton kernel on CUDA), the device."""
        if not rows:
            return
        slots = slots.to(device="cpu", dtype=torch.int64)
        if all(n == 1 for n in lens):  # a decode step: one position per row
            row_idx, col_idx = torch.tensor(rows), torch.tensor(starts)
        else:
            row_idx = torch.cat(
                [torch.full((n,), r, dtype=torch.int64) for r, n in zip(rows, lens)]
            )
            col_idx = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        self.host[row_idx, col_idx] = slots
        if self.host is not self.req_to_token:
            b = len(rows)
            ends = [s + n for s, n in zip(starts, lens)]
            both = to_device(torch.cat([torch.tensor(rows + starts + ends), slots]), self.device)
            assign_req_to_token(
                self.req_to_token, both[:b], both[b : 2 * b], both[2 * b : 3 * b], both[3 * b :]
            )

    def clear(self) -> None:
        """Mark every row free. Row contents are left as they are (callers overwrite them)."""
        self._free_rows = list(range(self.size))
        self._is_free = [True] * self.size


KV_LAYOUTS = ("interleaved", "separate")


class MLATokenToKVPool:
    """Per-layer MLA KV buffers indexed by KV slot.

    Two layouts of the same data, chosen at construction (``layout``):

    * ``"interleaved"``: one buffer per layer, [size + page_size, 1, kv_lora_rank + rope_dim],
      latent then rope key in each row. Torch-native attention gathers a row once and scores
      [latent | rope] in one matmul (the CPU/CUDA default).
    * ``"separate"``: two contiguous buffers per layer, latent [size + page_size, 1,
      kv_lora_rank] and rope key [size + page_size, 1, rope_dim], as FIA's MLA path on NPU
      needs its key / value / key_rope caches (``npu_fused_infer_attention_score``).

    Slots ``0 .. page_size-1`` form a reserved padding page that the allocator never hands
    out, so padded batches (graph replay, IDLE runs) may write to slot 0 harmlessly.

    ``layer_num`` counts every layer that stores KV, including the MTP draft layers: the
    caller passes ``num_hidden_layers + num_mtp_layers`` and addresses draft layers with ids
    ``num_hidden_layers ..``. The pool owns its buffers; the views returned by the getters
    alias them (writes through a view are writes to the cache).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
        layout: str = "interleaved",
    ):
        if size <= 0 or page_size <= 0 or layer_num <= 0:
            raise ValueError(f"bad pool geometry: {size=}, {page_size=}, {layer_num=}")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r} (known: {', '.join(KV_LAYOUTS)})")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.layer_num = layer_num
        self.layout = layout
        self.device = torch.device(device)
        rows = size + page_size

        def zeros(width: int) -> torch.Tensor:
            return torch.zeros((rows, 1, width), dtype=dtype, device=self.device)

        # interleaved: layer_num x [rows, 1, R + P], with c_kv / k_pe column views into it;
        # separate: no joint buffer, layer_num x [rows, 1, R] and layer_num x [rows, 1, P]
        self._joint: list[torch.Tensor] | None = None
        if layout == "interleaved":
            self._joint = [zeros(self.kv_cache_dim) for _ in range(layer_num)]
            self._c_kv = [buf[..., :kv_lora_rank] for buf in self._joint]
            self._k_pe = [buf[..., kv_lora_rank:] for buf in self._joint]
        else:
            self._c_kv = [zeros(kv_lora_rank) for _ in range(layer_num)]
            self._k_pe = [zeros(qk_rope_head_dim) for _ in range(layer_num)]

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise IndexError(f"layer_id {layer_id} out of range [0, {self.layer_num})")

    def set_mla_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> None:
        """Write ``c_kv`` [N, kv_lora_rank] and ``k_pe`` [N, rope_dim] into slots ``loc`` [N].

        Inputs may carry a singleton head axis ([N, 1, dim]); values are cast to the pool
        dtype. Duplicate slots in ``loc`` (e.g. padding rows all pointing at slot 0) are
        allowed; which write wins among them is unspecified. Runs the `store_kv` op (the
        Triton kernel on CUDA, the torch reference elsewhere).
        """
        c_buf, pe_buf = self.get_c_kv(layer_id), self.get_k_pe(layer_id)
        n = loc.shape[0]
        c_kv = c_kv.reshape(n, self.kv_lora_rank).to(dtype=self.dtype, device=c_buf.device)
        k_pe = k_pe.reshape(n, self.qk_rope_head_dim).to(dtype=self.dtype, device=c_buf.device)
        loc = loc.to(device=c_buf.device, dtype=torch.int64)
        store_kv(c_buf, pe_buf, loc, c_kv, k_pe)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Every slot's whole KV row, [size + page_size, 1, kv_lora_rank + rope_dim].

        Interleaved layout: the layer buffer itself (writes go to the cache). Separate
        layout: a new tensor joining the two buffers (a snapshot owned by the caller; the
        step path reads rows with :meth:`gather_kv` instead)."""
        self._check_layer(layer_id)
        if self._joint is not None:
            return self._joint[layer_id]
        return torch.cat([self._c_kv[layer_id], self._k_pe[layer_id]], dim=-1)

    def gather_kv(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """KV rows of ``slots`` (any shape S): a new tensor [*S, kv_lora_rank + rope_dim],
        latent then rope key. One gather in the interleaved layout, two in the separate."""
        self._check_layer(layer_id)
        if self._joint is not None:
            return self._joint[layer_id][slots].squeeze(-2)
        c_kv, k_pe = self._c_kv[layer_id][slots], self._k_pe[layer_id][slots]
        return torch.cat([c_kv, k_pe], dim=-1).squeeze(-2)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """MLA's value is the latent: same as :meth:`get_c_kv`."""
        return self.get_c_kv(layer_id)

    def get_c_kv(self, layer_id: int) -> torch.Tensor:
        """The latent cache, [size + page_size, 1, kv_lora_rank]: a column view of the layer
        buffer (interleaved) or its own contiguous buffer (separate)."""
        self._check_layer(layer_id)
        return self._c_kv[layer_id]

    def get_k_pe(self, layer_id: int) -> torch.Tensor:
        """The rope-key cache, [size + page_size, 1, qk_rope_head_dim]: a column view
        (interleaved) or its own contiguous buffer (separate)."""
        self._check_layer(layer_id)
        return self._k_pe[layer_id]

    def transfer_buffers(self) -> list[torch.Tensor]:
        """The buffers that hold the KV, in layer order (per layer: the joint buffer, or the
        latent then the rope-key buffer), each [size + page_size, 1, width] and contiguous:
        slot s of a buffer starts s * stride(0) elements after its start. What a transfer
        engine registers and writes into (prefill-decode disaggregation)."""
        if self._joint is not None:
            return list(self._joint)
        return [buf for pair in zip(self._c_kv, self._k_pe) for buf in pair]

    def mem_usage_bytes(self) -> int:
        """Bytes held by all layer buffers."""
        bufs = self._joint if self._joint is not None else [*self._c_kv, *self._k_pe]
        return sum(buf.numel() * buf.element_size() for buf in bufs)
