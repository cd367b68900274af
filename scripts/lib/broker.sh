# shellcheck shell=bash
# Private RabbitMQ nodes for development and tests (sourced by scripts/dev; needs common.sh).
#
# A node lives entirely in one folder (e.g. .run/test/rabbitmq) and is described by an env
# file (e.g. .run/test/broker.env) holding the RABBITMQ_* variables it was started with. The
# system's rabbitmq-server service, its data and any other broker are never touched.
#
# Notes on Debian's rabbitmq-server package:
# - /usr/sbin/rabbitmq-server, run as root, switches to user `rabbitmq` with `su` (no login
#   shell): the RABBITMQ_* variables pass through, but HOME becomes /var/lib/rabbitmq (so the
#   Erlang cookie is the system one) and the working directory becomes /var/lib/rabbitmq,
#   hence every path below is absolute and the folder belongs to user `rabbitmq`.
# - Without -detached the server script keeps a shell in front of the Erlang VM, and `su`,
#   erl_child_setup and inet_gethost each start a new session, so neither the launcher's pid
#   nor its session id lead to all of the node's processes. Instead the node is launched with
#   a private marker variable (IAP_BROKER_INSTANCE=<random token>) that every one of its
#   processes inherits and nothing else carries; it is stopped by sending SIGTERM to the
#   Erlang VM (graceful shutdown), SIGKILL only as a last resort.
# - epmd (the Erlang port mapper on 4369) is started on demand, detaches itself and is shared
#   by all nodes of the machine; it is left running.

BROKER_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BROKER_START_TIMEOUT=${IAP_BROKER_START_TIMEOUT:-60}
BROKER_STOP_TIMEOUT=${IAP_BROKER_STOP_TIMEOUT:-30}

# Load a node's env file into the current shell and check it is complete.
broker_load() {
    local env_file=$1 var
    [[ -f $env_file ]] || die "no broker env file at $env_file (start a node with 'scripts/dev test' or 'scripts/dev up')"
    # shellcheck disable=SC1090
    source "$env_file"
    for var in IAP_BROKER_DIR RABBITMQ_NODENAME RABBITMQ_NODE_PORT RABBITMQ_DIST_PORT \
               RABBITMQ_MNESIA_BASE RABBITMQ_LOG_BASE RABBITMQ_PID_FILE; do
        [[ -n ${!var:-} ]] || die "$env_file does not set $var"
    done
}

