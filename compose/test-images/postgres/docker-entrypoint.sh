#!/bin/bash
# As the official image's entrypoint, for what the compose files use: started by root it
# switches to user postgres; an empty PGDATA is initialised with POSTGRES_USER as superuser,
# the password from POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE, SCRAM for every network
# client, and the database POSTGRES_DB; the server listens on every address.
set -euo pipefail
if [[ ${1:-} == postgres && $(id -u) == 0 ]]; then
    install -d -o postgres -g postgres -m 0700 "$PGDATA"
    install -d -o postgres -g postgres -m 2775 /var/run/postgresql
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [[ ${1:-} == postgres && ! -s $PGDATA/PG_VERSION ]]; then
    user=${POSTGRES_USER:-postgres}
    db=${POSTGRES_DB:-$user}
    password=${POSTGRES_PASSWORD:-}
    if [[ -n ${POSTGRES_PASSWORD_FILE:-} ]]; then password=$(head -n 1 "$POSTGRES_PASSWORD_FILE" | tr -d '\r\n'); fi
    [[ -n $password ]] || { echo "error: set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE" >&2; exit 1; }
    pwfile=$(mktemp)
    printf '%s\n' "$password" >"$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256
    rm -f "$pwfile"
    echo 'host all all all scram-sha-256' >>"$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    if [[ $db != postgres ]]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
        psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -c "CREATE DATABASE \"$db\" OWNER \"$user\""
        pg_ctl -D "$PGDATA" -m fast -w stop
    fi
fi
exec "$@"
