# shellcheck shell=bash
# Private PostgreSQL instances for development and tests (sourced by scripts/dev; needs common.sh).
#
# An instance lives entirely in one folder owned by user `postgres` (e.g. .run/test/postgres):
#   data/          the cluster (initdb), with iap.conf holding the listener settings below
#   socket/        its unix socket (never the system's /var/run/postgresql)
#   password       the password of the superuser role `iap` (mode 0600)
#   postgres.log   the server's log
# and is described by an env file (e.g. .run/test/postgres.env) naming the folder and the
# port. The server listens on 127.0.0.1 only; every connection, the unix socket included,
# needs the password (SCRAM-SHA-256), so the app connects over TCP as production would.
# The system's postgresql service, its clusters and any server these functions did not start
# are never touched: stopping goes through the postmaster.pid of the instance's own folder.
#
# Notes on Debian's postgresql package:
# - initdb and pg_ctl refuse to run as root: they run as user `postgres` (runuser), so the
#   folder, the log and the socket folder must belong to it (a log in a root-owned folder
#   makes pg_ctl fail).
# - The binaries are in /usr/lib/postgresql/<major>/bin (not on PATH); the newest installed
#   major is used, or $IAP_POSTGRES_BIN.

POSTGRES_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
POSTGRES_START_TIMEOUT=${IAP_POSTGRES_START_TIMEOUT:-60}
POSTGRES_STOP_TIMEOUT=${IAP_POSTGRES_STOP_TIMEOUT:-30}
# The superuser role the app connects as, and the database of the admin URL.
POSTGRES_USER=iap
POSTGRES_ADMIN_DB=postgres

# The folder of the PostgreSQL server binaries (initdb, pg_ctl, pg_isready).
postgres_bin() {
    if [[ -n ${IAP_POSTGRES_BIN:-} ]]; then
        echo "$IAP_POSTGRES_BIN"
        return 0
    fi
    local dir
    dir=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)
    [[ -n $dir && -x $dir/pg_ctl ]] || die "no PostgreSQL server in /usr/lib/postgresql/*/bin (is the postgresql package installed?)"
    echo "$dir"
}

# Load an instance's env file into the current shell and derive its paths.
postgres_load() {
    local env_file=$1 var
    [[ -f $env_file ]] || die "no PostgreSQL env file at $env_file (start one with 'scripts/dev test', 'scripts/dev up --postgres' or 'scripts/dev postgres start')"
    # shellcheck disable=SC1090
    source "$env_file"
    for var in IAP_POSTGRES_DIR IAP_POSTGRES_PORT; do
        [[ -n ${!var:-} ]] || die "$env_file does not set $var"
    done
    _postgres_paths "$IAP_POSTGRES_DIR"
    IAP_POSTGRES_ENV=$env_file
}

# The paths of an instance living in <dir>.
_postgres_paths() {
    IAP_POSTGRES_DIR=$1
    IAP_POSTGRES_DATA=$1/data
    IAP_POSTGRES_SOCKET_DIR=$1/socket
    IAP_POSTGRES_PASSWORD_FILE=$1/password
    IAP_POSTGRES_LOG=$1/postgres.log
}

# Write the env file of an instance living in <dir>; its port is reused when still free.
# [fsync]: on (default) or off (throw-away test instances: faster, safe unless the OS crashes).
postgres_configure() {
    local dir=$1 env_file=$2 fsync=${3:-on} old_port='' port
    if [[ -f $env_file ]]; then
        # shellcheck disable=SC1090
        old_port=$(source "$env_file"; echo "${IAP_POSTGRES_PORT:-}")
    fi
    port=$(python3 "$POSTGRES_LIB_DIR/net.py" free-ports 1 "$old_port") || die "could not find a free TCP port"
    [[ $port =~ ^[0-9]+$ ]] || die "could not find a free TCP port"
    mkdir -p "$(dirname "$env_file")"
    {
        echo "# Private PostgreSQL instance started by scripts/dev; read by 'scripts/dev postgres'."
        printf 'export IAP_POSTGRES_DIR=%q\n' "$dir"
        printf 'export IAP_POSTGRES_PORT=%q\n' "$port"
        printf 'export IAP_POSTGRES_FSYNC=%q\n' "$fsync"
    } >"$env_file"
}

