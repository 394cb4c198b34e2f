"""A sink-worker whose Spark JVM died exits to be restarted instead of failing every round:
``spark_gone`` tells a lost py4j gateway from ordinary job and database errors."""

from __future__ import annotations

import pytest
from py4j.protocol import Py4JNetworkError

from libs.spark import spark_gone


def test_a_lost_gateway_anywhere_in_the_chain_means_spark_is_gone() -> None:
    with pytest.raises(RuntimeError) as caught:
        try:
            raise Py4JNetworkError("Answer from Java side is empty")
        except Py4JNetworkError as exc:
            raise RuntimeError("apply job failed") from exc
    assert spark_gone(caught.value)


def test_database_and_job_errors_are_not_a_dead_jvm() -> None:
    assert not spark_gone(ValueError("bad value"))
    assert not spark_gone(ConnectionRefusedError("the downstream is down"))
    with pytest.raises(RuntimeError) as caught:
        try:
            raise ConnectionRefusedError("mariadb restarting")
        except ConnectionRefusedError as exc:
            raise RuntimeError("apply job failed") from exc
    assert not spark_gone(caught.value)
