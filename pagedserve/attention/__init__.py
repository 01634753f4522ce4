"""Attention over the paged KV cache: one metadata type, a fast backend and a slow reference."""

from pagedserve.attention.metadata import AttentionMetadata, forward_context, get_forward_context

__all__ = ["AttentionMetadata", "forward_context", "get_forward_context"]
