#!/usr/bin/env bash
# Chronicle Queue, the embedded log's peer (src/main/java/petrel/bench/ChronicleBench.java):
#
#   bench/peers/chronicle/run.sh append DIR COUNT PAYLOAD_BYTES   a new queue in DIR
#   bench/peers/chronicle/run.sh tail   DIR COUNT PAYLOAD_BYTES   read it back, in a new JVM
#
# Builds the peer with Maven (from Maven Central) on first use. Each run prints one JSON line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ ! -f "$here/target/classpath.txt" ] || [ "$here/src/main/java/petrel/bench/ChronicleBench.java" -nt "$here/target/classpath.txt" ]; then
  (cd "$here" && mvn -q -B package dependency:build-classpath -Dmdep.outputFile=target/classpath.txt >&2)
fi
# What Chronicle needs opened on Java 17 (its documentation lists these), and no analytics.
exec java \
  --add-exports=java.base/jdk.internal.ref=ALL-UNNAMED \
  --add-exports=java.base/sun.nio.ch=ALL-UNNAMED \
  --add-exports=jdk.unsupported/sun.misc=ALL-UNNAMED \
  --add-exports=jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED \
  --add-opens=jdk.compiler/com.sun.tools.javac=ALL-UNNAMED \
  --add-opens=java.base/java.lang=ALL-UNNAMED \
  --add-opens=java.base/java.lang.reflect=ALL-UNNAMED \
  --add-opens=java.base/java.io=ALL-UNNAMED \
  --add-opens=java.base/java.util=ALL-UNNAMED \
  -Dchronicle.analytics.disable=true \
  -cp "$here/target/chronicle-peer-1.jar:$(cat "$here/target/classpath.txt")" \
  petrel.bench.ChronicleBench "$@" 2> >(grep -v '^SLF4J' >&2)
