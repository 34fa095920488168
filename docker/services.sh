#!/usr/bin/env bash
# Real Redis + real Apache Kafka (KRaft) on loopback, without Docker.
#
#   docker/services.sh start|stop|status|env [redis|kafka|cluster|cluster6|cluster-ha|clusters|all]
#   docker/services.sh restart kafka   stop and start the broker keeping its data (a short outage)
#   docker/services.sh freeze kafka N  a hung broker: SIGSTOP for N seconds (connections stay open, nothing
#                                      answers), then SIGCONT
#
#   redis       plain Redis (:6379), Redis with requirepass (:6380), TLS Redis (:6381, self-signed CA)
#   kafka       Apache Kafka 3.9.1, one combined broker+controller: PLAINTEXT :9092, SASL_PLAINTEXT/PLAIN :9094
#   cluster     Redis Cluster on :7001-7003, 3 masters (only when asked for explicitly). Any number of
#               masters: one port each; with NEARDUP_REDIS_CLUSTER_REPLICAS=N, N replicas each (ports:
#               masters first, then replicas; 3 masters or more)
#   cluster6    6-master Redis Cluster on :7011-7016
#   cluster-ha  3 masters and a replica each on :7021-7026 (node timeout 2 s: failover tests)
#   clusters    the three clusters
#   all         redis + kafka (default); for stop/status/env, `all` also covers running clusters
#
#   eval "$(docker/services.sh env)"   exports NEARDUP_TEST_* for the test suite.
#
# Environment: NEARDUP_CACHE (~/.cache/neardup), NEARDUP_STATE ($NEARDUP_CACHE/services),
#   NEARDUP_REDIS_PORT/_AUTH_PORT/_TLS_PORT, NEARDUP_REDIS_PASSWORD, NEARDUP_REDIS_CLUSTER_PORTS,
#   NEARDUP_REDIS_CLUSTER_REPLICAS (0), NEARDUP_REDIS_CLUSTER6_PORTS, NEARDUP_REDIS_CLUSTER_HA_PORTS,
#   NEARDUP_KAFKA_PORT/_SASL_PORT/_CONTROLLER_PORT, NEARDUP_KAFKA_SASL_PASSWORD,
#   NEARDUP_KAFKA_HEAP ("-Xms256m -Xmx512m"), NEARDUP_KAFKA_START_TIMEOUT (120 s), NEARDUP_MVN_ARGS.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOST=127.0.0.1
KAFKA_VERSION=3.9.1

CACHE=${NEARDUP_CACHE:-$HOME/.cache/neardup}
STATE=${NEARDUP_STATE:-$CACHE/services}
JARS=${NEARDUP_KAFKA_JARS:-$CACHE/kafka-jars-$KAFKA_VERSION}
POM=$HERE/kafka/pom.xml

REDIS_PORT=${NEARDUP_REDIS_PORT:-6379}
REDIS_AUTH_PORT=${NEARDUP_REDIS_AUTH_PORT:-6380}
REDIS_TLS_PORT=${NEARDUP_REDIS_TLS_PORT:-6381}
REDIS_PASSWORD=${NEARDUP_REDIS_PASSWORD:-neardup-secret}
read -r -a CLUSTER_PORTS <<<"${NEARDUP_REDIS_CLUSTER_PORTS:-7001 7002 7003}"
CLUSTER_REPLICAS=${NEARDUP_REDIS_CLUSTER_REPLICAS:-0}
read -r -a CLUSTER6_PORTS <<<"${NEARDUP_REDIS_CLUSTER6_PORTS:-7011 7012 7013 7014 7015 7016}"
read -r -a CLUSTER_HA_PORTS <<<"${NEARDUP_REDIS_CLUSTER_HA_PORTS:-7021 7022 7023 7024 7025 7026}"

KAFKA_PORT=${NEARDUP_KAFKA_PORT:-9092}
KAFKA_SASL_PORT=${NEARDUP_KAFKA_SASL_PORT:-9094}
KAFKA_CONTROLLER_PORT=${NEARDUP_KAFKA_CONTROLLER_PORT:-9093}
KAFKA_SASL_USER=neardup
KAFKA_SASL_PASSWORD=${NEARDUP_KAFKA_SASL_PASSWORD:-neardup-secret}
KAFKA_HEAP=${NEARDUP_KAFKA_HEAP:--Xms256m -Xmx512m}
KAFKA_START_TIMEOUT=${NEARDUP_KAFKA_START_TIMEOUT:-120}
KAFKA_DIR=$STATE/kafka
TLS_DIR=$STATE/tls