# Write the env file of a node named <prefix>-<port>@localhost living in <dir>.
# Ports already named in an existing env file are reused when they are still free.
broker_configure() {
    local prefix=$1 dir=$2 env_file=$3 old_ports=() ports
    if [[ -f $env_file ]]; then
        # shellcheck disable=SC1090
        mapfile -t old_ports < <(source "$env_file"; echo "${RABBITMQ_NODE_PORT:-}"; echo "${RABBITMQ_DIST_PORT:-}")
    fi
    mapfile -t ports < <(python3 "$BROKER_LIB_DIR/net.py" free-ports 2 "${old_ports[@]}")
    ((${#ports[@]} == 2)) || die "could not find two free TCP ports"
    mkdir -p "$(dirname "$env_file")"
    {
        echo "# Private RabbitMQ node started by scripts/dev; read by 'scripts/dev broker'."
        printf 'export IAP_BROKER_DIR=%q\n' "$dir"
        printf 'export IAP_BROKER_AMQP_URL=%q\n' "amqp://guest:guest@127.0.0.1:${ports[0]}/"
        printf 'export RABBITMQ_NODENAME=%q\n' "$prefix-${ports[0]}@localhost"
        printf 'export RABBITMQ_NODE_IP_ADDRESS=%q\n' "127.0.0.1"
        printf 'export RABBITMQ_NODE_PORT=%q\n' "${ports[0]}"
        printf 'export RABBITMQ_DIST_PORT=%q\n' "${ports[1]}"
        printf 'export RABBITMQ_MNESIA_BASE=%q\n' "$dir/mnesia"
        printf 'export RABBITMQ_LOG_BASE=%q\n' "$dir/log"
        printf 'export RABBITMQ_PID_FILE=%q\n' "$dir/rabbitmq.pid"
        printf 'export RABBITMQ_CONFIG_FILE=%q\n' "$dir/rabbitmq.conf"
        printf 'export RABBITMQ_ADVANCED_CONFIG_FILE=%q\n' "$dir/advanced.config"
        printf 'export RABBITMQ_ENABLED_PLUGINS_FILE=%q\n' "$dir/enabled_plugins"
        printf 'export RABBITMQ_CONF_ENV_FILE=%q\n' "$dir/rabbitmq-env.conf"
    } >"$env_file"
}

# Process ids of the loaded node: the processes whose environment holds the marker it was
# launched with (recorded in $IAP_BROKER_DIR/instance).
broker_pids() {
    local token
    token=$(cat "$IAP_BROKER_DIR/instance" 2>/dev/null) || return 0
    [[ -n $token ]] || return 0
    local pid
    # epmd is shared by every node of the machine: when this node happened to start it, it
    # carries the marker too, but it is never this node's to stop.
    for pid in $(grep -lzxF "IAP_BROKER_INSTANCE=$token" /proc/[0-9]*/environ 2>/dev/null |
        sed -n 's|^/proc/\([0-9]*\)/environ$|\1|p'); do
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == epmd ]] || echo "$pid"
    done
}

broker_running() { [[ -n $(broker_pids) ]]; }

# True when the node answers the AMQP handshake on its port.
broker_answers() { python3 "$BROKER_LIB_DIR/net.py" amqp-ready "${RABBITMQ_NODE_IP_ADDRESS:-127.0.0.1}" "$RABBITMQ_NODE_PORT"; }

# Print the end of the node's logs (used when something goes wrong).
broker_log_tail() {
    local f
    for f in "$RABBITMQ_LOG_BASE/console.log" "$RABBITMQ_LOG_BASE/$RABBITMQ_NODENAME.log"; do
        [[ -s $f ]] || continue
        echo "---- last lines of $f ----" >&2
        tail -n 40 "$f" >&2
    done
}

# Create the node's folder and its private config files, owned by user `rabbitmq`.
_broker_prepare() {
    getent passwd rabbitmq >/dev/null || die "user 'rabbitmq' is missing (is rabbitmq-server installed?)"
    mkdir -p "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
    # Private config: nothing is read from /etc/rabbitmq.
    cat >"$RABBITMQ_CONFIG_FILE" <<'CONF'
# Private development/test node started by scripts/dev (listener set via RABBITMQ_NODE_*).
log.file.level = info
log.console = false
CONF
    # Lines a cluster adds for its nodes (partition handling, a listener off loopback).
    [[ -z ${IAP_BROKER_EXTRA_CONF:-} ]] || printf '%s\n' "$IAP_BROKER_EXTRA_CONF" >>"$RABBITMQ_CONFIG_FILE"
    echo '[].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"
    echo '# intentionally empty: keeps /etc/rabbitmq/rabbitmq-env.conf out' >"$RABBITMQ_CONF_ENV_FILE"
    chown -R rabbitmq:rabbitmq "$IAP_BROKER_DIR"
    runuser -u rabbitmq -- test -w "$RABBITMQ_MNESIA_BASE" ||
        die "user 'rabbitmq' cannot write $RABBITMQ_MNESIA_BASE: every parent folder must be traversable by it"
}

# Start the loaded node unless it runs already; keeps its data. Waits until AMQP answers.
broker_start() {
    local t0 deadline
    t0=$(now_ms)
    if broker_running; then
        say "RabbitMQ node $RABBITMQ_NODENAME is already running"
    else
        say "starting RabbitMQ node $RABBITMQ_NODENAME on ${RABBITMQ_NODE_IP_ADDRESS:-127.0.0.1}:$RABBITMQ_NODE_PORT"
        _broker_prepare
        rm -f "$RABBITMQ_PID_FILE"
        local token
        token="$(date +%s%N)-$$-$RANDOM$RANDOM"
        echo "$token" >"$IAP_BROKER_DIR/instance"
        # setsid keeps the node away from the caller's terminal (Ctrl-C); the marker variable
        # lets broker_pids find its processes. Every inherited descriptor above 2 is closed
        # first (the lock of 'scripts/dev test', a caller's pipes): a node holding a caller's
        # pipe would keep that caller waiting for end-of-file long after this script exited.
        (
            for fd in /proc/$BASHPID/fd/*; do
                fd=${fd##*/}
                if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
            done
            # A node of a partition drill lives in a network namespace of its own.
            IAP_BROKER_INSTANCE=$token exec ${IAP_BROKER_NETNS:+ip netns exec "$IAP_BROKER_NETNS"} \
                setsid /usr/sbin/rabbitmq-server </dev/null >>"$RABBITMQ_LOG_BASE/console.log" 2>&1
        ) &
        deadline=$((SECONDS + 5))
        until broker_running; do
            ((SECONDS < deadline)) || die "the RabbitMQ launcher did not start"
            sleep 0.05
        done
    fi
    deadline=$((SECONDS + BROKER_START_TIMEOUT))
    until broker_answers; do
        if ! broker_running; then
            broker_log_tail
            die "RabbitMQ node $RABBITMQ_NODENAME exited during startup (logs in $RABBITMQ_LOG_BASE)"
        fi
        if ((SECONDS >= deadline)); then
            broker_log_tail
            ( broker_stop ) || true
            die "RabbitMQ node $RABBITMQ_NODENAME did not accept AMQP connections within ${BROKER_START_TIMEOUT}s"
        fi
        sleep 0.25
    done
    say "RabbitMQ node $RABBITMQ_NODENAME accepts AMQP on port $RABBITMQ_NODE_PORT ($(( $(now_ms) - t0 ))ms)"
}

