"""The case registry: each conformance case once, with its id, behaviour sentence and check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from workqueue.testing.conformance.harness import CaseContext, TransportTraits

Check = Callable[[CaseContext], None]


@dataclass(frozen=True, slots=True)
class Case:
    """One conformance case.

    ``name`` is the behaviour it proves, as a sentence; ``requires`` names the
    :class:`TransportTraits` flags that must be true for the case to apply (a gate).
    """

    id: str
    name: str
    check: Check
    requires: tuple[str, ...] = ()

    def skip_reason(self, traits: TransportTraits) -> str | None:
        """Why the case does not apply to a transport with ``traits``, or None if it does."""
        missing = [flag for flag in self.requires if not getattr(traits, flag)]
        if missing:
            return f"transport lacks {', '.join(missing)}"
        return None


class CaseRegistry:
    """An ordered set of cases, keyed by id; registering an id twice is an error."""

    def __init__(self) -> None:
        self._cases: dict[str, Case] = {}

    def case(
        self, case_id: str, name: str, *, requires: tuple[str, ...] = ()
    ) -> Callable[[Check], Check]:
        """Decorator registering a check function as case ``case_id``."""

        def register(check: Check) -> Check:
            self.add(Case(case_id, name, check, requires))
            return check

        return register

    def add(self, case: Case) -> None:
        if case.id in self._cases:
            raise ValueError(f"conformance case {case.id} is registered twice")
        self._cases[case.id] = case

    def get(self, case_id: str) -> Case:
        try:
            return self._cases[case_id.upper()]
        except KeyError:
            raise KeyError(
                f"no conformance case {case_id!r}; known cases are {', '.join(self.ids())}"
            ) from None

    def ids(self) -> list[str]:
        return sorted(self._cases)

    def copy(self) -> CaseRegistry:
        """An independent registry with the same cases (to add cases without touching this)."""
        clone = CaseRegistry()
        clone._cases = dict(self._cases)
        return clone

    def __iter__(self) -> Iterator[Case]:
        return (self._cases[case_id] for case_id in self.ids())

    def __len__(self) -> int:
        return len(self._cases)


#: The suite every transport driver must pass (filled by the area modules on import).
CASES = CaseRegistry()
