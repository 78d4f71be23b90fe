"""Comparing implementations in turns: under sustained load the H200 runs at its power cap, so a
kernel's clock depends on what ran before it, and one timed after a long run of another pays for
that one's heat. In turns, with the order rotated every round, each meets the GPU in the same
state on average."""

from __future__ import annotations

from collections.abc import Callable


def in_turns(fns: dict, rounds: int, measure: Callable[[Callable], float]) -> dict[str, list[float]]:
    """Per key of ``fns``, ``measure(fn)`` once per round; within a round the functions take
    turns in an order rotated every round (with a round count that is not a multiple of their
    number some lead one round more, which a median absorbs)."""
    names = list(fns)
    samples: dict = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(measure(fns[n]))
    return samples