# Stop the loaded node: SIGTERM to its Erlang VM (graceful), SIGKILL after the timeout.
broker_stop() {
    local t0 pids beam deadline
    t0=$(now_ms)
    pids=$(broker_pids)
    if [[ -z $pids ]]; then
        say "RabbitMQ node $RABBITMQ_NODENAME is not running"
        return 0
    fi
    beam=$(cat "$RABBITMQ_PID_FILE" 2>/dev/null || true)
    if [[ -n $beam ]] && grep -qxF "$beam" <<<"$pids"; then
        kill -TERM "$beam" 2>/dev/null || true
    else
        # Still booting (no pid file yet): signal all of its processes.
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
    fi
    deadline=$((SECONDS + BROKER_STOP_TIMEOUT))
    while pids=$(broker_pids) && [[ -n $pids ]]; do
        if ((SECONDS >= deadline)); then
            say "RabbitMQ node $RABBITMQ_NODENAME ignored SIGTERM for ${BROKER_STOP_TIMEOUT}s; killing it"
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
            sleep 0.5
            [[ -z $(broker_pids) ]] || die "could not stop RabbitMQ node $RABBITMQ_NODENAME (pids: $pids)"
            break
        fi
        sleep 0.1
    done
    say "RabbitMQ node $RABBITMQ_NODENAME stopped ($(( $(now_ms) - t0 ))ms)"
}

# Print the state of the loaded node; exit status 0 only when it answers AMQP.
broker_status() {
    local pids
    pids=$(broker_pids)
    if [[ -z $pids ]]; then
        echo "$RABBITMQ_NODENAME: stopped"
        return 1
    elif broker_answers; then
        echo "$RABBITMQ_NODENAME: running, AMQP on ${RABBITMQ_NODE_IP_ADDRESS:-127.0.0.1}:$RABBITMQ_NODE_PORT (pids ${pids//$'\n'/ })"
    else
        echo "$RABBITMQ_NODENAME: processes alive but AMQP not answering on port $RABBITMQ_NODE_PORT (pids ${pids//$'\n'/ })"
        return 1
    fi
}

