"""How a merged target's applied rows are shared among the spans routed into it (pure)."""

from __future__ import annotations

import pytest

from services.sink_worker.round.writer import split_rows


@pytest.mark.parametrize(("total", "weights", "expected"), [
    (10, [5, 5], [5, 5]),
    (10, [1, 3], [3, 7]),          # 2.5 / 7.5: the larger remainder is a tie, first wins
    (7, [1, 1, 1], [3, 2, 2]),
    (0, [4, 2], [0, 0]),
    (5, [0, 0], [3, 2]),           # no row changes counted (DDL only): equal parts
    (9, [9], [9]),
    (3, [], []),
])
def test_shares_add_up_to_the_targets_rows(total: int, weights: list[int], expected: list[int]) -> None:
    shares = split_rows(total, weights)
    assert shares == expected
    assert sum(shares) == (total if weights else 0)


def test_a_span_without_changes_gets_nothing_beside_one_with_changes() -> None:
    assert split_rows(100, [0, 40]) == [0, 100]
