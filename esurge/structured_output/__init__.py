"""Structured output: constraining generation to a JSON schema, regex, choice or grammar.

`StructuredOutputsParams` (pure Python) describes the constraint; the
compiler, matcher and batch modules run it with llguidance.
"""

from esurge.structured_output.params import CONSTRAINT_KINDS, StructuredOutputsParams

__all__ = ["CONSTRAINT_KINDS", "StructuredOutputsParams"]