# Start a brand-new node in <dir>: stop whatever an earlier run left behind (crash, Ctrl-C),
# wipe its data and logs, pick ports, write <env_file>, start and load it.
broker_fresh_start() {
    local prefix=$1 dir=$2 env_file=$3
    [[ $dir == */.run/* ]] || die "refusing to wipe $dir (not under a .run folder)"
    if [[ -f $env_file ]]; then
        ( broker_load "$env_file"; broker_stop ) || die "could not stop the node left by an earlier run ($env_file)"
    fi
    rm -rf "$dir/mnesia" "$dir/log" "$dir/rabbitmq.pid" "$dir/instance"
    broker_configure "$prefix" "$dir" "$env_file"
    broker_load "$env_file"
    broker_start
}

# ---------------------------------------------------------------------------------------------
# A private three-node cluster (failover and quorum queue tests).
#
# A cluster is described by one env file (e.g. .run/test/cluster.env) naming the env files of
# its nodes, their AMQP URLs (comma-separated, as IAP_AMQP_URL takes them) and its Erlang
# cookie. Each node is an ordinary private node as above (its own name, AMQP port, dist port
# and folder owned by user `rabbitmq`), started with the cluster's own cookie rather than the
# system one (-setcookie), so no other node of the machine can join it or be joined by it.
# Nodes 2 and 3 join node 1 with `rabbitmqctl join_cluster`.

CLUSTER_START_TIMEOUT=${IAP_CLUSTER_START_TIMEOUT:-120}
CLUSTER_SIZE=3

# Load a cluster's env file (IAP_CLUSTER_NODE_ENVS, IAP_CLUSTER_AMQP_URLS, IAP_CLUSTER_COOKIE).
cluster_load() {
    local env_file=$1 var
    [[ -f $env_file ]] || die "no cluster env file at $env_file (start one with 'scripts/dev test')"
    # shellcheck disable=SC1090
    source "$env_file"
    for var in IAP_CLUSTER_NODE_ENVS IAP_CLUSTER_AMQP_URLS IAP_CLUSTER_COOKIE; do
        [[ -n ${!var:-} ]] || die "$env_file does not set $var"
    done
}

# rabbitmqctl against one node of the loaded cluster, bounded in time. rabbitmqctl runs its
# Erlang VM in a session of its own (su), out of timeout's reach: on a timeout whatever still
# carries this call's marker variable is killed too, or it would hold the caller's pipes.
cluster_ctl() {
    local node=$1 token rc=0 pid
    shift
    token="ctl-$$-$RANDOM$RANDOM"
    IAP_CTL_INSTANCE=$token timeout 60 rabbitmqctl ${IAP_CLUSTER_LONGNAMES:+--longnames} \
        --erlang-cookie "$IAP_CLUSTER_COOKIE" -n "$node" "$@" </dev/null || rc=$?
    if ((rc == 124)); then
        for pid in $(grep -lzxF "IAP_CTL_INSTANCE=$token" /proc/[0-9]*/environ 2>/dev/null |
            sed -n 's|^/proc/\([0-9]*\)/environ$|\1|p'); do
            kill -KILL "$pid" 2>/dev/null || true
        done
    fi
    return "$rc"
}

# The env file of node <n> (1-based), or of the node whose AMQP port is <n>.
# shellcheck disable=SC1090 # the node env files
cluster_node_env() {
    local which=$1 i=0 env_file port
    for env_file in $IAP_CLUSTER_NODE_ENVS; do
        i=$((i + 1))
        port=$(source "$env_file"; echo "$RABBITMQ_NODE_PORT")
        if [[ $which == "$i" || $which == "$port" ]]; then
            echo "$env_file"
            return 0
        fi
    done
    die "the cluster has no node $which (give 1-$CLUSTER_SIZE or an AMQP port)"
}

# Node names of the loaded cluster, in order.
# shellcheck disable=SC1090 # the node env files
cluster_node_names() {
    local env_file
    for env_file in $IAP_CLUSTER_NODE_ENVS; do
        (source "$env_file"; echo "$RABBITMQ_NODENAME")
    done
}

# Stop every node of the loaded cluster (in parallel; each as broker_stop does).
cluster_stop() {
    local env_file pids=() rc=0 pid
    for env_file in $IAP_CLUSTER_NODE_ENVS; do
        [[ -f $env_file ]] || continue
        ( broker_load "$env_file"; broker_stop ) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    # A node's namespace goes with the cluster, and whatever still runs in it (its epmd).
    if [[ -n ${IAP_CLUSTER_NETNS:-} ]] && ip netns list | grep -qw "$IAP_CLUSTER_NETNS"; then
        # shellcheck disable=SC2046
        kill -KILL $(ip netns pids "$IAP_CLUSTER_NETNS") 2>/dev/null || true
        ip netns delete "$IAP_CLUSTER_NETNS" || rc=1
    fi
    return "$rc"
}

# Make a network namespace and a veth link to it on a free /30 of 10.231.0.0/16; prints
# "<namespace> <host end> <host address> <namespace address>". The link's host end is what
# cluster_partition takes down; deleting the namespace removes both ends.
cluster_make_link() {
    local tag third fourth netns host_end ns_end
    tag=$(python3 -c 'import secrets; print(secrets.token_hex(3))')
    netns=iap-$tag host_end=iaph$tag ns_end=iapn$tag
    for _ in $(seq 1 50); do
        third=$((RANDOM % 256)) fourth=$((RANDOM % 64 * 4))
        ip -o -4 addr show | grep -qF " 10.231.$third.$((fourth + 1))/" || break
    done
    {
        ip netns add "$netns" &&
        ip link add "$host_end" type veth peer name "$ns_end" netns "$netns" &&
        ip addr add "10.231.$third.$((fourth + 1))/30" dev "$host_end" &&
        ip link set "$host_end" up &&
        ip -n "$netns" addr add "10.231.$third.$((fourth + 2))/30" dev "$ns_end" &&
        ip -n "$netns" link set "$ns_end" up &&
        ip -n "$netns" link set lo up
    } >&2 || { ip netns delete "$netns" 2>/dev/null; return 1; }
    echo "$netns $host_end 10.231.$third.$((fourth + 1)) 10.231.$third.$((fourth + 2))"
}

# Take node 3's link (a cluster started with netns) down or up: down cuts it off from the
# other two nodes and from every client at once, as a failed switch port would.
cluster_partition() {
    local state=$1
    [[ $state == down || $state == up ]] || die "usage: scripts/dev cluster partition down|up"
    [[ -n ${IAP_CLUSTER_LINK:-} ]] || die "this cluster has no node in a namespace of its own (start it with netns)"
    ip link set "$IAP_CLUSTER_LINK" "$state"
    say "link $IAP_CLUSTER_LINK of node $CLUSTER_SIZE $state"
}

# kill -9 the Erlang VM of one node (a crash, for failover tests); waits until its processes are gone.
cluster_kill_node() {
    local env_file deadline pids beam
    env_file=$(cluster_node_env "$1")
    (
        broker_load "$env_file"
        beam=$(cat "$RABBITMQ_PID_FILE" 2>/dev/null || true)
        pids=$(broker_pids)
        [[ -n $pids ]] || { say "RabbitMQ node $RABBITMQ_NODENAME is not running"; exit 0; }
        if [[ -n $beam ]] && grep -qxF "$beam" <<<"$pids"; then
            kill -KILL "$beam"
        else
            # shellcheck disable=SC2086
            kill -KILL $pids
        fi
        deadline=$((SECONDS + 10))
        while pids=$(broker_pids) && [[ -n $pids ]]; do
            # The launcher's shells and helpers end with the VM; whatever lingers goes too.
            if ((SECONDS >= deadline)); then
                # shellcheck disable=SC2086
                kill -KILL $pids 2>/dev/null || true
            fi
            sleep 0.1
        done
        say "RabbitMQ node $RABBITMQ_NODENAME killed (kill -9)"
    )
}

# Start one stopped node again with its data; it rejoins the cluster by itself.
cluster_start_node() {
    local env_file
    env_file=$(cluster_node_env "$1")
    # As long as a cluster's start: a node that rejoins syncs its tables and recovers its queues'
    # members, which on a loaded machine takes well over a lone node's minute.
    ( BROKER_START_TIMEOUT=$CLUSTER_START_TIMEOUT; broker_load "$env_file"; broker_start )
}

# How many client connections node <n> (1-based, or its AMQP port) holds: established TCP
# connections to its AMQP port, counted in the node's own network namespace. (Not through
# rabbitmqctl list_connections: its answers come back over connections the nodes open to the
# CLI's own node, by a host name a node in another namespace cannot reach.)
# shellcheck disable=SC1090 # the node env files
cluster_connections() {
    local port netns
    read -r port netns < <(source "$(cluster_node_env "$1")"; echo "$RABBITMQ_NODE_PORT ${IAP_BROKER_NETNS:-}")
    ${netns:+ip netns exec "$netns"} ss -Htn state established "( sport = :$port )" | grep -c . || true
}

# Print each node's state and the cluster's running nodes; exit 0 only when all run clustered.
cluster_status() {
    local env_file rc=0 nodes running
    for env_file in $IAP_CLUSTER_NODE_ENVS; do
        ( broker_load "$env_file"; broker_status ) || rc=1
    done
    # Asked of the first node that answers (not `| head -n 1`: under pipefail the writer's
    # SIGPIPE would end the script).
    mapfile -t nodes < <(cluster_node_names)
    local node asked=
    for node in "${nodes[@]}"; do
        if running=$(cluster_running_nodes "$node"); then asked=$node; break; fi
    done
    if [[ -z $asked ]]; then
        echo "no node of the cluster answers rabbitmqctl"
        return 1
    fi
    echo "running cluster members seen by $asked: ${running//$'\n'/ }"
    (( $(grep -c . <<<"$running") == CLUSTER_SIZE )) || rc=1
    return "$rc"
}

# The running members of the cluster as <node> sees them, one a line.
cluster_running_nodes() {
    cluster_ctl "$1" cluster_status --formatter json 2>/dev/null |
        python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin).get("running_nodes", [])))' 2>/dev/null | grep .
}

