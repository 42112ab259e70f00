"""Attention backends over the paged MLA latent cache; importing the package registers the
portable ones (`torch_native`, its batch-invariant variant, `triton`: Triton itself is imported
only when a Triton backend is constructed)."""

from srt_ascend.layers.attention import batch_invariant, torch_native, triton_backend  # noqa: F401
