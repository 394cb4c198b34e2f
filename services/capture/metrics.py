"""Prometheus metrics of the capture service, labelled by source."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROWS_PUBLISHED = Counter("sluice_capture_rows_published", "Row images published.", ["source"])
MESSAGES_PUBLISHED = Counter("sluice_capture_messages_published",
                             "Messages published to the ROWS stream, by event type.",
                             ["source", "type"])
PUBLISH_LATENCY = Histogram("sluice_capture_publish_latency_seconds",
                            "From publish to the JetStream ack.", ["source"],
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                     0.5, 1.0, 2.5, 5.0))
RESOLVED_TIME = Gauge("sluice_capture_resolved_timestamp_seconds",
                      "Commit time (Unix seconds) of the last published resolved ts.", ["source"])
REJECTIONS = Counter("sluice_capture_rejections", "Inputs capture refused to replicate, by kind.",
                     ["source", "kind"])
SESSIONS = Counter("sluice_capture_sessions", "Binlog reading sessions started, by how they ended.",
                   ["source", "outcome"])
CHUNKS_PUBLISHED = Counter("sluice_capture_chunks_published",
                           "Chunk messages published for messages over the server's max_payload.",
                           ["source"])
OVERSIZED = Counter("sluice_capture_oversized_messages",
                    "Messages over SLUICE_CAPTURE_MAX_MESSAGE_BYTES; their table is stopped.",
                    ["source"])
CASCADING_FOREIGN_KEYS = Gauge(
    "sluice_capture_cascading_foreign_keys",
    "Foreign keys with ON DELETE/UPDATE CASCADE, SET NULL or SET DEFAULT among the captured tables: "
    "the child rows they change never reach the binlog.", ["source"])
XA_PREPARED = Gauge("sluice_capture_xa_prepared",
                    "XA transactions prepared and waiting for their XA COMMIT or XA ROLLBACK.", ["source"])
XA_LOST = Counter("sluice_capture_xa_lost",
                  "XA transactions whose rows capture cannot publish: committed without capture having "
                  "seen their prepared group, or prepared groups not found again in the binlog.",
                  ["source"])
SOURCE_FAILING_SINCE = Gauge(
    "sluice_capture_source_failing_since_timestamp_seconds",
    "When capture's sessions with the source began failing (cannot connect, refused, binlog "
    "purged; UNIX time); 0 while it reads.", ["source"])
