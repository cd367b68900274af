# shellcheck shell=bash
# `scripts/dev compose up|test|down [--cluster] [--prebuilt]` (sourced by scripts/dev; needs
# common.sh and docker.sh). The compose files of compose/ on a private Docker engine, with
# stand-in images made from Debian's packages (compose/test-images/: no registry is reachable
# in CI); scripts/lib/compose_check.py brings the stack up and runs the checks.

# The stand-in images, each tagged with the names the compose files and Dockerfile use.
compose_images() {
    local prebuilt=$1
    local t0
    t0=$(now_ms)
    docker_base_image
    # At the same time: they mostly wait for Debian's mirror.
    local pids=() pid failed=
    if [[ -n $prebuilt ]]; then
        compose_prebuilt_image & pids+=($!)
    else
        # The toolchain image compose/Dockerfile builds FROM (context: /opt).
        docker_test_image "$ROOT" swift /opt swift:6.2-bookworm & pids+=($!)
    fi
    docker_test_image "$ROOT" rabbitmq "" rabbitmq:3.10-management rabbitmq:3.13-management & pids+=($!)
    docker_test_image "$ROOT" postgres "" postgres:15 & pids+=($!)
    docker_test_image "$ROOT" haproxy "" haproxy:2.8 & pids+=($!)
    docker_test_image "$ROOT" prometheus "" prom/prometheus:v2.53.0 & pids+=($!)
    docker_test_image "$ROOT" python "" python:3.12-slim & pids+=($!)
    for pid in "${pids[@]}"; do
        wait "$pid" || failed=1
    done
    [[ -z $failed ]] || die "an image could not be built (see the lines above)"
    say "images ready ($(( ($(now_ms) - t0) / 1000 ))s)"
}

# --prebuilt: iap-pipeline:local from this checkout's own build (for quick local runs; CI
# builds compose/Dockerfile): `swift build -c release --static-swift-stdlib`, the binary and
# its resource bundles copied onto the runtime image.
compose_prebuilt_image() {
    local bin context=$DOCKER_RUN/prebuilt
    say "swift build -c release --product iap --static-swift-stdlib (for --prebuilt)"
    (cd "$ROOT" && swift build -c release --product iap --static-swift-stdlib) || die "swift build failed"
    bin=$(cd "$ROOT" && swift build -c release --show-bin-path)
    rm -rf "$context" && mkdir -p "$context/out"
    cp "$bin/iap" "$context/out/" && cp -R "$bin"/*.resources "$context/out/"
    # compose/Dockerfile's runtime stage, fed the binary built here instead of its build stage's.
    {
        grep '^ARG RUNTIME_IMAGE=' "$ROOT/compose/Dockerfile"
        sed -n '/^# ---- runtime/,$p' "$ROOT/compose/Dockerfile" | sed 's|^COPY --from=build /out/ |COPY out/ |'
    } >"$context/Dockerfile"
    grep -q '^COPY out/ ' "$context/Dockerfile" && grep -q '^ARG RUNTIME_IMAGE=' "$context/Dockerfile" ||
        die "compose/Dockerfile has no runtime stage copying /out/ from the build stage (what --prebuilt reuses)"
    "$DOCKER_BIN" build -q -t iap-pipeline:local "$context" >/dev/null || die "building the --prebuilt image failed"
}

COMPOSE_TEST_STARTED=
compose_cleanup() {
    # After `compose test`, also after a failure or Ctrl-C: no stack, engine or chain is left.
    [[ -n $COMPOSE_TEST_STARTED ]] || return 0
    python3 "$ROOT/scripts/lib/compose_check.py" down "$DOCKER_RUN" || say "warning: docker-compose down failed"
    docker_stop
}

cmd_compose() {
    local action=${1:-} cluster= prebuilt= arg
    (($#)) && shift
    for arg in "$@"; do
        case $arg in
            --cluster) cluster=--cluster ;;
            --prebuilt) prebuilt=1 ;;
            *) die "unknown option $arg (usage: scripts/dev compose up|test|down [--cluster] [--prebuilt])" ;;
        esac
    done
    require_root compose "$action"
    docker_paths "$ROOT"
    local t0
    t0=$(now_ms)
    case $action in
        up | test)
            ensure_packages "${DOCKER_PACKAGES[@]}"
            if [[ $action == test ]]; then
                COMPOSE_TEST_STARTED=1
                trap compose_cleanup EXIT
                trap 'exit 130' INT
                trap 'exit 143' TERM
            fi
            docker_start
            compose_images "$prebuilt"
            local build=
            [[ -z $prebuilt ]] || build=--no-build
            # shellcheck disable=SC2086 # empty options vanish
            python3 "$ROOT/scripts/lib/compose_check.py" "$action" "$DOCKER_RUN" $cluster $build
            say "scripts/dev compose $action ${cluster:-(single node)} took $(( ($(now_ms) - t0) / 1000 ))s"
            ;;
        down)
            if [[ -n $(docker_pid) ]]; then
                python3 "$ROOT/scripts/lib/compose_check.py" down "$DOCKER_RUN"
            fi
            docker_stop
            ;;
        *) die "usage: scripts/dev compose up|test|down [--cluster] [--prebuilt]" ;;
    esac
}
