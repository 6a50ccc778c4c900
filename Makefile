# workermon — the usual targets. `make help` lists them.
GO       ?= go
BIN      ?= bin
PKGS     ?= ./...
FUZZTIME ?= 20s

.PHONY: help build test vet race fuzz bench helm-test run demo clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build bin/workermon
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/workermon ./cmd/workermon

vet: ## go vet
	$(GO) vet $(PKGS)

# The race detector needs cgo, so a C compiler: without one (go env
# CGO_ENABLED says 0) the tests run without it and say so. CI requires it
# (REQUIRE_RACE=1, .ci/run).
RACE := $(if $(filter 1,$(shell $(GO) env CGO_ENABLED)),-race,)

test: vet ## vet, then every unit and in-process test with the race detector (when a C compiler is there)
	@if [ -z "$(RACE)" ]; then \
		if [ -n "$(REQUIRE_RACE)" ]; then echo "make test: the race detector needs cgo and a C compiler (go env CGO_ENABLED is 0)" >&2; exit 1; fi; \
		echo "make test: cgo is off (go env CGO_ENABLED is 0: no C compiler?): running WITHOUT the race detector (apt-get install gcc to have it)" >&2; \
	fi
	$(GO) test $(RACE) -count=1 -timeout 15m $(PKGS)

fuzz: ## run each fuzz target for FUZZTIME
	@for t in events:FuzzDecodeLoadReport events:FuzzDecodeGoodbye events:FuzzDecodeBusySet events:FuzzModelKey \
		events:FuzzParseModelKey events:FuzzDecodeMigrateRequest events:FuzzDecodeLatencyReport events:FuzzDecodeRouterQueue api:FuzzRequest router:FuzzSSEReader router:FuzzParsePrompt scrape:FuzzParseAndMap scrape:FuzzLatencyWindow \
		sim/stepengine:FuzzEngine; do \
		pkg=$${t%%:*}; name=$${t#*:}; \
		$(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(FUZZTIME) -parallel 1 ./$$pkg || exit 1; done

bench: ## every package's benchmarks, then `workermon bench` (the figures of docs/performance.md)
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)
	$(GO) run ./cmd/workermon bench

# VALUES: more values files for `make helm-test` (absolute paths, comma-separated).
VALUES ?=

helm-test: ## lint and render the Helm chart (deploy/helm, a Go module of its own): strict decoding, --check of every workermon container, the NATS mappings; VALUES=your-values.yaml too
	cd deploy/helm && GO="$(GO)" $(GO) vet ./... && GO="$(GO)" WORKERMON_HELM_VALUES="$(VALUES)" $(GO) test -count=1 -timeout 10m ./...

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
# PROFILES: the compose profiles `make up` starts besides the default
# services (load, scrape, observability), e.g. `make up PROFILES="load scrape"`.
PROFILES            ?=
# S: the compose service of `make logs`, `stop`, `start`, `kill` and `exec`
# (monitor, monitor-2, router, sim1, load...); CMD: the command of `make exec`.
S                   ?=
CMD                 ?=
# The stack's compose command, for either Compose v2 or v1, with the project
# name; ALL names every profile, so that a command finds every service.
STACK               = COMPOSE_PROJECT_NAME=$(COMPOSE_PROJECT) $(COMPOSE)
ALL                 = $(STACK) --profile load --profile scrape --profile observability

.PHONY: images up down ps logs stop start kill exec status integration versions chaos

images: ## build the images workermon:dev and workermon-nats:dev offline (FROM scratch)
	GO="$(GO)" DOCKER="$(DOCKER)" ./deploy/images.sh

up: images ## build the images, start the compose stack (and PROFILES) and wait until it is healthy; starts stopped services too
	COMPOSE="$(COMPOSE)$(foreach p,$(PROFILES), --profile $(p))" COMPOSE_PROJECT_NAME=$(COMPOSE_PROJECT) ./deploy/compose-up.sh

down: ## stop the docker compose stack and remove its containers, networks and volumes
	$(ALL) down -v --remove-orphans

ps: ## the stack's containers, stopped ones included, their state and health
	$(ALL) ps -a

logs: ## follow the logs of service S (every service without S)
	$(ALL) logs -f $(S)

stop: ## stop service S (make stop S=sim3); `make start S=sim3` starts it again
	@test -n "$(S)" || { echo 'make stop: name the service: make stop S=monitor' >&2; exit 2; }
	$(ALL) stop $(S)

start: ## start service S again after `make stop`, `make kill` or a `docker kill`
	@test -n "$(S)" || { echo 'make start: name the service: make start S=monitor' >&2; exit 2; }
	$(ALL) start $(S)

kill: ## SIGKILL service S; Docker counts it as a manual stop and does not restart it: `make start S=...`
	@test -n "$(S)" || { echo 'make kill: name the service: make kill S=monitor' >&2; exit 2; }
	$(ALL) kill $(S)

exec: ## run CMD in service S, e.g. make exec S=monitor CMD="workermon status"
	@test -n "$(S)" -a -n "$(CMD)" || { echo 'make exec: give S and CMD: make exec S=monitor CMD="workermon status"' >&2; exit 2; }
	$(ALL) exec -T $(S) $(CMD)

status: ## `workermon status` of the stack's first monitor
	$(ALL) exec -T monitor workermon status

integration: images ## the container tests (Docker needed; fails without it; never pulls), a 3-minute chaos run, then `make versions`
	$(GO) test -tags integration -count=1 -timeout $(INTEGRATION_TIMEOUT) -v ./integration/
	$(CHAOS_RUN) -duration 3m -json bin/chaos-integration.json
	$(MAKE) versions

# The chaos run (DESIGN §20, docs/ha.md): its own compose project
# (workermon-chaos, deploy/chaos/compose.yml), load and seeded faults for
# CHAOS_DURATION, then the stack is removed, also when the run fails or is
# interrupted. CHAOS_SEED replays a run's faults.
CHAOS_DURATION ?= 10m
CHAOS_SEED     ?= 0
CHAOS_RUN       = mkdir -p $(BIN) && COMPOSE="$(COMPOSE)" $(GO) run ./integration/chaos -seed $(CHAOS_SEED)

chaos: images ## the chaos run: faults under load on a stack of its own for CHAOS_DURATION (10m), seed CHAOS_SEED; results in bin/chaos.json
	$(CHAOS_RUN) -duration $(CHAOS_DURATION) -json $(BIN)/chaos.json

# The NATS version matrix needs no Docker: it builds nats-server 2.9.25,
# 2.10.29 and 2.11.17 from the Go module proxy (cached under
# ~/.cache/workermon-test) and runs workermon against each as processes.
versions: ## the NATS server version matrix (no Docker; builds pinned nats-server versions from the module proxy)
	$(GO) test -tags integration -count=1 -timeout $(INTEGRATION_TIMEOUT) -run TestNATSVersions -v ./cmd/workermon/
