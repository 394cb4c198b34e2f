"""The sink-worker's Spark warm-up runs a round's real plans on the session and writes nowhere."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from services.sink_worker.round.warm_up import warm_up

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("partitions", [1, 4])
def test_warm_up_runs_sort_and_final_images(spark: SparkSession, partitions: int) -> None:
    # warm_up checks its own outcome (two final images: the delete of the moved key and the
    # upsert of the new one) and raises otherwise.
    seconds = warm_up(spark, partitions)
    assert 0 < seconds < 120