# Run a command as user `postgres` from a folder it can enter (pg_ctl and initdb need one),
# with a clean environment: the server inherits none of the caller's variables (tokens, URLs).
_postgres_as() {
    (cd "$IAP_POSTGRES_DIR" && runuser -u postgres -- env -i PATH=/usr/bin:/bin LANG=C.UTF-8 "$@")
}

# The password of role `iap` in the loaded instance.
postgres_password() {
    [[ -s $IAP_POSTGRES_PASSWORD_FILE ]] || die "no password file at $IAP_POSTGRES_PASSWORD_FILE"
    cat "$IAP_POSTGRES_PASSWORD_FILE"
}

# The URL of database <db> in the loaded instance (postgres: the admin URL).
postgres_url() {
    local db=$1
    printf 'postgres://%s:%s@127.0.0.1:%s/%s\n' "$POSTGRES_USER" "$(postgres_password)" "$IAP_POSTGRES_PORT" "$db"
}

# psql (of the same major as the server) with the given arguments; no ~/.psqlrc.
postgres_psql() {
    "$(postgres_bin)/psql" -X "$@"
}

# Pid of the loaded instance's postmaster, when one runs from its data folder.
postgres_pid() {
    local pid
    pid=$(head -n 1 "$IAP_POSTGRES_DATA/postmaster.pid" 2>/dev/null) || return 0
    [[ $pid =~ ^[0-9]+$ ]] && pid_alive "$pid" || return 0
    # Guard against a stale pid file whose pid was recycled: it must be the postmaster of
    # this very data folder (pg_ctl starts it as `postgres -D <data>`).
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- " -D $IAP_POSTGRES_DATA " && echo "$pid"
    return 0
}

postgres_running() { [[ -n $(postgres_pid) ]]; }

# Print the end of the server's log (used when something goes wrong).
postgres_log_tail() {
    [[ -s $IAP_POSTGRES_LOG ]] || return 0
    echo "---- last lines of $IAP_POSTGRES_LOG ----" >&2
    tail -n 40 "$IAP_POSTGRES_LOG" >&2
}