# Start a brand-new cluster of three nodes under <base_dir>: stop whatever an earlier run left
# behind, wipe the nodes' data, pick ports and a cookie, write <cluster_env> (node env files
# beside it, in <cluster_env without .env>/), start the nodes in parallel, join nodes 2 and 3
# to node 1 and wait until all three run clustered. Bounded by CLUSTER_START_TIMEOUT seconds.
#
# With <isolated> = netns, node 3 runs in a network namespace of its own, joined to the
# machine by one veth link (see cluster_partition): nodes 1 and 2 are named by the host end's
# address, node 3 by its own end's and listens for AMQP there. Every node then runs with
# pause_minority and a 10 s net_ticktime, so a node cut off stops serving within seconds and
# comes back by itself when the link does.
# shellcheck disable=SC1090 # the node env files
cluster_fresh_start() {
    local prefix=$1 base=$2 cluster_env=$3 isolated=${4:-} t0 deadline i env_file envs=() urls=() ports attempt
    local node_env_dir=${cluster_env%.env} pids=() pid nodes node cookie netns= link= host_ip= ns_ip= port
    t0=$(now_ms)
    [[ $base == */.run/* ]] || die "refusing to wipe $base (not under a .run folder)"
    if [[ -f $cluster_env ]]; then
        ( cluster_load "$cluster_env"; cluster_stop ) || die "could not stop the cluster left by an earlier run ($cluster_env)"
    fi
    rm -rf "$base"
    mkdir -p "$node_env_dir"
    cookie=$(python3 -c 'import secrets; print(secrets.token_hex(20).upper())')
    if [[ $isolated == netns ]]; then
        read -r netns link host_ip ns_ip < <(cluster_make_link) || die "could not make the network namespace of node 3"
    fi
    # Each node picks its own free ports; pick again in the unlikely case two nodes drew one port.
    for attempt in 1 2 3 4 5; do
        envs=() urls=() ports=()
        for i in $(seq 1 "$CLUSTER_SIZE"); do
            env_file=$node_env_dir/n$i.env
            rm -f "$env_file"
            broker_configure "$prefix" "$base/n$i" "$env_file"
            printf 'export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=%q\n' "-setcookie $cookie" >>"$env_file"
            if [[ -n $netns ]]; then
                # Later lines of an env file win over broker_configure's.
                port=$(source "$env_file"; echo "$RABBITMQ_NODE_PORT")
                {
                    echo "export RABBITMQ_USE_LONGNAME=true"
                    printf 'export IAP_BROKER_EXTRA_CONF=%q\n' "$(printf '%s\n' \
                        'cluster_partition_handling = pause_minority' 'net_ticktime = 10' 'loopback_users = none')"
                    if ((i == CLUSTER_SIZE)); then
                        printf 'export IAP_BROKER_NETNS=%q\n' "$netns"
                        printf 'export RABBITMQ_NODENAME=%q\n' "$prefix-$port@$ns_ip"
                        printf 'export RABBITMQ_NODE_IP_ADDRESS=%q\n' "$ns_ip"
                        printf 'export IAP_BROKER_AMQP_URL=%q\n' "amqp://guest:guest@$ns_ip:$port/"
                    else
                        printf 'export RABBITMQ_NODENAME=%q\n' "$prefix-$port@$host_ip"
                    fi
                } >>"$env_file"
            fi
            envs+=("$env_file")
            urls+=("$(source "$env_file"; echo "$IAP_BROKER_AMQP_URL")")
            mapfile -t -O "${#ports[@]}" ports < <(source "$env_file"; echo "$RABBITMQ_NODE_PORT"; echo "$RABBITMQ_DIST_PORT")
        done
        (( $(printf '%s\n' "${ports[@]}" | sort -u | wc -l) == 2 * CLUSTER_SIZE )) && break
        ((attempt < 5)) || die "could not pick distinct ports for the cluster"
    done
    (
        umask 077
        {
            echo "# Private three-node RabbitMQ cluster started by scripts/dev; read by 'scripts/dev cluster'."
            printf 'export IAP_CLUSTER_NODE_ENVS=%q\n' "${envs[*]}"
            printf 'export IAP_CLUSTER_AMQP_URLS=%q\n' "$(IFS=,; echo "${urls[*]}")"
            printf 'export IAP_CLUSTER_COOKIE=%q\n' "$cookie"
            if [[ -n $netns ]]; then
                echo "export IAP_CLUSTER_LONGNAMES=true"
                printf 'export IAP_CLUSTER_NETNS=%q\n' "$netns"
                printf 'export IAP_CLUSTER_LINK=%q\n' "$link"
            fi
        } >"$cluster_env"
    )
    cluster_load "$cluster_env"
    # Each node stops itself (broker_start) if it does not come up within the cluster's bound.
    for env_file in "${envs[@]}"; do
        ( BROKER_START_TIMEOUT=$CLUSTER_START_TIMEOUT; broker_load "$env_file"; broker_start ) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || { cluster_stop || true; die "a node of the cluster did not start (logs under $base)"; }
    done
    deadline=$((SECONDS + CLUSTER_START_TIMEOUT))
    mapfile -t nodes < <(cluster_node_names)
    local first=${nodes[0]}
    for node in "${nodes[@]:1}"; do
        say "joining $node to $first"
        if ! { cluster_ctl "$node" stop_app >/dev/null && cluster_ctl "$node" join_cluster "$first" >/dev/null &&
               cluster_ctl "$node" start_app >/dev/null; }; then
            cluster_stop || true
            die "could not join $node to $first (logs under $base)"
        fi
        ((SECONDS < deadline)) || { cluster_stop || true; die "the cluster did not form within ${CLUSTER_START_TIMEOUT}s"; }
    done
    until (( $(cluster_running_nodes "$first" | wc -l) == CLUSTER_SIZE )); do
        if ((SECONDS >= deadline)); then
            cluster_stop || true
            die "the cluster did not form within ${CLUSTER_START_TIMEOUT}s (logs under $base)"
        fi
        sleep 0.5
    done
    for env_file in "${envs[@]}"; do
        ( broker_load "$env_file"; broker_answers ) || { cluster_stop || true; die "a cluster node stopped answering AMQP"; }
    done
    say "RabbitMQ cluster of $CLUSTER_SIZE nodes ready: $IAP_CLUSTER_AMQP_URLS ($(( $(now_ms) - t0 ))ms)"
}
