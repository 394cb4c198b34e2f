"""Which JetStream errors make a span's reader start a new consumer at its checkpoint."""

from __future__ import annotations

from nats.js.errors import APIError, NotFoundError, ServerError

from services.sink_worker.round.pull import CONSUMER_OFFLINE, consumer_lost


def test_a_gone_or_offline_consumer_is_lost_and_nothing_else() -> None:
    assert consumer_lost(NotFoundError(code=404, err_code=10014, description="consumer not found"))
    # What consumer info answers while the cluster node holding an R1 consumer is down.
    assert consumer_lost(ServerError(code=500, err_code=CONSUMER_OFFLINE, description="consumer is offline"))
    assert not consumer_lost(ServerError(code=503, err_code=10008, description="jetstream unavailable"))
    assert not consumer_lost(APIError(code=400, err_code=10012, description="consumer name already in use"))
