"""Prometheus metrics of the sink-worker's data path."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from libs.ts import lag_seconds, ts_seconds

__all__ = ["lag_seconds", "ts_seconds"]

ROWS_APPLIED = Counter("sluice_sink_rows_applied", "Final row images written downstream.",
                       ["changefeed", "op"])
UNIQUE_CONFLICTS = Counter("sluice_sink_unique_conflicts_removed",
                           "Rows removed because an upserted row took their unique-key values.",
                           ["changefeed"])
BATCH_EVENTS = Histogram("sluice_sink_batch_events", "Events a round cut (all spans).",
                         buckets=(1, 10, 50, 100, 500, 1000, 2000, 5000, 10000, 50000))
BATCH_ROWS = Histogram("sluice_sink_batch_rows", "Final row images one apply job wrote.",
                       buckets=(1, 10, 50, 100, 500, 1000, 5000, 10000, 50000, 100000))
SORT_SECONDS = Histogram("sluice_sink_sort_seconds", "Duration of a round's cut (on the driver).")
APPLY_SECONDS = Histogram("sluice_sink_apply_seconds", "Duration of one apply job (one sink).")
ROUND_SECONDS = Histogram("sluice_sink_round_seconds", "Duration of a whole round with work.")
STAGE_SECONDS = Histogram(
    "sluice_sink_round_stage_seconds",
    "Where a round with work spends its time, by stage: pull (the pull and plan of every span), "
    "write (the worker thread: cut, apply jobs, DDL barriers), advance (checkpoint stores), "
    "ahead_wait (the read-ahead still running once the rest is done), frame (the batch to a "
    "DataFrame), job (the apply job's collect).", ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
ROUND_ERRORS = Counter("sluice_sink_round_errors", "Failures of a stage of a round.", ["stage"])
DDL_APPLIED = Counter("sluice_sink_ddl_applied", "DDL events applied to a target.", ["changefeed", "action"])
DDL_FAILURES = Counter("sluice_sink_ddl_failures",
                       "DDL events a downstream could not take (the table stops at the DDL).", ["changefeed"])
CHECKPOINT_LAG = Gauge("sluice_sink_checkpoint_lag_seconds",
                       "Wall clock minus the commit time of a span's checkpoint ts.", ["changefeed", "span"])
RESOLVED_LAG = Gauge("sluice_sink_checkpoint_behind_resolved_seconds",
                     "How far a span's checkpoint is behind its source's resolved ts.",
                     ["changefeed", "span"])
CHECKPOINT_TIME = Gauge("sluice_sink_checkpoint_timestamp_seconds",
                        "Commit time (Unix seconds) of a span's checkpoint ts.", ["changefeed", "span"])
SPANS = Gauge("sluice_sink_spans", "Spans this worker runs, by state.", ["state"])
TABLE_INCIDENTS = Counter("sluice_sink_table_incidents",
                          "Times a span stopped because the downstream refused a change for good.",
                          ["changefeed"])
TABLE_STOPPED = Gauge("sluice_sink_table_stopped",
                      "1 while a span is stopped by a downstream's permanent refusal (poison row).",
                      ["changefeed", "span"])
CROSS_SHARD_CONFLICTS = Counter("sluice_sink_cross_shard_unique_conflicts",
                                "Unique values of a merged target held by another shard's row, by what "
                                "happened (refused: the target stopped; overwritten: the row removed).",
                                ["changefeed", "action"])
KEYLESS_REFUSED = Counter("sluice_sink_keyless_refusals",
                          "Spans stopped because their table cannot be replicated as the changefeed "
                          "says (no usable key, table rules that do not fit).", ["changefeed"])


# Initial load (services/sink_worker/snapshot/initial_load.py).
SNAPSHOT_ROWS = Counter("sluice_snapshot_rows_copied", "Rows an initial load copied downstream.",
                        ["changefeed"])
SNAPSHOT_ROWS_COPIED = Gauge("sluice_snapshot_span_rows_copied",
                             "Rows copied so far by a span's initial load.", ["changefeed", "span"])
SNAPSHOT_ROWS_ESTIMATE = Gauge("sluice_snapshot_span_rows_estimate",
                               "The source's row estimate of a span's table when its copy was planned.",
                               ["changefeed", "span"])
SNAPSHOT_CHUNKS_DONE = Gauge("sluice_snapshot_span_chunks_done",
                             "Key-range chunks of a span's initial load copied in full.",
                             ["changefeed", "span"])
SNAPSHOT_ROWS_PER_S = Gauge("sluice_snapshot_span_rows_per_second",
                            "Copy speed of a span's initial load (its current run's rows over its time).",
                            ["changefeed", "span"])
SNAPSHOT_ETA_S = Gauge("sluice_snapshot_span_eta_seconds",
                       "Seconds a span's initial load still needs at its current speed (-1: not known yet).",
                       ["changefeed", "span"])
SNAPSHOT_FAILURES = Counter("sluice_snapshot_failures", "Initial-load runs that failed (retried later).",
                            ["changefeed"])
CHUNK_SETS_JOINED = Counter("sluice_sink_chunk_sets_joined",
                            "Events larger than the NATS max_payload joined from their chunks.")
VALIDATION_MISMATCHES = Gauge("sluice_sink_validation_mismatches",
                              "Rows validation found different downstream (re-checked, still different).",
                              ["changefeed", "span"])
VALIDATION_ROWS_CHECKED = Counter("sluice_sink_validation_rows_checked",
                                  "Rows validation compared with their source (changed rows, re-checks "
                                  "and on-demand compares).", ["changefeed"])
