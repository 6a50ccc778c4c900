#!/usr/bin/env bash
# Builds the container images workermon:$IMAGE_TAG and workermon-nats:$IMAGE_TAG
# with no registry: the binaries are compiled on this host (static,
# CGO_ENABLED=0) and copied into FROM scratch images. `make images` runs it.
#
# Environment: GO (go), DOCKER (docker), IMAGE_TAG (dev), CONTEXT_DIR
# (bin/docker, where the build contexts are staged).
set -euo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
DOCKER=${DOCKER:-docker}
TAG=${IMAGE_TAG:-dev}
CTX=${CONTEXT_DIR:-bin/docker}
UID_GID=65532

version=$(git describe --always --dirty 2>/dev/null || echo unknown)
nats_version=$($GO list -m -f '{{.Version}}' github.com/nats-io/nats-server/v2)

rm -rf "$CTX"
mkdir -p "$CTX/workermon/rootfs/usr/local/bin" "$CTX/workermon/rootfs/etc/ssl/certs" \
  "$CTX/workermon/data" "$CTX/nats"

echo "== go build workermon ($version)"
CGO_ENABLED=0 $GO build -trimpath -ldflags="-s -w" \
  -o "$CTX/workermon/rootfs/usr/local/bin/workermon" ./cmd/workermon
echo "== go build nats-server ($nats_version, from go.mod)"
CGO_ENABLED=0 $GO build -trimpath -ldflags="-s -w" \
  -o "$CTX/nats/nats-server" github.com/nats-io/nats-server/v2

# A user database so that tools show names, and the CA bundle for tls://
# connections to servers with public certificates (when this host has one).
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/data:/sbin/nologin\n' \
  $UID_GID $UID_GID >"$CTX/workermon/rootfs/etc/passwd"
printf 'root:x:0:\nnonroot:x:%d:\n' $UID_GID >"$CTX/workermon/rootfs/etc/group"
for ca in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
  if [ -r "$ca" ]; then
    cp "$ca" "$CTX/workermon/rootfs/etc/ssl/certs/ca-certificates.crt"
    break
  fi
done
cp deploy/nats/nats.conf "$CTX/nats/nats.conf"

echo "== docker build workermon:$TAG"
$DOCKER build -q -f deploy/workermon/Dockerfile --build-arg "VERSION=$version" \
  -t "workermon:$TAG" "$CTX/workermon"
echo "== docker build workermon-nats:$TAG"
$DOCKER build -q -f deploy/nats/Dockerfile --build-arg "BASE=workermon:$TAG" \
  --build-arg "NATS_VERSION=$nats_version" -t "workermon-nats:$TAG" "$CTX/nats"
# The images these replaced, now untagged and unused: drop them.
for title in workermon workermon-nats; do
  $DOCKER image prune -f --filter "label=org.opencontainers.image.title=$title" >/dev/null
done
$DOCKER image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^workermon(-nats)?:$TAG " || true