log() { printf '[services] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

usage() {
  sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# --- helpers ----------------------------------------------------------------------------------------

pid_of() { [[ -s $1 ]] && cat "$1"; }
pid_alive() { local pid; pid=$(pid_of "$1") && [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }
port_open() { (: <>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# Percent-encode for use inside a URL (keeps unreserved characters and '/').
urlencode() {
  local s=$1 out='' c i
  for ((i = 0; i < ${#s}; i++)); do
    c=${s:i:1}
    case $c in
      [a-zA-Z0-9._~/-]) out+=$c ;;
      *) printf -v c '%%%02X' "'$c"; out+=$c ;;
    esac
  done
  printf '%s' "$out"
}

# Kill the process in a pidfile: TERM, wait up to $2 s, then KILL.
kill_pidfile() {
  local pidfile=$1 wait_s=${2:-15} pid i
  pid=$(pid_of "$pidfile") || { rm -f "$pidfile"; return 0; }
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < wait_s * 10; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid did not exit after ${wait_s}s, sending KILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
  fi
  rm -f "$pidfile"
}

need_root_for_install() {
  [[ $(id -u) -eq 0 ]] || die "$1 is missing and installing it needs root: sudo apt-get install -y $2"
}

# --- Redis ------------------------------------------------------------------------------------------

ensure_redis_installed() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then return; fi
  need_root_for_install redis-server redis-server
  log "installing redis-server with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # A freshly installed Debian package may start its own system instance on :6379; ours must own the port.
  if [[ -x /etc/init.d/redis-server ]]; then /etc/init.d/redis-server stop >/dev/null 2>&1 || true; fi
}

# redis_ping PORT [redis-cli args...]: true when the instance answers PONG.
redis_ping() {
  local port=$1; shift
  [[ $(redis-cli -h "$HOST" -p "$port" "$@" ping 2>/dev/null) == PONG ]]
}

# start_redis NAME PORT [PING-ARGS ...] -- [EXTRA CONFIG LINES ...]
start_redis() {
  local name=$1 port=$2; shift 2
  local -a ping_args=() conf_lines=()
  while (($#)) && [[ $1 != -- ]]; do ping_args+=("$1"); shift; done
  (($#)) && shift
  conf_lines=("$@")
  local dir=$STATE/redis-$name i
  if pid_alive "$dir/redis.pid"; then
    log "redis-$name already running (pid $(pid_of "$dir/redis.pid"), port $port)"
    return 0
  fi
  port_open "$port" && die "port $port is already in use by a process not started from $STATE (set NEARDUP_REDIS_*PORT*)"
  mkdir -p "$dir"
  rm -f "$dir/redis.log"
  {
    printf '%s\n' \
      "bind $HOST" "protected-mode yes" "port $port" "daemonize yes" \
      "pidfile $dir/redis.pid" "logfile $dir/redis.log" "dir $dir" \
      'save ""' "appendonly no" "databases 16"
    printf '%s\n' "${conf_lines[@]}"
  } >"$dir/redis.conf"
  redis-server "$dir/redis.conf" || die "redis-$name failed to start: $(tail -n 20 "$dir/redis.log" 2>/dev/null)"
  for ((i = 0; i < 100; i++)); do
    redis_ping "$port" "${ping_args[@]}" && { log "redis-$name up on $HOST:$port"; return 0; }
    sleep 0.1
  done
  die "redis-$name did not answer PING on $HOST:$port; log tail:
$(tail -n 30 "$dir/redis.log" 2>/dev/null)"
}

stop_redis() {
  local name=$1 dir=$STATE/redis-$1
  if pid_alive "$dir/redis.pid"; then
    kill_pidfile "$dir/redis.pid" 15
    log "redis-$name stopped"
  else
    rm -f "$dir/redis.pid"
  fi
}

ensure_tls_certs() {
  [[ -s $TLS_DIR/ca.crt && -s $TLS_DIR/server.crt && -s $TLS_DIR/server.key ]] &&
    openssl x509 -checkend 86400 -noout -in "$TLS_DIR/server.crt" >/dev/null 2>&1 && return 0
  command -v openssl >/dev/null || return 1
  rm -rf "$TLS_DIR"
  mkdir -p "$TLS_DIR"
  (
    cd "$TLS_DIR"
    openssl req -x509 -new -nodes -newkey rsa:2048 -sha256 -days 3650 \
      -keyout ca.key -out ca.crt -subj "/CN=neardup-test-ca"
    openssl req -new -nodes -newkey rsa:2048 -sha256 \
      -keyout server.key -out server.csr -subj "/CN=localhost"
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=serverAuth" "subjectAltName=IP:127.0.0.1,DNS:localhost" >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
      -extfile server.ext -out server.crt
    chmod 600 ca.key server.key
  ) >"$STATE/tls-gen.log" 2>&1 || { log "openssl failed: $(tail -n 5 "$STATE/tls-gen.log")"; return 1; }
}

start_redis_tls() {
  rm -f "$STATE/redis-tls.unavailable"
  if ! ensure_tls_certs; then
    log "TLS Redis skipped: could not create certificates"
    echo "no certificates" >"$STATE/redis-tls.unavailable"
    return 0
  fi
  # Debian's redis-server 7 is built with TLS; a build without it rejects the tls-* directives.
  if ! (start_redis tls "$REDIS_TLS_PORT" --tls --cacert "$TLS_DIR/ca.crt" -- \
    "port 0" "tls-port $REDIS_TLS_PORT" \
    "tls-cert-file $TLS_DIR/server.crt" "tls-key-file $TLS_DIR/server.key" \
    "tls-ca-cert-file $TLS_DIR/ca.crt" "tls-auth-clients no"); then
    log "TLS Redis skipped: this redis-server does not start with TLS (see $STATE/redis-tls/redis.log)"
    echo "redis-server without TLS" >"$STATE/redis-tls.unavailable"
    stop_redis tls
  fi
}

start_redis_all() {
  ensure_redis_installed
  mkdir -p "$STATE"
  start_redis plain "$REDIS_PORT" --
  REDISCLI_AUTH=$REDIS_PASSWORD start_redis auth "$REDIS_AUTH_PORT" -- "requirepass \"$REDIS_PASSWORD\""
  start_redis_tls
}

stop_redis_all() {
  stop_redis plain
  stop_redis auth
  stop_redis tls
}

# --- Redis Cluster ----------------------------------------------------------------------------------

cluster_ok() { redis-cli -h "$HOST" -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

# The ports of a named cluster, and its replicas per master and node timeout (ms).
cluster_spec() { # NAME -> sets SPEC_PORTS, SPEC_REPLICAS, SPEC_TIMEOUT
  case $1 in
    cluster) SPEC_PORTS=("${CLUSTER_PORTS[@]}") SPEC_REPLICAS=$CLUSTER_REPLICAS SPEC_TIMEOUT=5000 ;;
    cluster6) SPEC_PORTS=("${CLUSTER6_PORTS[@]}") SPEC_REPLICAS=0 SPEC_TIMEOUT=5000 ;;
    cluster-ha) SPEC_PORTS=("${CLUSTER_HA_PORTS[@]}") SPEC_REPLICAS=1 SPEC_TIMEOUT=2000 ;;
    *) die "unknown cluster $1" ;;
  esac
}

# start_cluster NAME: its nodes (a node that died is started again on its nodes.conf and rejoins), then
# the cluster if it is not formed: `redis-cli --cluster create` for 3 masters or more, slots assigned by
# hand for 1 or 2 (redis-cli refuses fewer than 3).
start_cluster() {
  ensure_redis_installed
  mkdir -p "$STATE"
  cluster_spec "$1"
  local port all_ok=1 i n=${#SPEC_PORTS[@]} masters
  masters=$((n / (SPEC_REPLICAS + 1)))
  ((masters >= 1 && masters * (SPEC_REPLICAS + 1) == n)) || die "$1: ${n} ports do not make masters with $SPEC_REPLICAS replicas each"
  ((SPEC_REPLICAS == 0 || masters >= 3)) || die "$1: replicas need 3 masters or more"
  for port in "${SPEC_PORTS[@]}"; do
    start_redis "cluster-$port" "$port" -- \
      "cluster-enabled yes" "cluster-config-file $STATE/redis-cluster-$port/nodes.conf" \
      "cluster-node-timeout $SPEC_TIMEOUT" "cluster-require-full-coverage yes"
  done
  # A node started again on the nodes.conf of a formed cluster rejoins on its own: wait for it a little.
  local formed=1
  for port in "${SPEC_PORTS[@]}"; do
    [[ $(grep -cv '^vars' "$STATE/redis-cluster-$port/nodes.conf" 2>/dev/null) == "$n" ]] || formed=0
  done
  for ((i = 0; i < (formed ? 100 : 1); i++)); do
    all_ok=1
    for port in "${SPEC_PORTS[@]}"; do
      cluster_ok "$port" || all_ok=0
      [[ $(redis-cli -h "$HOST" -p "$port" cluster info 2>/dev/null | tr -d '\r' |
        sed -n 's/^cluster_known_nodes://p') == "$n" ]] || all_ok=0
    done
    ((all_ok)) && break
    sleep 0.1
  done
  if ((all_ok)); then
    log "redis $1 already formed on ports ${SPEC_PORTS[*]}"
    return 0
  fi
  # Not (fully) formed: reset every node so that it can be formed afresh, then form it.
  for port in "${SPEC_PORTS[@]}"; do
    redis-cli -h "$HOST" -p "$port" flushall >/dev/null
    redis-cli -h "$HOST" -p "$port" cluster reset hard >/dev/null
  done
  if ((masters >= 3)); then
    local -a nodes=()
    for port in "${SPEC_PORTS[@]}"; do nodes+=("$HOST:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas "$SPEC_REPLICAS" --cluster-yes \
      >"$STATE/$1-create.log" 2>&1 || die "redis-cli --cluster create failed:
$(tail -n 30 "$STATE/$1-create.log")"
  else
    for port in "${SPEC_PORTS[@]:1}"; do redis-cli -h "$HOST" -p "$port" cluster meet "$HOST" "${SPEC_PORTS[0]}" >/dev/null; done
    for ((i = 0; i < n; i++)); do
      redis-cli -h "$HOST" -p "${SPEC_PORTS[i]}" cluster addslotsrange $((i * 16384 / n)) $(((i + 1) * 16384 / n - 1)) >/dev/null
    done
  fi
  for ((i = 0; i < 300; i++)); do
    all_ok=1
    for port in "${SPEC_PORTS[@]}"; do cluster_ok "$port" || all_ok=0; done
    if ((all_ok)); then
      log "redis $1 up on ports ${SPEC_PORTS[*]} ($masters masters, $SPEC_REPLICAS replicas each; cluster_state:ok)"
      return 0
    fi
    sleep 0.1
  done
  die "redis $1 did not reach cluster_state:ok within 30s:
$(redis-cli -h "$HOST" -p "${SPEC_PORTS[0]}" cluster info 2>&1 | head -n 8)"
}

stop_cluster() {
  cluster_spec "$1"
  local port
  for port in "${SPEC_PORTS[@]}"; do
    stop_redis "cluster-$port"
    rm -f "$STATE/redis-cluster-$port/nodes.conf"
  done
}

cluster_running() {
  cluster_spec "$1"
  local port
  for port in "${SPEC_PORTS[@]}"; do pid_alive "$STATE/redis-cluster-$port/redis.pid" || return 1; done
}

CLUSTERS=(cluster cluster6 cluster-ha)
CLUSTER_ENV=([0]=NEARDUP_TEST_REDIS_CLUSTER_URL [1]=NEARDUP_TEST_REDIS_CLUSTER6_URL [2]=NEARDUP_TEST_REDIS_CLUSTER_HA_URL)

# --- Kafka ------------------------------------------------------------------------------------------

pom_hash() { sha256sum "$POM" | cut -d' ' -f1; }

ensure_java_maven() {
  local missing=()
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
  ((${#missing[@]})) || return 0
  need_root_for_install "${missing[*]}" "${missing[*]}"
  log "installing ${missing[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

ensure_kafka_jars() {
  if [[ -f $JARS/.complete && $(cat "$JARS/.complete") == "$(pom_hash)" ]]; then return 0; fi
  ensure_java_maven
  log "resolving Apache Kafka $KAFKA_VERSION jars from Maven Central into $JARS (first run only)"
  local tmp=$JARS.partial
  rm -rf "$tmp"
  mkdir -p "$tmp"
  # shellcheck disable=SC2086  # NEARDUP_MVN_ARGS is a list of extra arguments
  mvn -q -B -f "$POM" ${NEARDUP_MVN_ARGS:-} dependency:copy-dependencies \
    -DoutputDirectory="$tmp" -DincludeScope=runtime >"$CACHE/mvn-kafka.log" 2>&1 ||
    die "maven could not resolve the Kafka jars:
$(tail -n 40 "$CACHE/mvn-kafka.log")"
  local jar
  for jar in kafka_2.13 kafka-server kafka-metadata kafka-raft kafka-storage kafka-group-coordinator \
    kafka-transaction-coordinator kafka-clients scala-library jackson-databind reload4j slf4j-reload4j; do
    compgen -G "$tmp/$jar-[0-9]*.jar" >/dev/null || die "resolved jars lack $jar (check $POM)"
  done
  pom_hash >"$tmp/.complete"
  rm -rf "$JARS"
  mv "$tmp" "$JARS"
  log "$(find "$JARS" -name '*.jar' | wc -l) jars in $JARS"
}

write_kafka_config() {
  local data=$KAFKA_DIR/data
  cat >"$KAFKA_DIR/server.properties" <<EOF
# Generated by docker/services.sh: one combined KRaft broker+controller on loopback.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$KAFKA_CONTROLLER_PORT
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,SASL_PLAINTEXT://$HOST:$KAFKA_SASL_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT,SASL_PLAINTEXT://$HOST:$KAFKA_SASL_PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
sasl.enabled.mechanisms=PLAIN
listener.name.sasl_plaintext.sasl.enabled.mechanisms=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="$KAFKA_SASL_USER" password="$KAFKA_SASL_PASSWORD" user_$KAFKA_SASL_USER="$KAFKA_SASL_PASSWORD";
log.dirs=$data
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
group.initial.rebalance.delay.ms=0
# 16 MiB records (the largest the worker accepts) plus headers: the worker passes values through.
message.max.bytes=17825792
log.flush.interval.messages=10000000
num.network.threads=2
num.io.threads=4
EOF
  cat >"$KAFKA_DIR/log4j.properties" <<'EOF'
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka=INFO
log4j.logger.org.apache.kafka=INFO
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.kafka.log.LogCleaner=WARN
log4j.logger.org.apache.kafka.storage.internals.log=WARN
log4j.logger.kafka.log=WARN
EOF
}

kafka_ready() {
  port_open "$KAFKA_PORT" && port_open "$KAFKA_SASL_PORT" &&
    grep -q 'Kafka Server started' "$KAFKA_DIR/kafka.log" 2>/dev/null
}

wait_kafka() {
  local pid deadline=$((SECONDS + KAFKA_START_TIMEOUT))
  pid=$(pid_of "$KAFKA_DIR/kafka.pid")
  while ((SECONDS < deadline)); do
    if kafka_ready; then
      log "kafka up: PLAINTEXT $HOST:$KAFKA_PORT, SASL_PLAINTEXT $HOST:$KAFKA_SASL_PORT (pid $pid)"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      die "kafka exited during startup; log tail ($KAFKA_DIR/kafka.log):
$(tail -n 40 "$KAFKA_DIR/kafka.log" 2>/dev/null)"
    fi
    sleep 0.25
  done
  die "kafka not ready after ${KAFKA_START_TIMEOUT}s; log tail ($KAFKA_DIR/kafka.log):
$(tail -n 40 "$KAFKA_DIR/kafka.log" 2>/dev/null)"
}

start_kafka() {
  mkdir -p "$STATE"
  if pid_alive "$KAFKA_DIR/kafka.pid"; then
    if kafka_ready; then
      log "kafka already running (pid $(pid_of "$KAFKA_DIR/kafka.pid"), port $KAFKA_PORT)"
      return 0
    fi
    log "kafka process exists but is not ready yet; waiting"
    wait_kafka
    return 0
  fi
  local p
  for p in "$KAFKA_PORT" "$KAFKA_SASL_PORT" "$KAFKA_CONTROLLER_PORT"; do
    port_open "$p" && die "port $p is already in use by a process not started from $STATE (set NEARDUP_KAFKA_*PORT)"
  done
  ensure_kafka_jars
  rm -rf "$KAFKA_DIR"
  mkdir -p "$KAFKA_DIR/data"
  write_kafka_config
  local -a jvm=(-Dlog4j.configuration="file:$KAFKA_DIR/log4j.properties" -Dkafka.logs.dir="$KAFKA_DIR"
    -Djava.awt.headless=true -Djava.net.preferIPv4Stack=true)
  local cluster_id
  # KRaft cluster id: 16 random bytes, URL-safe base64 without padding (what `random-uuid` prints). Like
  # Kafka's own, never one starting with "-": the storage tool would read it as an option (1 start in 64).
  cluster_id=-
  while [[ $cluster_id == -* ]]; do
    cluster_id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
  done
  java -Xmx256m -XX:TieredStopAtLevel=1 "${jvm[@]}" -cp "$JARS/*" kafka.tools.StorageTool format \
    -t "$cluster_id" -c "$KAFKA_DIR/server.properties" >"$KAFKA_DIR/format.log" 2>&1 ||
    die "kafka storage format failed:
$(tail -n 30 "$KAFKA_DIR/format.log")"
  launch_kafka
}

# Start the broker process on the formatted data in $KAFKA_DIR and wait until it serves.
launch_kafka() {
  local -a jvm=(-Dlog4j.configuration="file:$KAFKA_DIR/log4j.properties" -Dkafka.logs.dir="$KAFKA_DIR"
    -Djava.awt.headless=true -Djava.net.preferIPv4Stack=true)
  rm -f "$KAFKA_DIR/kafka.pid"
  # setsid: own session, so the broker outlives this script and the caller's process group.
  # shellcheck disable=SC2086  # KAFKA_HEAP is a list of JVM options
  setsid bash -c 'echo $$ >"$1"; shift; exec "$@"' _ "$KAFKA_DIR/kafka.pid" \
    java $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError "${jvm[@]}" \
    -cp "$JARS/*" kafka.Kafka "$KAFKA_DIR/server.properties" \
    </dev/null >"$KAFKA_DIR/kafka.log" 2>&1 &
  local i
  for ((i = 0; i < 50; i++)); do [[ -s $KAFKA_DIR/kafka.pid ]] && break; sleep 0.1; done
  wait_kafka
}

# An outage for fault-injection tests: stop the broker (SIGTERM, controlled shutdown) and start it again
# on the same data, so topics, records and committed offsets survive.
restart_kafka() {
  pid_alive "$KAFKA_DIR/kafka.pid" || die "kafka is not running (start it with: $0 start kafka)"
  kill_pidfile "$KAFKA_DIR/kafka.pid" 30
  log "kafka stopped for a restart"
  write_kafka_config
  launch_kafka
}

# A hung broker for fault-injection tests: the process stopped (SIGSTOP) for $1 seconds, then continued.
freeze_kafka() {
  local seconds=$1 pid
  [[ $seconds =~ ^[0-9]+([.][0-9]+)?$ ]] || die "freeze kafka SECONDS: not a number of seconds: $seconds"
  pid_alive "$KAFKA_DIR/kafka.pid" || die "kafka is not running (start it with: $0 start kafka)"
  pid=$(pid_of "$KAFKA_DIR/kafka.pid")
  kill -STOP "$pid"
  log "kafka frozen (pid $pid) for ${seconds}s"
  sleep "$seconds"
  kill -CONT "$pid"
  log "kafka thawed"
}

stop_kafka() {
  if pid_alive "$KAFKA_DIR/kafka.pid"; then
    kill_pidfile "$KAFKA_DIR/kafka.pid" 30
    log "kafka stopped"
  fi
  rm -f "$KAFKA_DIR/kafka.pid"
  rm -rf "$KAFKA_DIR/data"
}

# --- status / env -----------------------------------------------------------------------------------

status_line() { # NAME PIDFILE ADDRESS
  if pid_alive "$2"; then
    printf '%-14s running  pid %-7s %s\n' "$1" "$(pid_of "$2")" "$3"
  else
    printf '%-14s stopped\n' "$1"
  fi
}

status() {
  local what=$1 port
  if [[ $what == all || $what == redis ]]; then
    status_line redis "$STATE/redis-plain/redis.pid" "redis://$HOST:$REDIS_PORT"
    status_line redis-auth "$STATE/redis-auth/redis.pid" "redis://:***@$HOST:$REDIS_AUTH_PORT"
    if [[ -f $STATE/redis-tls.unavailable ]]; then
      printf '%-14s unavailable (%s)\n' redis-tls "$(cat "$STATE/redis-tls.unavailable")"
    else
      status_line redis-tls "$STATE/redis-tls/redis.pid" "rediss://$HOST:$REDIS_TLS_PORT"
    fi
  fi
  local name
  for name in "${CLUSTERS[@]}"; do
    if [[ $what == all || $what == clusters || $what == "$name" ]]; then
      cluster_spec "$name"
      for port in "${SPEC_PORTS[@]}"; do
        status_line "$name-$port" "$STATE/redis-cluster-$port/redis.pid" "redis://$HOST:$port"
      done
    fi
  done
  if [[ $what == all || $what == kafka ]]; then
    status_line kafka "$KAFKA_DIR/kafka.pid" "PLAINTEXT $HOST:$KAFKA_PORT SASL_PLAINTEXT $HOST:$KAFKA_SASL_PORT"
  fi
}

print_env() {
  local what=$1
  if [[ $what == all || $what == redis ]]; then
    pid_alive "$STATE/redis-plain/redis.pid" &&
      echo "export NEARDUP_TEST_REDIS_URL=redis://$HOST:$REDIS_PORT/0"
    pid_alive "$STATE/redis-auth/redis.pid" &&
      echo "export NEARDUP_TEST_REDIS_AUTH_URL=redis://:$(urlencode "$REDIS_PASSWORD")@$HOST:$REDIS_AUTH_PORT/0"
    pid_alive "$STATE/redis-tls/redis.pid" &&
      echo "export NEARDUP_TEST_REDIS_TLS_URL='rediss://$HOST:$REDIS_TLS_PORT/0?ssl_ca_certs=$(urlencode "$TLS_DIR/ca.crt")'"
  fi
  local i
  for i in "${!CLUSTERS[@]}"; do
    if [[ $what == all || $what == clusters || $what == "${CLUSTERS[i]}" ]] && cluster_running "${CLUSTERS[i]}"; then
      echo "export ${CLUSTER_ENV[i]}=redis://$HOST:${SPEC_PORTS[0]}/0"
    fi
  done
  if [[ $what == all || $what == kafka ]] && pid_alive "$KAFKA_DIR/kafka.pid"; then
    echo "export NEARDUP_TEST_KAFKA=$HOST:$KAFKA_PORT"
    echo "export NEARDUP_TEST_KAFKA_SASL=$HOST:$KAFKA_SASL_PORT"
    echo "export NEARDUP_TEST_KAFKA_SASL_USER=$KAFKA_SASL_USER"
    printf 'export NEARDUP_TEST_KAFKA_SASL_PASSWORD=%q\n' "$KAFKA_SASL_PASSWORD"
  fi
  return 0
}

# --- main -------------------------------------------------------------------------------------------

main() {
  local cmd=${1:-} what=${2:-all} name seconds=${3:-}
  [[ $what =~ ^(redis|kafka|cluster|cluster6|cluster-ha|clusters|all)$ ]] || usage
  case $cmd in
    start)
      case $what in
        redis) start_redis_all ;;
        kafka) start_kafka ;;
        cluster | cluster6 | cluster-ha) start_cluster "$what" ;;
        clusters) for name in "${CLUSTERS[@]}"; do start_cluster "$name"; done ;;
        all) start_redis_all; start_kafka ;;
      esac ;;
    stop)
      case $what in
        redis) stop_redis_all ;;
        kafka) stop_kafka ;;
        cluster | cluster6 | cluster-ha) stop_cluster "$what" ;;
        clusters) for name in "${CLUSTERS[@]}"; do stop_cluster "$name"; done ;;
        all) stop_kafka; stop_redis_all; for name in "${CLUSTERS[@]}"; do stop_cluster "$name"; done ;;
      esac ;;
    restart)
      [[ $what == kafka ]] || usage
      restart_kafka ;;
    freeze)
      [[ $what == kafka && -n $seconds ]] || usage
      freeze_kafka "$seconds" ;;
    status) status "$what" ;;
    env) print_env "$what" ;;
    *) usage ;;
  esac
}

main "$@"
