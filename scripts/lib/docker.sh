# shellcheck shell=bash
# A private Docker engine for `scripts/dev compose` (sourced by scripts/dev; needs common.sh).
#
# Debian's docker.io is started by hand (there is no systemd, and policy-rc.d keeps the
# package's service from starting): its own socket, pid file and exec root in DOCKER_RUN (the
# checkout's .run/docker, or a folder under /var/tmp when that path is too long for the
# sockets containerd makes there), and its own data root in DOCKER_CACHE (default
# /var/cache/iap-pipeline/docker), which is kept per machine so that a second run, even from
# a new clone, reuses the base image, the stand-in images and the build cache. The system's
# dockerd, if any, is never touched. One private engine per machine at a time (a second one
# on the same data root is refused).
#
# Docker leaves its iptables chains, its bridges and net.ipv4.ip_forward=1 behind when it
# stops: the state before the start is recorded and restored after the stop (docker_net.py).

DOCKER_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Debian's client: another `docker` earlier in PATH may lack what BuildKit needs.
DOCKER_BIN=/usr/bin/docker
DOCKER_COMPOSE_BIN=/usr/bin/docker-compose
DOCKER_CACHE=${IAP_DOCKER_CACHE:-/var/cache/iap-pipeline}
DOCKER_PACKAGES=(docker.io docker-compose debootstrap iptables iproute2 python3 python3-yaml)
# The Debian mirror apt already uses, for debootstrap.
DOCKER_DEBIAN_MIRROR=${IAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# DOCKER_RUN: where this checkout's engine keeps its socket, pid file and exec root.
docker_paths() {
    local root=$1
    DOCKER_RUN=$root/.run/docker
    # containerd's sockets live under the exec root: unix socket paths end at 107 bytes.
    if ((${#DOCKER_RUN} > 40)); then
        DOCKER_RUN=/var/tmp/iap-pipeline-$(printf '%s' "$root" | md5sum | cut -c1-12)/docker
    fi
    DOCKER_SOCKET=$DOCKER_RUN/docker.sock
    DOCKER_PIDFILE=$DOCKER_RUN/dockerd.pid
    DOCKER_LOG=$DOCKER_RUN/dockerd.log
    export DOCKER_HOST=unix://$DOCKER_SOCKET
    # docker-compose builds through the docker client (BuildKit reads Dockerfile.dockerignore).
    export COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1
    # ... and that client must be Debian's.
    export PATH=/usr/bin:$PATH
}

# The pid of this checkout's dockerd, if it is alive and really dockerd.
docker_pid() {
    local pid
    pid=$(cat "$DOCKER_PIDFILE" 2>/dev/null) || return 0
    [[ $pid =~ ^[0-9]+$ ]] && pid_alive "$pid" || return 0
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "dockerd .*--pidfile $DOCKER_PIDFILE" && echo "$pid"
    return 0
}

# Start the private dockerd (idempotent). Records the network state first.
docker_start() {
    mkdir -p "$DOCKER_RUN" "$DOCKER_CACHE/docker"
    if [[ -n $(docker_pid) ]]; then
        return 0
    fi
    # Another checkout's engine on the same data root?
    local other
    other=$(ps -eo pid=,args= | awk -v root="--data-root $DOCKER_CACHE/docker " '$2 ~ /(^|\/)dockerd$/ && index($0 " ", root) { print $1 }')
    [[ -z $other ]] || die "dockerd $other already uses $DOCKER_CACHE/docker (scripts/dev compose down in its checkout)"
    [[ -f $DOCKER_RUN/net.before ]] || python3 "$DOCKER_LIB_DIR/docker_net.py" save "$DOCKER_RUN/net.before"
    say "starting dockerd (data root $DOCKER_CACHE/docker, socket $DOCKER_SOCKET, log $DOCKER_LOG)"
    rm -f "$DOCKER_SOCKET" "$DOCKER_PIDFILE"
    # Own session, stdin closed: it outlives this script until `scripts/dev compose down`.
    setsid /usr/sbin/dockerd --storage-driver=overlay2 \
        --data-root "$DOCKER_CACHE/docker" --exec-root "$DOCKER_RUN/exec" \
        --pidfile "$DOCKER_PIDFILE" -H "unix://$DOCKER_SOCKET" \
        </dev/null >>"$DOCKER_LOG" 2>&1 &
    local deadline=$((SECONDS + 30))
    until "$DOCKER_BIN" version >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            tail -n 30 "$DOCKER_LOG" >&2
            die "dockerd did not answer on $DOCKER_SOCKET within 30s"
        fi
        sleep 0.2
    done
}

# Stop the private dockerd by its pid, then restore the network as it was before the start.
docker_stop() {
    local pid
    pid=$(docker_pid)
    if [[ -n $pid ]]; then
        say "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        if ! wait_pid_exit "$pid" 60; then
            say "dockerd ignored SIGTERM for 60s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            wait_pid_exit "$pid" 10 || die "could not stop dockerd (pid $pid)"
        fi
    fi
    rm -f "$DOCKER_PIDFILE"
    if [[ -f $DOCKER_RUN/net.before ]]; then
        python3 "$DOCKER_LIB_DIR/docker_net.py" restore "$DOCKER_RUN/net.before"
        rm -f "$DOCKER_RUN/net.before"
    fi
}

# The bookworm base image, tagged as the official names the Dockerfiles use. The root file
# system comes from debootstrap once per machine ($DOCKER_CACHE/bookworm.tar).
docker_base_image() {
    if "$DOCKER_BIN" image inspect debian:bookworm >/dev/null 2>&1 &&
       "$DOCKER_BIN" image inspect debian:bookworm-slim >/dev/null 2>&1; then
        return 0
    fi
    local tarball=$DOCKER_CACHE/bookworm.tar
    if [[ ! -s $tarball ]]; then
        local dir=$DOCKER_CACHE/bookworm-rootfs
        say "debootstrap --variant=minbase bookworm (once per machine, into $tarball)"
        rm -rf "$dir"
        debootstrap --variant=minbase bookworm "$dir" "$DOCKER_DEBIAN_MIRROR" >"$DOCKER_CACHE/debootstrap.log" 2>&1 ||
            { tail -n 20 "$DOCKER_CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $DOCKER_CACHE/debootstrap.log)"; }
        # As Debian's official images: no services started by package scripts, no apt caches.
        printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
        chmod 0755 "$dir/usr/sbin/policy-rc.d"
        printf 'APT::Install-Recommends "false";\n' >"$dir/etc/apt/apt.conf.d/90-no-recommends"
        # debootstrap writes only the release itself; the official images also follow updates.
        printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s-security bookworm-security main\n' \
            "$DOCKER_DEBIAN_MIRROR" "$DOCKER_DEBIAN_MIRROR" "$DOCKER_DEBIAN_MIRROR" >"$dir/etc/apt/sources.list"
        rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/archives/*.deb
        tar -C "$dir" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$dir"
    fi
    say "docker import $tarball as debian:bookworm and debian:bookworm-slim"
    "$DOCKER_BIN" import --change 'CMD ["bash"]' - debian:bookworm <"$tarball" >/dev/null
    "$DOCKER_BIN" tag debian:bookworm debian:bookworm-slim
}

# Build one stand-in image from compose/test-images/<name>/ (skipped when every tag exists and
# the image was built from the same folder contents).
docker_test_image() {
    local root=$1 name=$2 context=${3:-}
    shift 3
    local folder=$root/compose/test-images/$name tag digest
    # The folder's files. (A new toolchain in /opt is not noticed: remove the image
    # swift:6.2-bookworm to rebuild it.)
    digest=$(cd "$folder" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
    local built=1
    for tag in "$@"; do
        [[ $("$DOCKER_BIN" image inspect -f '{{index .Config.Labels "iap.test-image"}}' "$tag" 2>/dev/null) == "$name-$digest" ]] || built=
    done
    [[ -z $built ]] || return 0
    say "building stand-in image $* (compose/test-images/$name)"
    local args=() t0
    t0=$(now_ms)
    for tag in "$@"; do args+=(-t "$tag"); done
    local log=$DOCKER_RUN/build-$name.log
    "$DOCKER_BIN" build --progress=plain --label "iap.test-image=$name-$digest" -f "$folder/Dockerfile" \
        "${args[@]}" "${context:-$folder}" >"$log" 2>&1 ||
        { tail -n 30 "$log" >&2; die "building compose/test-images/$name failed (log: $log)"; }
    say "  built in $(( ($(now_ms) - t0) / 1000 ))s"
}
