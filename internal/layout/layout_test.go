package layout_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/workermon/workermon"

// goPackage is what the test reads of `go list -json`.
type goPackage struct {
	ImportPath string
	Imports    []string
	Deps       []string
	GoFiles    []string
}

// listPackages runs go list over the whole module, from its root.
func listPackages(t *testing.T) map[string]goPackage {
	t.Helper()
	cmd := exec.Command("go", "list", "-json", "./...")
	cmd.Dir = moduleRoot(t)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	pkgs := make(map[string]goPackage)
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p goPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode go list: %v", err)
		}
		if len(p.GoFiles) == 0 {
			continue // test-only packages (integration)
		}
		pkgs[strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, module), "/")] = p
	}
	return pkgs
}

func moduleRoot(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		t.Fatalf("module root not found at %s: %v", dir, err)
	}
	return dir
}

// ours returns the packages of this module among paths, relative and
// sorted.
func ours(paths []string) []string {
	var rel []string
	for _, p := range paths {
		if p == module || strings.HasPrefix(p, module+"/") {
			rel = append(rel, strings.TrimPrefix(strings.TrimPrefix(p, module), "/"))
		}
	}
	slices.Sort(rel)
	return rel
}

// documentedGraph reads the graph block of docs/architecture.md.
func documentedGraph(t *testing.T) map[string][]string {
	t.Helper()
	f, err := os.Open(filepath.Join(moduleRoot(t), "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	graph := make(map[string][]string)
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "<!-- graph:begin -->":
			in = true
		case line == "<!-- graph:end -->":
			return graph
		case !in || strings.HasPrefix(line, "```") || line == "":
		default:
			pkg, imports, ok := strings.Cut(line, "→")
			if !ok {
				t.Fatalf("architecture.md: graph line %q has no →", line)
			}
			deps := strings.Fields(imports)
			slices.Sort(deps)
			graph[strings.TrimSpace(pkg)] = deps
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	t.Fatal("architecture.md: no <!-- graph:begin --> ... <!-- graph:end --> block")
	return nil
}

func TestDocumentedGraphIsTrue(t *testing.T) {
	pkgs := listPackages(t)
	doc := documentedGraph(t)
	for name, p := range pkgs {
		if name == "internal/layout" {
			continue
		}
		want, ok := doc[name]
		if !ok {
			t.Errorf("package %s is missing from docs/architecture.md's graph (imports %v)", name, ours(p.Imports))
			continue
		}
		if got := ours(p.Imports); !slices.Equal(got, want) {
			t.Errorf("package %s imports %v; docs/architecture.md says %v", name, got, want)
		}
	}
	for name := range doc {
		if _, ok := pkgs[name]; !ok {
			t.Errorf("docs/architecture.md lists %s, which is not a package of the module", name)
		}
	}
}

func TestLibrariesStayLight(t *testing.T) {
	pkgs := listPackages(t)
	for _, c := range []struct {
		pkg       string
		forbidden []string
	}{
		// An engine linking the publisher gets the wire contract, the
		// registry and NATS: nothing of the monitor's.
		{"publisher", []string{module + "/monitor", module + "/busylist", module + "/overrides", module + "/api",
			"github.com/prometheus/client_golang", "github.com/nats-io/nats-server"}},
		{"registry", []string{module + "/monitor", module + "/busylist", "github.com/prometheus/client_golang"}},
		// A router needs the decision and the watcher, not the monitor.
		{"admission", []string{module + "/monitor", module + "/busylist", "github.com/nats-io/nats.go"}},
		{"busylist", []string{module + "/monitor", module + "/overrides", module + "/api"}},
		{"router", []string{module + "/monitor", module + "/overrides", module + "/api"}},
		{"events", []string{module + "/", "github.com/nats-io", "github.com/prometheus"}},
		{"monitor", []string{"github.com/nats-io"}},
		// An engine's metric mapping is pure: no NATS, no Prometheus
		// server code, no publisher; the poller around it (scrape/adapter)
		// has those. (The Prometheus parser itself imports net/http.)
		{"scrape", []string{"github.com/nats-io", "github.com/prometheus/client_golang", module + "/publisher"}},
		// Deciding is pure: the slot tracker's accounting and the
		// rescheduler's planner talk to neither HTTP nor NATS; their
		// servers and dispatchers sit around them.
		{"slots", []string{"net/http", "github.com/nats-io"}},
		{"resched", []string{"net/http", "github.com/nats-io"}},
	} {
		p, ok := pkgs[c.pkg]
		if !ok {
			t.Errorf("package %s not found", c.pkg)
			continue
		}
		for _, dep := range p.Deps {
			for _, f := range c.forbidden {
				if dep == f || strings.HasPrefix(dep, strings.TrimSuffix(f, "/")+"/") {
					t.Errorf("%s depends on %s (forbidden: %s)", c.pkg, dep, f)
				}
			}
		}
	}
}
