# shellcheck shell=bash
# Small helpers shared by scripts/dev, scripts/lib/broker.sh and scripts/lib/postgres.sh
# (sourced, not executed).

# Print a progress line on stderr.
say() { printf '==> %s\n' "$*" >&2; }

# Print an error and exit non-zero.
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The servers and the apt installs need root: Debian's rabbitmq scripts only switch to
# user `rabbitmq` when started by root, PostgreSQL runs as user `postgres` through runuser,
# and their folders must be chowned to those users.
require_root() {
    [[ $EUID -eq 0 ]] || die "run this as root (e.g. sudo $0 $*)"
}

# Install the given Debian packages that are not installed yet (no recommends).
# `apt-get update` runs only when something is actually missing.
ensure_packages() {
    local pkg missing=()
    for pkg in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$pkg")
        fi
    done
    ((${#missing[@]} == 0)) && return 0
    say "installing missing packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
}

# Seconds since the epoch with millisecond precision, for timings.
now_ms() { date +%s%3N; }

# True when $1 is a live process id.
pid_alive() { [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null; }

# Wait up to $2 seconds for process $1 to exit; false if it is still alive.
wait_pid_exit() {
    local pid=$1 deadline=$((SECONDS + $2))
    while pid_alive "$pid"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}
