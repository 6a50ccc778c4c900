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
	@for t in FuzzDecodeLoadReport FuzzDecodeGoodbye FuzzDecodeBusySet FuzzModelKey FuzzParseModelKey; do \
		$(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) -parallel 1 ./events || exit 1; done

bench: ## run the benchmarks
	$(GO) test -run '^$$' -bench . -benchmem ./events ./monitor ./busylist ./publisher

run: ## run the monitor on its embedded NATS server
	$(GO) run ./cmd/workermon serve

clean: ## remove build output
	rm -rf $(BIN)
