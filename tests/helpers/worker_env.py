"""JVM options of every Spark driver the tests start, and the sink-workers' pacing.

JVM options: those of every Spark driver the tests start (the session's and the sink-worker
processes'): the C1 JIT only and the serial GC. The tests' Spark jobs are tiny, so a JVM's start
and first plans dominate, and on two cores the C2 compiler threads and the parallel GC's threads
take the CPU the other processes of a test need."""

SPARK_TEST_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

# A test sink-worker's pacing: the pause after an idle round (and the base of the back-off after
# failed ones) and the period it looks for new tables. The defaults (0.5 s, 2 s) are sized for
# production; every wait of a process test for rows to arrive pays them.
SINK_TEST_PACING = {"SLUICE_SINK_ROUND_INTERVAL_S": "0.2", "SLUICE_SINK_DISCOVERY_INTERVAL_S": "0.5"}

# A test sink-worker's Spark: local, two shuffle partitions, a small driver. Process tests about
# the data path run one standalone worker for every span (SPARK_WORKER_ENV plus
# SLUICE_SINK_STANDALONE); the control plane's process tests run several members, one core each.
SPARK_WORKER_ENV = {"SLUICE_SPARK_MASTER": "local[2]", "SLUICE_SPARK_SHUFFLE_PARTITIONS": "2",
                    "SLUICE_SPARK_DRIVER_MEMORY": "1g"}
STANDALONE_WORKER_ENV = {**SPARK_WORKER_ENV, "SLUICE_SINK_STANDALONE": "true"}
MEMBER_WORKER_ENV = {"SLUICE_SPARK_MASTER": "local[1]", "SLUICE_SPARK_SHUFFLE_PARTITIONS": "2",
                     "SLUICE_SPARK_DRIVER_MEMORY": "512m", "SLUICE_SINK_APPLY_PARTITIONS": "2"}
