package helm

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// TestRenderedStackServes runs what the chart renders, short of a cluster:
// a NATS server on the rendered nats.conf (one node: no routes, no claim),
// the monitor and the router with their rendered arguments and environment
// (the NATS URL, the HTTP port and the bucket replicas made local), and a
// simulated engine fleet that publishes on the plain subjects. The monitor
// hears the fleet through the rendered mappings (no unmapped report), both
// become ready, and the monitor exports the model's busy fraction and its
// saturation (the KEDA example's signal). Each
// runs as its role's user of the rendered authorization, with the
// passwords of the rendered Secret as its secretKeyRefs give them (the
// engines as the engine user), and the server logs no permissions
// violation: the default permission split lets every role do its work.
func TestRenderedStackServes(t *testing.T) {
	r, err := render(t, chartDir, map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	cm, _ := r.find("ConfigMap", releaseName+"-workermon-nats-config").(*corev1.ConfigMap)
	if cm == nil {
		t.Fatal("no NATS ConfigMap")
	}
	secret, _ := r.find("Secret", releaseName+"-workermon-nats-auth").(*corev1.Secret)
	if secret == nil {
		t.Fatal("no NATS auth Secret")
	}
	// secretEnv is a container's variables from the rendered Secret.
	secretEnv := func(c corev1.Container) []string {
		var env []string
		for _, e := range c.Env {
			switch {
			case e.ValueFrom == nil:
				env = append(env, e.Name+"="+e.Value)
			case e.ValueFrom.SecretKeyRef != nil:
				if e.ValueFrom.SecretKeyRef.Name != secret.Name {
					t.Fatalf("%s: %s from the Secret %s, not the rendered one", c.Name, e.Name, e.ValueFrom.SecretKeyRef.Name)
				}
				env = append(env, e.Name+"="+string(secret.Data[e.ValueFrom.SecretKeyRef.Key]))
			}
		}
		return env
	}
	dir := t.TempDir()
	conf := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(conf, []byte(cm.Data["nats.conf"]), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SERVER_NAME", releaseName+"-workermon-nats-0")
	sts, _ := r.find("StatefulSet", releaseName+"-workermon-nats").(*appsv1.StatefulSet)
	if sts == nil {
		t.Fatal("no NATS StatefulSet")
	}
	for _, kv := range secretEnv(sts.Spec.Template.Spec.Containers[0]) {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	opts.Host, opts.Port, opts.HTTPPort = "127.0.0.1", -1, 0
	opts.Cluster, opts.Routes = server.ClusterOpts{}, nil
	opts.StoreDir, opts.NoLog, opts.NoSigs = filepath.Join(dir, "js"), true, true
	ns, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	violations := &violationLog{}
	ns.SetLoggerV2(violations, false, false, false)
	go ns.Start()
	t.Cleanup(ns.Shutdown)
	if !ns.ReadyForConnections(30 * time.Second) {
		t.Fatal("NATS server not ready")
	}
	url := ns.ClientURL()

	local := func(c corev1.Container) []string {
		var args []string
		for _, a := range c.Args {
			switch {
			case strings.HasPrefix(a, "--nats-url="):
				a = "--nats-url=" + url
			case strings.HasPrefix(a, "--http-addr="):
				a = "--http-addr=127.0.0.1:0"
			case strings.HasPrefix(a, "--replicas="):
				a = "--replicas=1" // one NATS node
			}
			args = append(args, a)
		}
		return args
	}
	container := func(name string) corev1.Container {
		d, _ := r.find("Deployment", releaseName+"-workermon-"+name).(*appsv1.Deployment)
		if d == nil {
			t.Fatalf("no %s Deployment", name)
		}
		return d.Spec.Template.Spec.Containers[0]
	}
	env := []string{"HOME=" + dir, "TMPDIR=" + dir, "WORKERMON_MONITOR_ID=" + fieldRefValues["metadata.name"],
		"WORKERMON_ROUTER_ID=" + releaseName + "-workermon-router-5c7d8-abcde"}
	monitor := start(t, append(secretEnv(container("monitor")), env...), local(container("monitor")), regexp.MustCompile(`API http://(\S+),`))
	router := start(t, append(secretEnv(container("router")), env...), local(container("router")), regexp.MustCompile(`proxy http://(\S+),`))
	// The engines as docs/kubernetes.md's sidecar connects: the engine user.
	engine := append([]string{"WORKERMON_NATS_USER=engine", "WORKERMON_NATS_PASSWORD=" + string(secret.Data["engine-password"])}, env...)
	start(t, engine, []string{"sim", "--nats-url", url, "--model", "llama", "--workers", "2", "--port-base", "0", "--http-addr", ""}, nil)

	get := func(u string) (int, string) {
		resp, err := http.Get(u)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	waitFor(t, "the monitor ready and listing llama's workers", func() string {
		if code, body := get("http://" + monitor + "/readyz"); code != 200 {
			return "monitor /readyz: " + body
		}
		if _, body := get("http://" + monitor + "/busy"); !strings.Contains(body, `"llama"`) {
			return "monitor /busy: " + body
		}
		_, body := get("http://" + monitor + "/metrics")
		for _, series := range []string{`workermon_model_busy_fraction{model="llama"}`, `workermon_model_saturation{model="llama"}`} {
			if !strings.Contains(body, series) {
				return "no " + series + " in /metrics"
			}
		}
		return ""
	})
	waitFor(t, "the router ready", func() string {
		if code, body := get("http://" + router + "/readyz"); code != 200 {
			return "router /readyz: " + body
		}
		return ""
	})
	if _, body := get("http://" + monitor + "/healthz"); !strings.Contains(body, "unmapped_reports 0") {
		t.Errorf("reports arrived unmapped: the rendered mappings do not reach the monitor\n%s", body)
	}
	if v := violations.lines(); len(v) > 0 {
		t.Errorf("the NATS server logged permissions violations: a role lacks a permission it uses\n%s", strings.Join(v, "\n"))
	}
}

// violationLog is a nats-server logger that keeps the lines about
// permissions and authorization violations.
type violationLog struct {
	mu   sync.Mutex
	seen []string
}

func (l *violationLog) keep(format string, args ...any) {
	if line := fmt.Sprintf(format, args...); strings.Contains(line, "Violation") {
		l.mu.Lock()
		l.seen = append(l.seen, line)
		l.mu.Unlock()
	}
}

func (l *violationLog) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.seen)
}

func (l *violationLog) Noticef(format string, args ...any) { l.keep(format, args...) }
func (l *violationLog) Warnf(format string, args ...any)   { l.keep(format, args...) }
func (l *violationLog) Fatalf(format string, args ...any)  { l.keep(format, args...) }
func (l *violationLog) Errorf(format string, args ...any)  { l.keep(format, args...) }
func (l *violationLog) Debugf(format string, args ...any)  {}
func (l *violationLog) Tracef(format string, args ...any)  {}

// start runs the workermon binary with args and env until the test ends
// (then SIGTERM); with addr set it returns the address the first matching
// line of its output names.
func start(t *testing.T, env, args []string, addr *regexp.Regexp) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, workermonBin, args...)
	cmd.Env = env
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 20 * time.Second
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	logs := &strings.Builder{}
	cmd.Stderr = &lockedWriter{w: logs}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	found := make(chan string, 1)
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if addr != nil {
				if m := addr.FindStringSubmatch(sc.Text()); m != nil {
					select {
					case found <- m[1]:
					default:
					}
				}
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-drained
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("workermon %s:\n%s", args[0], logs.String())
		}
	})
	if addr == nil {
		return ""
	}
	select {
	case a := <-found:
		return a
	case <-time.After(60 * time.Second):
		t.Fatalf("workermon %s printed no address in 60s", args[0])
	}
	return ""
}

// waitFor polls cond until it returns "" or a minute passes; the last
// reason is the failure.
func waitFor(t *testing.T, what string, cond func() string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		why := cond()
		if why == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: %s", what, why)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// lockedWriter serialises writes from a command's output copier.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
