"""The order admission tries the waiting sequences in, and which of a step's work runs first.

Knows: re-admissions first, in line; then the tenants' turns (the fewest sequences running or
loading, ties to the one admitted least recently, then to the one first in line; FIFO within a
tenant), with each tenant's latest admission numbered; and the newcomer's step (a tenant with
nothing running or loading has its first chunk run alone: `newcomer_first`, never twice in a
row). Doesn't know: pages, budgets, loads or shares of the pool (engine/scheduler.py admits,
engine/fair_share.py decides who may take pages): it is handed the scheduler's waiting, running
and loading sequences and reads their tenants and statuses, changing none of them.

Thread: the engine thread's (`tieredkv-engine`), which alone steps the scheduler and owns this
state.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Iterable, Iterator

from engine.sequence import Scheduled, Sequence, SeqStatus


class AdmissionOrder:
    """The admission order and the newcomer's step of one scheduler (read when asked)."""

    def __init__(self, newcomer_first: bool = True) -> None:
        self.newcomer_first = newcomer_first
        self.newcomer_steps = 0       # steps that ran a newcomer's first chunk alone
        self._newcomer_step = False   # the last step was one
        # Each tenant's latest admission, numbered.
        self._admissions = 0
        self._last_admitted: dict[str, int] = {}

    def newcomers_first(self, out: list[Scheduled], holding: set[str]) -> list[Scheduled]:
        """A step with a newcomer's first chunk (its tenant had nothing running or loading) and
        others' work runs the newcomers alone; the others keep their pages and run next step
        (never two such steps in a row: the others always progress)."""
        fresh = [x for x in out if x.seq.tenant not in holding]
        if self.newcomer_first and fresh and len(fresh) < len(out) and not self._newcomer_step:
            self._newcomer_step = True
            self.newcomer_steps += 1
            return fresh
        self._newcomer_step = False
        return out

    def waiting(self, waiting: Iterable[Sequence], running: Iterable[Sequence],
                loading: Iterable[Sequence]) -> Iterator[Sequence]:
        """The waiting sequences in the order admission tries them, each at most once a step.
        Re-admissions first, in line (preempted, or given back after a load: admitted before,
        billed already). Then the tenants take turns: next is the tenant with the fewest
        sequences running or loading, ties to the one admitted least recently, then to the one
        whose first waiting sequence is first in line; FIFO within a tenant. The counts are live
        (an admission is counted before the next pick), so one tenant's flood of waiting
        requests delays another tenant's request by at most one admission per other tenant.
        (The scheduler's own collections, read as the generator is advanced.)"""
        yield from [s for s in waiting if s.hit_tokens_by_tier is not None]
        queues: dict[str, deque[tuple[int, Sequence]]] = {}
        for pos, s in enumerate(waiting):
            if s.hit_tokens_by_tier is None:
                queues.setdefault(s.tenant, deque()).append((pos, s))
        active = Counter(s.tenant for s in (*running, *loading))
        if len(self._last_admitted) > 4 * (len(queues) + len(active)) + 64:   # tenants long gone
            self._last_admitted = {t: n for t, n in self._last_admitted.items() if t in queues or t in active}
        while queues:
            tenant = min(queues, key=lambda t: (active[t], self._last_admitted.get(t, -1), queues[t][0][0]))
            _, seq = queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            yield seq
            if seq.status in (SeqStatus.RUNNING, SeqStatus.LOADING):
                active[tenant] += 1
                self._admissions += 1
                self._last_admitted[tenant] = self._admissions