# Create the folder, a password and the cluster (once), owned by user `postgres`.
_postgres_prepare() {
    local bin=$1
    getent passwd postgres >/dev/null || die "user 'postgres' is missing (is the postgresql package installed?)"
    mkdir -p "$IAP_POSTGRES_DIR"
    chown postgres:postgres "$IAP_POSTGRES_DIR"
    chmod 0700 "$IAP_POSTGRES_DIR"
    runuser -u postgres -- test -w "$IAP_POSTGRES_DIR" ||
        die "user 'postgres' cannot write $IAP_POSTGRES_DIR: every parent folder must be traversable by it"
    install -d -o postgres -g postgres -m 0700 "$IAP_POSTGRES_SOCKET_DIR"
    if [[ ! -s $IAP_POSTGRES_DATA/PG_VERSION ]]; then
        say "initdb $IAP_POSTGRES_DATA (role $POSTGRES_USER, scram-sha-256)"
        rm -rf "$IAP_POSTGRES_DATA"
        if [[ ! -s $IAP_POSTGRES_PASSWORD_FILE ]]; then
            (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(24))' >"$IAP_POSTGRES_PASSWORD_FILE")
        fi
        chown postgres:postgres "$IAP_POSTGRES_PASSWORD_FILE"
        chmod 0600 "$IAP_POSTGRES_PASSWORD_FILE"
        _postgres_as "$bin/initdb" -D "$IAP_POSTGRES_DATA" -U "$POSTGRES_USER" \
            --pwfile="$IAP_POSTGRES_PASSWORD_FILE" --auth=scram-sha-256 \
            --encoding=UTF8 --locale=C --no-sync >>"$IAP_POSTGRES_DIR/initdb.log" 2>&1 || {
            tail -n 20 "$IAP_POSTGRES_DIR/initdb.log" >&2
            die "initdb failed (log: $IAP_POSTGRES_DIR/initdb.log)"
        }
        echo "include_if_exists = 'iap.conf'   # written by scripts/dev at every start" \
            >>"$IAP_POSTGRES_DATA/postgresql.conf"
    fi
    [[ -s $IAP_POSTGRES_PASSWORD_FILE ]] || die "$IAP_POSTGRES_DATA exists but its password file is missing"
    # The listener follows the env file (the port may change between starts). Settings in a
    # file rather than on pg_ctl's command line: no shell quoting of paths.
    local sock=${IAP_POSTGRES_SOCKET_DIR//\'/\'\'}
    cat >"$IAP_POSTGRES_DATA/iap.conf" <<CONF
# Private instance started by scripts/dev (rewritten at every start from $IAP_POSTGRES_ENV).
listen_addresses = '127.0.0.1'
port = $IAP_POSTGRES_PORT
unix_socket_directories = '$sock'
max_connections = 200
fsync = ${IAP_POSTGRES_FSYNC:-on}
CONF
    chown postgres:postgres "$IAP_POSTGRES_DATA/iap.conf"
    touch "$IAP_POSTGRES_LOG"
    chown postgres:postgres "$IAP_POSTGRES_LOG"
    chmod 0600 "$IAP_POSTGRES_LOG"
}

# Wait at most <seconds> until role `iap` can log in over TCP.
postgres_wait_ready() {
    local timeout=$1 deadline url
    deadline=$((SECONDS + timeout))
    url=$(postgres_url "$POSTGRES_ADMIN_DB")
    until PGCONNECT_TIMEOUT=2 postgres_psql "$url" -qAtc 'select 1' >/dev/null 2>&1; do
        if ! postgres_running; then
            postgres_log_tail
            die "PostgreSQL ($IAP_POSTGRES_DIR) is not running"
        fi
        if ((SECONDS >= deadline)); then
            postgres_log_tail
            die "PostgreSQL on 127.0.0.1:$IAP_POSTGRES_PORT did not accept a login within ${timeout}s"
        fi
        sleep 0.2
    done
}

# Start the loaded instance unless it runs already (initdb first if the folder is new);
# keeps its data. Waits until a password login over TCP works.
postgres_start() {
    local t0 bin pid
    t0=$(now_ms)
    pid=$(postgres_pid)
    if [[ -n $pid ]]; then
        say "PostgreSQL ($IAP_POSTGRES_DIR) is already running (pid $pid)"
    else
        bin=$(postgres_bin)
        _postgres_prepare "$bin"
        say "starting PostgreSQL $(basename "$(dirname "$bin")") on 127.0.0.1:$IAP_POSTGRES_PORT ($IAP_POSTGRES_DIR)"
        # Every inherited descriptor above 2 is closed first (the lock of 'scripts/dev test', a
        # caller's pipes): a server holding them would outlive this script with them.
        # pg_ctl puts the server in its own session (away from the terminal's Ctrl-C).
        (
            for fd in "/proc/$BASHPID/fd/"*; do
                fd=${fd##*/}
                if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
            done
            _postgres_as "$bin/pg_ctl" start -D "$IAP_POSTGRES_DATA" -l "$IAP_POSTGRES_LOG" \
                -w -t "$POSTGRES_START_TIMEOUT" </dev/null >/dev/null 2>&1
        ) || {
            postgres_log_tail
            ( postgres_stop ) || true
            die "PostgreSQL did not start (pg_ctl gives up after ${POSTGRES_START_TIMEOUT}s; log: $IAP_POSTGRES_LOG)"
        }
    fi
    postgres_wait_ready "$POSTGRES_START_TIMEOUT"
    say "PostgreSQL accepts logins on 127.0.0.1:$IAP_POSTGRES_PORT ($(( $(now_ms) - t0 ))ms)"
}

# Stop the loaded instance: fast shutdown (ends sessions), immediate after the timeout.
postgres_stop() {
    local t0 pid bin
    t0=$(now_ms)
    pid=$(postgres_pid)
    if [[ -z $pid ]]; then
        say "PostgreSQL ($IAP_POSTGRES_DIR) is not running"
        return 0
    fi
    bin=$(postgres_bin)
    if ! _postgres_as "$bin/pg_ctl" stop -D "$IAP_POSTGRES_DATA" -m fast -w -t "$POSTGRES_STOP_TIMEOUT" >/dev/null 2>&1; then
        say "PostgreSQL did not stop within ${POSTGRES_STOP_TIMEOUT}s; immediate shutdown"
        _postgres_as "$bin/pg_ctl" stop -D "$IAP_POSTGRES_DATA" -m immediate -w -t 10 >/dev/null 2>&1 || true
        if pid_alive "$pid"; then
            kill -KILL "$pid" 2>/dev/null || true
            wait_pid_exit "$pid" 5 || die "could not stop PostgreSQL (pid $pid)"
        fi
    fi
    say "PostgreSQL ($IAP_POSTGRES_DIR) stopped ($(( $(now_ms) - t0 ))ms)"
}

# Print the state of the loaded instance; exit status 0 only when a login works.
postgres_status() {
    local pid
    pid=$(postgres_pid)
    if [[ -z $pid ]]; then
        echo "PostgreSQL ($IAP_POSTGRES_DIR): stopped"
        return 1
    elif PGCONNECT_TIMEOUT=2 postgres_psql "$(postgres_url "$POSTGRES_ADMIN_DB")" -qAtc 'select 1' >/dev/null 2>&1; then
        echo "PostgreSQL ($IAP_POSTGRES_DIR): running on 127.0.0.1:$IAP_POSTGRES_PORT (pid $pid)"
    else
        echo "PostgreSQL ($IAP_POSTGRES_DIR): pid $pid alive but no login on port $IAP_POSTGRES_PORT"
        return 1
    fi
}

# Create database <db> in the loaded instance unless it exists.
postgres_ensure_database() {
    local db=$1 url
    [[ $db =~ ^[a-z_][a-z0-9_]*$ ]] || die "invalid database name: $db"
    url=$(postgres_url "$POSTGRES_ADMIN_DB")
    if [[ -z $(postgres_psql "$url" -qAtc "select 1 from pg_database where datname = '$db'") ]]; then
        postgres_psql "$url" -qAtc "create database $db" >/dev/null || die "could not create database $db"
    fi
}

# Start a brand-new instance in <dir>: stop whatever an earlier run left behind (crash,
# Ctrl-C), wipe its folder, pick a port, write <env_file>, start and load it.
postgres_fresh_start() {
    local dir=$1 env_file=$2 fsync=${3:-on}
    [[ $dir == */.run/* ]] || die "refusing to wipe $dir (not under a .run folder)"
    if [[ -f $env_file ]]; then
        ( postgres_load "$env_file"; postgres_stop ) || die "could not stop the PostgreSQL left by an earlier run ($env_file)"
    fi
    # Also one running from <dir> whose env file is gone: never wipe a live cluster.
    if [[ -f $dir/data/postmaster.pid ]]; then
        ( _postgres_paths "$dir"; postgres_stop ) || die "could not stop the PostgreSQL running from $dir"
    fi
    rm -rf "$dir"
    postgres_configure "$dir" "$env_file" "$fsync"
    postgres_load "$env_file"
    postgres_start
}
