"""All Sluice settings, read from the environment with the ``SLUICE_`` prefix.

Every field here is listed in the README's settings table; ``tests/test_config.py`` fails when
one is missing there, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

# The local Spark driver's memory bounds (``libs/spark.py``, measured with
# ``benchmarks/bench_worker_memory.py``, see BENCHMARKS.md): the serial collector (G1's own
# structures took 80 MiB beside a 1 GiB heap, the serial one's 1 MiB, and the driver's heap work
# is small: the rows are in the Python workers), a heap that starts small, resized in one step,
# and a code cache capped well above the 15-20 MiB it fills. While busy the heap keeps the JVM's
# usual 40-70 % free after a full collection: held to 10-30 % it was collected fully 23-25 times
# in 45 s of a sysbench backlog (6-7 s stopped), 9 times with these. When a worker turns quiet
# ``sink_idle_trim_s``'s full collection runs with 10-30 % (``idle_trim.IDLE_HEAP_FREE``, both
# flags are manageable at run time), which gives the free heap back. A heap that
# runs out ends the JVM: an OutOfMemoryError in one of Spark's own threads (its scheduler's
# dispatcher, serialising a round's tasks) otherwise leaves the driver alive but never finishing
# a job, and the worker waiting on it for good; a JVM that is gone makes the worker exit to be
# restarted (``spark_gone``), and the control plane moves its spans meanwhile. The JIT stops at
# C1: the driver carries rows as opaque bytes and schedules tasks, and C2's compilations were a
# quarter of its CPU under sysbench (10.2 -> 7.7 CPU seconds in 45 s, BENCHMARKS.md) on a machine
# where every core was taken, besides the compiler's own memory.
DRIVER_MEMORY_OPTIONS = ("-XX:+UseSerialGC -Xms32m -XX:MinHeapFreeRatio=40 -XX:MaxHeapFreeRatio=70 "
                         "-XX:-ShrinkHeapInSteps -XX:ReservedCodeCacheSize=64m -XX:+ExitOnOutOfMemoryError "
                         "-XX:TieredStopAtLevel=1")


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    # NATS
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma separated.")
    nats_user: str | None = Field(None, description="NATS user name.")
    nats_password: SecretStr | None = Field(None, description="NATS password.")
    nats_token: SecretStr | None = Field(None, description="NATS auth token.")
    nats_creds_file: str | None = Field(None, description="Path of a NATS .creds file.")
    nats_users_dir: str | None = Field(
        None, description="Directory of per-role password files (python -m libs.nats_auth local): "
                          "a service without nats_user connects as its own role with file <role>.")
    nats_tls_ca_file: str | None = Field(
        None, description="CA (PEM) that signed the NATS server's certificate; setting it turns TLS on.")
    nats_tls_cert_file: str | None = Field(None, description="Client certificate (PEM) presented to NATS.")
    nats_tls_key_file: str | None = Field(
        None, description="Private key (PEM) of the NATS client certificate.")
    nats_connect_timeout_s: float = Field(
        30.0, gt=0, description="How long a starting service waits for NATS before it fails."
    )
    stream_replicas: int = Field(1, ge=1, le=5, description="JetStream replicas of every Sluice stream.")
    dedup_window_s: float = Field(120.0, gt=0, description="JetStream Nats-Msg-Id duplicate window.")

    # Process identity and HTTP
    instance_id: str = Field(default_factory=_default_instance_id, description="This process' id.")
    http_host: str = Field("127.0.0.1", description="Bind address of the health/metrics/API server.")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 means the service's default.")
    log_level: str = Field("INFO", description="Python log level.")
    loop_stall_log_s: float = Field(
        0.5, ge=0, description="A service whose event loop ran no callback for this long logs where it was "
                               "stuck and counts it in sluice_event_loop_stall_seconds (0: not watched).")
    log_json: bool = Field(True, description="Structured JSON logs with trace ids.")

    # Leadership
    lease_ttl_s: float = Field(3.0, gt=0.2, description="Leader lease TTL in seconds.")
    member_ttl_s: float = Field(3.0, gt=0.2, description="A sink-worker is gone after this silence.")
    heartbeat_interval_s: float = Field(0.2, gt=0, description="How often a sink-worker sends its heartbeat.")
    heartbeat_complete_interval_s: float = Field(
        1.0, ge=0, description="How often a sink-worker's heartbeat is its complete report; the ones between "
                               "carry only the spans whose status changed since (0: every one complete)."
    )
    member_fence_s: float = Field(
        1.0, gt=0, description="A sink-worker stops writing when no heartbeat was confirmed for this long."
    )
    control_snapshot_every: int = Field(
        5000, ge=10, description="Control leaders snapshot their domain state every this many events."
    )

    # Scheduling (scheduler and replication-manager)
    scheduler_interval_s: float = Field(1.0, gt=0, description="Scheduler round period ; also on changes.")
    scheduler_balance_interval_s: float = Field(60.0, gt=0, description="Automatic balance period.")
    scheduler_operator_pin_s: float = Field(
        600.0, ge=0, description="The automatic balance leaves a table an operator moved there this long."
    )
    scheduler_max_task_concurrency: int = Field(10, ge=1, description="Moves in flight at most.")
    scheduler_add_batch_size: int = Field(50, ge=1, description="Spans added per scheduler round at most.")
    scheduler_max_adds_per_member: int = Field(
        100, ge=1, description="Adds in flight (not yet replicating) per member at most: a changefeed "
                               "of thousands of tables starts at the pace the workers prepare spans "
                               "instead of piling prepares past their timeout.")
    scheduler_discovery_interval_s: float = Field(
        2.0, gt=0, description="How often the scheduler looks for new tables of the changefeeds."
    )
    scheduler_task_timeout_s: float = Field(
        30.0, gt=0, description="An unanswered schedule task is planned again after this."
    )
    replication_tick_s: float = Field(2.0, gt=0, description="Resend period of unanswered dispatches.")
    replication_syncpoint_tick_s: float = Field(
        0.2, gt=0, description="How often the replication-manager leader looks at its changefeeds' "
                               "syncpoints (plans, reaches, releases).")
    replication_checkpoint_interval_s: float = Field(
        0.25, gt=0, description="How often changefeed checkpoint advances are recorded at most (the "
                                "published checkpoint lags the spans' by up to this much)."
    )
    dispatch_timeout_s: float = Field(2.0, gt=0, description="Wait for a dispatch answer.")
    dispatch_resend_s: float = Field(
        10.0, gt=0, description="A dispatch the member accepted is not sent again for this long (the "
                                "ticks resend only unanswered ones before)."
    )
    replication_prepare_timeout_s: float = Field(
        20.0, gt=0, description="A destination not Prepared after this is given up (move/add rolled back)."
    )

    # Spark
    spark_master: str = Field(
        "local[*]",
        description="Where the data path jobs run: local[*] | local[N] (in this process), spark://host:port "
                    "(a standalone cluster) or sc://host:port (a Spark Connect server).",
        pattern=r"^(local(\[(\*|\d+)\])?|spark://.+|sc://.+)$",
    )
    spark_shuffle_partitions: int = Field(8, ge=1, description="spark.sql.shuffle.partitions.")
    spark_driver_memory: str = Field(
        "512m", description="spark.driver.memory of the local driver (its JVM's -Xmx).")
    spark_driver_memory_options: str = Field(
        DRIVER_MEMORY_OPTIONS,
        description="JVM flags of the local driver that bound its memory beyond the heap's maximum and "
                    "let the heap shrink when idle; before spark_driver_java_options (whose flags win). "
                    "Empty: the JVM's own defaults.")
    spark_driver_java_options: str = Field(
        "", description="spark.driver.extraJavaOptions (JVM flags of the local driver, e.g. JIT settings)."
    )
    spark_class_archive: str = Field(
        "auto", description="JVM class-data-sharing archive the local Spark driver maps "
        "(libs/spark_class_archive.py): auto (the venv's, when infra/dev.sh setup built it), none, or a path."
    )
    spark_driver_host: str = Field(
        "127.0.0.1", description="Address a Spark cluster's executors reach the driver at (driver.host)."
    )

    # Sink-worker data path
    # With hundreds of tables each behind by a few single-row transactions, 2,000 gave every span
    # a handful of events a round: at 300 tables a worker applied ~500 of 2,000 rows/s and the lag
    # grew without end (BENCHMARKS.md, "A round's event ceiling"). The byte budget below is what
    # bounds a round of large events.
    sink_max_events_per_round: int = Field(
        20000, ge=1, description="Events a sink-worker pulls per round, all its spans together (bounds "
                                 "driver memory with sink_round_max_bytes); a span's share grows while "
                                 "it is behind."
    )
    sink_min_events_per_round: int = Field(
        100, ge=1, description="The least a caught-up span's per-round event allowance shrinks to."
    )
    # A round's event bytes cross the local driver's heap several times over at once (read from
    # PySpark's Arrow file, sliced into tasks, each task serialised into a growing buffer): 128 MiB
    # rounds of a sysbench backlog ran a 512 MiB heap out of memory. A quarter of that is still
    # ~100,000 sysbench transaction parts a round.
    sink_round_max_bytes: int = Field(
        32 * 1024 * 1024, ge=1024 * 1024,
        description="Event bytes a round's allowances may bring into the driver, all spans together "
                    "(each span's allowance x its mean event size)."
    )
    sink_apply_partitions: int = Field(4, ge=1, description="Parallel apply partitions per round.")
    sink_stop_grace_s: float = Field(
        4.0, gt=0, description="On SIGTERM, how long the current round may take before it is abandoned."
    )
    sink_checkpoint_interval_s: float = Field(
        1.0, gt=0, description="The most often an idle span stores its resolved-following checkpoint."
    )
    rows_max_consumers: int = Field(
        100_000, ge=1_000,
        description="Consumers the ROWS stream takes (one per table a worker runs, and one per "
                    "table being prepared); nats-server 2.15 allows 1,000 to a stream that names none."
    )
    sink_quiet_recheck_s: float = Field(
        5.0, ge=0, description="How often a span with nothing to read stores its checkpoint (a compare-and-"
                                "set); it follows the resolved ts after one request per source and is "
                                "visited in full when its source has new data (0: every round)."
    )
    sink_round_interval_s: float = Field(
        0.5, gt=0, description="Longest wait after a round that found nothing (a new resolved mark ends it)."
    )
    sink_discovery_interval_s: float = Field(
        2.0, gt=0, description="How often a worker looks for new tables of its changefeeds."
    )
    sink_standalone: bool = Field(
        False, description="Run every span of every running changefeed without the control plane."
    )
    sink_drain_timeout_s: float = Field(
        5.0, gt=0, description="On SIGTERM, how long a worker waits for its spans to move elsewhere."
    )
    sink_idle_trim_s: float = Field(
        10.0, ge=0, description="sink-worker: after this many seconds without a Spark job, give the "
                                "memory of the last busy spell back (a full GC of the driver JVM, "
                                "malloc_trim); 0: never.")
    sink_python_malloc: str = Field(
        "", description="sink-worker: PYTHONMALLOC its process re-executes itself with at start "
                        "(unless PYTHONMALLOC is set); empty (the default): Python's own pymalloc. "
                        "malloc lets the idle trim return what a busy spell freed (a smaller idle "
                        "worker) but keeps it until then (a higher peak under a large transaction).")
    sink_writer_log: str | None = Field(
        None, description="Append one JSON line per span and round that wrote downstream (audit)."
    )

    # Shard DDL coordination (ddl-lock leader and the sink-workers' shard DDL handling).
    ddl_lock_resend_s: float = Field(
        10.0, gt=0, description="ddl-lock: re-send an unanswered operation, or ask a shard for its "
                                "Info again, after this many seconds.")
    ddl_lock_discovery_interval_s: float = Field(
        2.0, gt=0, description="ddl-lock: how often shard groups are recomputed from the changefeeds "
                               "and the ROWS stream.")
    shard_ddl_info_resend_s: float = Field(
        5.0, gt=0, description="sink-worker: a span blocked at a shard DDL re-sends its Info this often "
                               "while no operation came.")
    # Initial load (snapshot) of a changefeed's tables
    snapshot_chunk_rows: int = Field(
        50_000, ge=1, description="Rows per primary-key chunk of an initial load (the unit of resume)."
    )
    snapshot_parallelism: int = Field(
        4, ge=1,
        description="Copy jobs an initial load keeps in flight (a task of a few chunks each).",
    )
    snapshot_inline_rows: int = Field(
        0, ge=0,
        description="A table of at most this many rows (counted, bounded) is copied by the worker "
                    "itself instead of a Spark job: a job's fixed cost is most of a small table's "
                    "copy. 0 (the default): every copy is a Spark job.",
    )
    snapshot_write_rows: int = Field(
        5000, ge=1, description="Rows per write transaction of an initial load (bounds executor memory)."
    )
    snapshot_watermark_timeout_s: float = Field(
        60.0, gt=0, description="How long an initial load waits for a resolved mark of its source."
    )
    snapshot_retry_s: float = Field(10.0, gt=0, description="Pause before a failed initial load runs again.")

    # validation: continuous validation and on-demand compares (sink-worker)
    validation_interval_s: float = Field(
        2.0, gt=0, description="sink-worker: how often each validated span checks its changed rows.")
    validation_batch_rows: int = Field(
        500, ge=1, description="sink-worker: changed rows (and reported rows) a span checks per cycle.")
    validation_max_pending: int = Field(
        10_000, ge=1, description="sink-worker: changed rows a span keeps waiting for a check; more are "
                                  "counted as skipped.")
    validation_max_reported: int = Field(
        1000, ge=1, description="sink-worker: mismatched rows a span lists and re-checks; more are counted.")
    validation_compare_chunk_rows: int = Field(
        1000, ge=1, description="sink-worker: rows of an on-demand compare per span and cycle.")

    # Databases
    downstream_url: str = Field(
        "sqlite:///.sluice/downstream.db", description="Default downstream (sink) database URL."
    )
    state_db_url: str = Field("sqlite:///.sluice/state.db", description="The api's read-model database.")
    source_id: str = Field("src1", description="capture: id of the source this process reads.")
    source_url: str = Field(
        "", description="capture: the source's URL; empty: the URL the sources registry holds for source_id.")
    source_server_id: int = Field(4101, ge=1, description="capture: replica server id for the binlog.")
    # bigrows: rows larger than a NATS message
    capture_max_message_bytes: int = Field(
        256 * 1024 * 1024, ge=1024 * 1024,
        description="capture: largest encoded row-change message (one row alone in it, JSON with "
                    "base64 for binary); larger ones are sent in chunks of the server's "
                    "max_payload up to this, beyond it the table is stopped with a rejection.")
    capture_reader_process: bool = Field(
        True, description="capture: parse the binlog in a child process (its own core, items "
                          "sent in pickled batches); false: on a thread of capture (debugging).")
    capture_fast_rows: bool = Field(
        True, description="capture: decode rows events with a decoder compiled per table map "
                          "(the library's values, several times faster); false: the binlog "
                          "library's own per-column parse for every table.")
    capture_direct_events: bool = Field(
        True, description="capture: read the hot binlog events (GTID, XID, BEGIN/COMMIT, a table "
                          "map seen before, rows events) from the packets' bytes without the "
                          "binlog library's event objects; false: every event by the library.")
    capture_batch_transactions: int = Field(
        64, ge=1,
        description="capture: whole transactions of a table go out together in one rows.changed v4 "
                    "message, in windows of this many MariaDB GTIDs (seq_no // n; without GTIDs, "
                    "n KiB of binlog), up to the part limits (500 rows, 256 KiB); 1: a message "
                    "per transaction and table (v3, as before).")
    capture_xa_memory_bytes: int = Field(
        64 * 1024 * 1024, ge=0,
        description="capture: row bytes the prepared, undecided XA transactions of a source keep in "
                    "memory together; beyond it their parts go to temporary files (TMPDIR).")
    # A transaction larger than this is applied streamed (below): at 512 MiB a 1M-change UPDATE
    # (~170 MB of messages) was held whole and the worker tree peaked at 1,272 MiB; at 64 MiB it
    # streams at 1,093 MiB, 12 % slower, and sysbench's lag and catch-up did not move.
    sink_pull_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024,
        description="sink-worker: event bytes a span's reader keeps in memory (beyond them it "
                    "keeps only positions); a transaction in progress may exceed it by its rest.")
    sink_large_txn_stream: bool = Field(
        True, description="sink-worker: a transaction larger than its span's round (allowance, "
                          "SLUICE_SINK_PULL_MAX_BYTES) is read in windows and written streamed in one "
                          "downstream transaction, instead of held whole (SQL sinks; table spans without "
                          "table rules, cross-shard guard or skipped keys).")
    sink_large_txn_window_events: int = Field(
        64, ge=1, description="sink-worker: messages one window of a streamed large transaction reads.")
    sink_large_txn_window_bytes: int = Field(
        32 * 1024 * 1024, ge=1024 * 1024,
        description="sink-worker: body bytes one window of a streamed large transaction keeps.")
    sink_large_value_bytes: int = Field(
        1024 * 1024, ge=1024,
        description="sink-worker: values longer than this (contract encoding: base64 for binary) "
                    "stay in the worker process; the Spark jobs carry a reference and the driver "
                    "writes such rows itself. Keys above it stop their table.")

    # Operator API (services.api) and CLI (services.cli)
    api_auth: bool = Field(
        True, description="Require a token on every /api/v1 endpoint; false opens the api to anyone "
                          "(development only).")
    api_token: SecretStr | None = Field(
        None, description="An operator token (principal 'operator'); the CLI sends it too.")
    api_tokens: SecretStr | None = Field(
        None, description="Comma-separated principal:role:token entries; role is viewer or operator.")
    api_tokens_file: str | None = Field(
        None, description="File of principal:role:token lines (# comments), read at start.")
    api_max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body the api reads; larger ones get 413.")
    secrets_dir: str | None = Field(
        None, description="Directory of secret files: URL password secret:NAME reads file NAME here "
                          "(else env SLUICE_SECRET_<NAME>); read by libs.secret_refs.")
    secrets_hosts: str | None = Field(
        None, description="Where each secret may be sent: NAME=host:port,host;NAME2=... A secret is "
                          "resolved only for a URL whose host(s) are bound to it; read by libs.secret_refs.")
    api_command_timeout_s: float = Field(
        5.0, gt=0, description="How long the api waits for a leader to answer a command.")
    api_url: str = Field("http://127.0.0.1:8100", description="CLI: base URL of the api.")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
