"""The metric names GRPOConfig accepts: the built-in levels and the user-metric registry.

A leaf module (no package imports) so that ``config`` (which validates ``GRPOConfig.metrics``
against it) and ``metrics`` (which registers and runs the functions) both import it at the top,
with no import circle between them. The registry grows at import time, as ``@metric`` runs.
"""
from __future__ import annotations

from typing import Callable, Dict

METRIC_LEVELS = ("none", "basic", "with_entropy")

_REGISTRY: Dict[str, Callable] = {}


def register_metric(name: str, fn: Callable) -> None:
    _REGISTRY[name] = fn


def registered_metrics() -> Dict[str, Callable]:
    """A copy of the registry: name -> ``fn(stats: TokenStats) -> Tensor``."""
    return dict(_REGISTRY)


def get_metric(name: str) -> Callable:
    return _REGISTRY[name]
