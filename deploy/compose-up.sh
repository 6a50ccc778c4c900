#!/usr/bin/env bash
# Starts the docker compose stack and waits until every started service is
# healthy (`make up`). With Compose v2 that is `up -d --wait`; the standalone
# docker-compose v1 has no --wait, so the health of each container is polled.
#
# Environment: COMPOSE (the compose command), COMPOSE_PROJECT_NAME
# (workermon), WAIT_TIMEOUT (seconds, 180). Extra arguments go to `up`
# (service names). --profile is a global option, so it goes in COMPOSE:
# `make up PROFILES=observability` sets COMPOSE="<compose> --profile
# observability", with Compose v2 or v1.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-workermon}
timeout=${WAIT_TIMEOUT:-180}
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE=docker-compose; fi
fi

if $COMPOSE version 2>/dev/null | grep -qiE 'version v?2|version 2|v2\.'; then
  exec $COMPOSE up -d --wait --wait-timeout "$timeout" "$@"
fi

$COMPOSE up -d "$@"
deadline=$((SECONDS + timeout))
while :; do
  pending=()
  for id in $($COMPOSE ps -q); do
    read -r name status health < <(docker inspect \
      -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$id")
    name=${name#/}
    if [ "$status" != running ]; then
      echo "compose-up: $name is $status" >&2
      $COMPOSE ps >&2
      docker logs --tail 30 "$id" >&2 || true
      exit 1
    fi
    if [ "$health" != healthy ] && [ "$health" != none ]; then
      pending+=("$name($health)")
    fi
  done
  if [ ${#pending[@]} -eq 0 ]; then
    $COMPOSE ps
    echo "compose-up: every service is healthy"
    exit 0
  fi
  if [ $SECONDS -ge $deadline ]; then
    echo "compose-up: not healthy after ${timeout}s: ${pending[*]}" >&2
    $COMPOSE ps >&2
    exit 1
  fi
  sleep 1
done
