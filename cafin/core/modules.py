"""Module types the members recognise without importing the library that defines them: kept as a
name of `cafin.core.views`, where each module type's view lives."""
from __future__ import annotations

from .views import is_transposed_linear

__all__ = ["is_transposed_linear"]
