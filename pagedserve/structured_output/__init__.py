"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar.

backend.py compiles constraints with llguidance; grammar.py is one request's matcher state;
manager.py (owned by the engine) compiles off the engine loop, caches compiled grammars and
fills each step's token bitmask; stats.py holds its counters. Applying the bitmask to logits is
torch work and lives in sample/bitmask.py. Nothing here imports torch.
"""

from pagedserve.structured_output.stats import StructuredOutputStats

__all__ = ["StructuredOutputStats"]
