#!/usr/bin/env bash
# Deploy docker-stack.yml as the stack `syncps` (or $SYNCPS_STACK) on the swarm this host manages, once the
# secrets it needs exist: without one it deploys nothing and prints the commands that make it (plain
# `docker stack deploy` would only say "secret not found").
#
#   deploy/swarm/deploy.sh                          # docker stack deploy --resolve-image never -c docker-stack.yml syncps
#   deploy/swarm/deploy.sh -c my-settings.yml       # more options of `docker stack deploy`, e.g. a file of settings
#
# --resolve-image never: the image is built here (docker compose build), never looked up in a registry.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
stack=${SYNCPS_STACK:-syncps}
secrets=(syncps_token syncps_monitor_token)
for f in "$@"; do  # a stack file given with -c that uses the peer token (deploy/swarm/standby.yml) needs it too
  if [ -f "$f" ] && grep -q syncps_peer_token "$f"; then secrets+=(syncps_peer_token); break; fi
done

if [ "$(docker info -f '{{.Swarm.ControlAvailable}}' 2>/dev/null)" != true ]; then
  echo "deploy.sh: this Docker engine is not a swarm manager: run \`docker swarm init\` (or deploy from a manager)" >&2
  exit 1
fi
missing=()
for s in "${secrets[@]}"; do
  docker secret inspect "$s" >/dev/null 2>&1 || missing+=("$s")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deploy.sh: secret not found: ${missing[*]}. The stack runs with bearer tokens from Docker secrets;" >&2
  echo "make each missing one once, on a manager, then deploy again:" >&2
  for s in "${missing[@]}"; do
    case $s in  # the monitoring token is the one people use (curl, the dashboard, Prometheus): keep a copy
      syncps_monitor_token) echo "  openssl rand -hex 32 | tee $s.txt | docker secret create $s -" >&2 ;;
      *) echo "  openssl rand -hex 32 | docker secret create $s -" >&2 ;;
    esac
  done
  exit 1
fi
exec docker stack deploy --resolve-image never -c "$root/docker-stack.yml" "$@" "$stack"
