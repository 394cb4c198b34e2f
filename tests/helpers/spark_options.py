"""JVM options of every Spark driver the tests start (the session's and the sink-worker
processes'): the C1 JIT only and the serial GC. The tests' Spark jobs are tiny, so a JVM's start
and first plans dominate, and on two cores the C2 compiler threads and the parallel GC's threads
take the CPU the other processes of a test need."""

SPARK_TEST_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
