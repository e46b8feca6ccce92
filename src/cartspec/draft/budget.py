"""How long a refresh trains: a step budget that grows with the traffic, and early stopping on held-out τ.

``default_budget`` gives the optimiser steps a refresh may take for a number of training records, and
``default_eval_every`` how often it measures the head's simulated τ on the held-out records. ``EarlyStop``
is the stopping rule on that τ curve: it keeps the best evaluation (the head to export) and says when τ has
not improved by more than ``min_delta`` for ``patience`` evaluations. Nothing here imports torch or an
engine, so the rule is tested on scripted curves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

# A step of 2048 padded tokens holds about 15 of the agent's requests (prompt and reply), so a quarter of a
# step per record is about 4 passes over the data. Small traffic still gets BUDGET_FLOOR steps (the
# learning-rate warm-up is 20 of them), and BUDGET_CAP bounds the training time on large traffic (400 steps:
# about 10 minutes on two CPU cores, at the 552 steps in 13.3 minutes docs/refresh.md measured). Early
# stopping ends a run whose held-out τ has stopped improving, so a generous budget only costs time while
# the head is still getting better.
BUDGET_FLOOR = 100
BUDGET_PER_RECORD = 0.25
BUDGET_CAP = 400
FRESH_FACTOR = 2  # a head trained from scratch has everything to learn
EVALUATIONS = 10  # held-out evaluations per budget (every default_eval_every steps)
MIN_EVAL_EVERY = 5
PATIENCE = 3
MIN_DELTA = 0.01  # τ, tokens per verify step


def default_budget(n_records: int, init: str = "current") -> int:
    """The optimiser steps a refresh takes by default for ``n_records`` training records: a quarter of a
    step per record, at least ``BUDGET_FLOOR`` and at most ``BUDGET_CAP`` (both twice as many for a head
    trained from scratch, ``init`` "fresh"). Monotone in ``n_records``."""
    if n_records < 0:
        raise ValueError(f"n_records must be >= 0, not {n_records}")
    steps = min(BUDGET_CAP, max(BUDGET_FLOOR, math.ceil(BUDGET_PER_RECORD * n_records)))
    return steps * (FRESH_FACTOR if init == "fresh" else 1)


def default_eval_every(budget: int) -> int:
    """Steps between held-out evaluations: about ``EVALUATIONS`` per budget, at least ``MIN_EVAL_EVERY``."""
    return max(MIN_EVAL_EVERY, math.ceil(budget / EVALUATIONS))


@dataclass
class EarlyStop:
    """The stopping rule on a τ curve, fed one evaluation at a time (``update``).

    An evaluation *improves* when its τ exceeds the last improving one's by more than ``min_delta``;
    ``should_stop`` once ``patience`` evaluations in a row have not improved (``patience`` 0: never).
    Evaluations at steps up to ``min_steps`` (the learning-rate warm-up, when the head is still being
    shaken) are recorded but never count against the patience. ``best_step`` / ``best_tau`` is the highest τ
    seen (the earliest of equal ones), improvement or not: the head to keep."""

    patience: int = PATIENCE
    min_delta: float = MIN_DELTA
    min_steps: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)
    best_step: Optional[int] = None
    best_tau: Optional[float] = None
    bar: Optional[float] = None  # τ of the last improving evaluation
    waited: int = 0  # evaluations since then, past min_steps

    def update(self, step: int, tau: float) -> bool:
        """Record τ at ``step``; True when it is the best so far (keep this head)."""
        if self.curve and step <= self.curve[-1][0]:
            raise ValueError(f"evaluations must come in step order: step {step} after {self.curve[-1][0]}")
        self.curve.append((int(step), float(tau)))
        if self.bar is None or tau > self.bar + self.min_delta:
            self.bar, self.waited = float(tau), 0
        elif step > self.min_steps:
            self.waited += 1
        if self.best_tau is None or tau > self.best_tau:
            self.best_step, self.best_tau = int(step), float(tau)
            return True
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.waited >= self.patience

    def reason(self) -> str:
        """Why it stopped, in words (for the log and the provenance)."""
        best = f" (best {self.best_tau:.3f} at step {self.best_step})" if self.best_tau is not None else ""
        return (f"held-out τ did not improve by more than {self.min_delta:g} for {self.patience} "
                f"evaluations{best}")

    @classmethod
    def replay(cls, curve: list[tuple[int, float]] | list[list[float]], **settings: float) -> "EarlyStop":
        """The rule's state after the evaluations of ``curve`` (a resumed run's)."""
        stop = cls(**settings)  # type: ignore[arg-type]
        for step, tau in curve:
            stop.update(int(step), float(tau))
        return stop
