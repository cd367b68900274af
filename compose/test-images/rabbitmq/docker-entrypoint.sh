#!/bin/bash
# As the official image's entrypoint: the server runs as user rabbitmq (started by root, it
# first takes ownership of its data folder); any other command runs as given.
set -euo pipefail
if [[ ${1:-} == rabbitmq-server && $(id -u) == 0 ]]; then
    chown -R rabbitmq:rabbitmq /var/lib/rabbitmq
    exec setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups /usr/lib/rabbitmq/bin/rabbitmq-server
fi
exec "$@"
