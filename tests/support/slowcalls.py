"""Counting the calls that reach an observer's Python ``request`` and ``response`` where
C functions stand in for them (the metrics' counting, the observation log's records)."""

from __future__ import annotations

from typing import Any


class CountsSlowCalls:
    """Mix in before the observer class: ``slow`` counts the calls of each method that
    reached Python (the C functions call the class's methods for what they do not take)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slow = {"request": 0, "response": 0}
        super().__init__(*args, **kwargs)

    def request(self, *args: Any) -> None:
        self.slow["request"] += 1
        super().request(*args)  # type: ignore[misc]

    def response(self, *args: Any) -> None:
        self.slow["response"] += 1
        super().response(*args)  # type: ignore[misc]
