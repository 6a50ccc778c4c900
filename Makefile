# workermon — the usual targets. `make help` lists them.
GO       ?= go
BIN      ?= bin
PKGS     ?= ./...
FUZZTIME ?= 20s

.PHONY: help build test vet race fuzz bench run demo clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build bin/workermon
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/workermon ./cmd/workermon

vet: ## go vet
	$(GO) vet $(PKGS)

test: vet ## vet, then every unit and in-process test with the race detector
	$(GO) test -race -count=1 -timeout 15m $(PKGS)

fuzz: ## run each fuzz target for FUZZTIME
	@for t in events:FuzzDecodeLoadReport events:FuzzDecodeGoodbye events:FuzzDecodeBusySet events:FuzzModelKey \
		events:FuzzParseModelKey events:FuzzDecodeMigrateRequest api:FuzzRequest router:FuzzSSEReader router:FuzzParsePrompt scrape:FuzzParseAndMap \
		sim/stepengine:FuzzEngine; do \
		pkg=$${t%%:*}; name=$${t#*:}; \
		$(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(FUZZTIME) -parallel 1 ./$$pkg || exit 1; done

bench: ## every package's benchmarks, then `workermon bench` (the figures of docs/performance.md)
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)
	$(GO) run ./cmd/workermon bench

run: ## run the monitor on its embedded NATS server
	$(GO) run ./cmd/workermon serve

clean: ## remove build output
	rm -rf $(BIN)

# Containers: images built offline (static binaries FROM scratch), the docker
# compose stack, and the integration tests across containers.
DOCKER              ?= docker
COMPOSE             ?= $(shell $(DOCKER) compose version >/dev/null 2>&1 && echo "$(DOCKER) compose" || echo docker-compose)
COMPOSE_PROJECT     ?= workermon
INTEGRATION_TIMEOUT ?= 20m

.PHONY: images up down integration versions

images: ## build the images workermon:dev and workermon-nats:dev offline (FROM scratch)
	GO="$(GO)" DOCKER="$(DOCKER)" ./deploy/images.sh

up: images ## build the images, start the docker compose stack and wait until it is healthy
	COMPOSE="$(COMPOSE)" COMPOSE_PROJECT_NAME=$(COMPOSE_PROJECT) ./deploy/compose-up.sh

down: ## stop the docker compose stack and remove its containers, networks and volumes
	COMPOSE_PROJECT_NAME=$(COMPOSE_PROJECT) $(COMPOSE) --profile load --profile scrape --profile observability down -v --remove-orphans

integration: images ## the container tests (Docker needed; fails without it; never pulls), then `make versions`
	$(GO) test -tags integration -count=1 -timeout $(INTEGRATION_TIMEOUT) -v ./integration/
	$(MAKE) versions

# The NATS version matrix needs no Docker: it builds nats-server 2.9.25,
# 2.10.29 and 2.11.17 from the Go module proxy (cached under
# ~/.cache/workermon-test) and runs workermon against each as processes.
versions: ## the NATS server version matrix (no Docker; builds pinned nats-server versions from the module proxy)
	$(GO) test -tags integration -count=1 -timeout $(INTEGRATION_TIMEOUT) -run TestNATSVersions -v ./cmd/workermon/
