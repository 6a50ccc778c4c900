//go:build integration

package integration

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	mobynet "github.com/moby/moby/api/types/network"
	"github.com/moby/moby/client"
	"github.com/testcontainers/testcontainers-go"
	tclog "github.com/testcontainers/testcontainers-go/log"
	"github.com/testcontainers/testcontainers-go/network"
	"github.com/testcontainers/testcontainers-go/wait"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/kvbucket"
)

// The model every simulated worker serves.
const model = "Qwen/Qwen3-0.6B"

// Short intervals, so that every fault shows within seconds.
const (
	warmup         = 2 * time.Second
	heartbeat      = 500 * time.Millisecond
	staleAfter     = 2 * time.Second
	goneAfter      = 5 * time.Second
	staleListAfter = 3 * time.Second // the router's
	leaseTTL       = time.Second
)

// startTimeout bounds the start of one container, wait strategy included.
const startTimeout = 60 * time.Second

// The NATS users of deploy/nats/compose.conf, with test passwords: one
// engine user per worker id (engine-<id>, allowed only that worker's
// subjects), the router and the monitor. The monitor's user also serves the
// test's own client, which reads the buckets.
var passwords = map[string]string{
	"engine-1": "engine-1-integration",
	"engine-2": "engine-2-integration",
	"engine-3": "engine-3-integration",
	"engine-4": "engine-4-integration",
	"router":   "router-integration",
	"monitor":  "monitor-integration",
}

// engineUser is the NATS user of worker id.
func engineUser(id uint64) string { return "engine-" + strconv.FormatUint(id, 10) }

// passwordEnv is the variable through which compose.conf reads a user's
// password: WORKERMON_NATS_ENGINE_1_PASSWORD for engine-1.
func passwordEnv(user string) string {
	return "WORKERMON_NATS_" + strings.ToUpper(strings.ReplaceAll(user, "-", "_")) + "_PASSWORD"
}

// stackOptions says what a test's stack is made of.
type stackOptions struct {
	// natsNodes is 1 for a single server (alias "nats") or 3 for a cluster
	// (aliases "nats-1" to "nats-3").
	natsNodes int
	// sims is the number of simulated workers, ids 1 to sims, two DP ranks
	// each, one container each (alias "sim<id>").
	sims int
	// router starts a router (alias "router").
	router bool
	// replicas of the buckets (monitor --replicas).
	replicas int
	// monitorArgs are added to the monitor's command line (thresholds).
	monitorArgs []string
	// monitors is the number of monitors (0 means 1): "monitor", then
	// "monitor-2", ..., sharing the partitions (docs/ha.md).
	monitors int
	// routerStaleListAfter replaces the router's staleListAfter.
	routerStaleListAfter time.Duration
	// simArgs are added to every sim's command line (capacity, speed).
	simArgs []string
}

// stack is a running workermon deployment on a network of its own.
type stack struct {
	t       *testing.T
	opts    stackOptions
	net     *testcontainers.DockerNetwork
	nats    []*testcontainers.DockerContainer
	natsIDs []string                        // aliases, same order
	monitor *testcontainers.DockerContainer // the first of monitors
	// monitors are every monitor, by alias.
	monitors map[string]*testcontainers.DockerContainer
	sims     map[uint64]*testcontainers.DockerContainer
	router   *testcontainers.DockerContainer
	natsURL  string // the servers as seen inside the network

	mu       sync.Mutex
	provoked []violation // the permissions violations the test provokes on purpose
}

// violation is a publish that the NATS server must deny, and log.
type violation struct {
	user, subject string
}

// logged is the end of the server's log line for the denial: the client's
// "<account>/user:<name>" label, then the subject (nats-server's client.go,
// pubPermissionViolation and getAuthUserLabel).
func (v violation) logged() string {
	return fmt.Sprintf("/user:%s\" - Publish Violation - Subject %q", v.user, v.subject)
}

// startStack starts NATS, the monitor, the workers and the router, in that
// order, each waited for, and removes them at the end of the test.
func startStack(t *testing.T, opts stackOptions) *stack {
	t.Helper()
	start := time.Now()
	s := &stack{t: t, opts: opts, sims: map[uint64]*testcontainers.DockerContainer{},
		monitors: map[string]*testcontainers.DockerContainer{}}
	ctx := t.Context()
	nw, err := network.New(ctx)
	if err != nil {
		t.Fatalf("create network: %v", err)
	}
	s.net = nw
	// Registered first, so it runs last: after every container is gone.
	testcontainers.CleanupNetwork(t, nw)

	s.startNATS()
	if opts.replicas > 1 {
		s.provisionWorkersBucket()
	}
	for i := range max(opts.monitors, 1) {
		alias := "monitor"
		if i > 0 {
			alias = fmt.Sprintf("monitor-%d", i+1)
		}
		s.monitors[alias] = s.run(alias, workermonImage, s.monitorCmd(alias), []string{"8090/tcp"},
			wait.ForHTTP("/readyz").WithPort("8090/tcp"), map[string]string{
				"WORKERMON_NATS_USER": "monitor", "WORKERMON_NATS_PASSWORD": passwords["monitor"]})
		if t.Failed() {
			t.FailNow()
		}
	}
	s.monitor = s.monitors["monitor"]
	var wg sync.WaitGroup
	var mu sync.Mutex
	for id := uint64(1); id <= uint64(opts.sims); id++ {
		wg.Go(func() {
			c := s.startSim(id)
			mu.Lock()
			s.sims[id] = c
			mu.Unlock()
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if opts.router {
		s.router = s.run("router", workermonImage, []string{"router",
			"--nats-url", s.natsURL, "--http-addr", "0.0.0.0:8080",
			"--stale-list-after", cmp.Or(opts.routerStaleListAfter, staleListAfter).String(), "--replicas", strconv.Itoa(max(opts.replicas, 1)),
			"--log-level", "debug"},
			[]string{"8080/tcp"}, wait.ForHTTP("/readyz").WithPort("8080/tcp"), map[string]string{
				"WORKERMON_NATS_USER": "router", "WORKERMON_NATS_PASSWORD": passwords["router"]})
		if t.Failed() {
			t.FailNow()
		}
	}
	t.Logf("stack up in %v: %d NATS node(s), monitor, %d worker(s), router=%v on network %s",
		time.Since(start).Round(time.Millisecond), len(s.nats), opts.sims, opts.router, nw.Name)
	return s
}

func (s *stack) monitorCmd(alias string) []string {
	cmd := []string{"serve", "--nats-url", s.natsURL, "--http-addr", "0.0.0.0:8090",
		"--monitor-id", alias + "-it", "--replicas", strconv.Itoa(max(s.opts.replicas, 1)),
		"--warmup", warmup.String(), "--heartbeat", heartbeat.String(), "--lease-ttl", leaseTTL.String(),
		"--stale-after", staleAfter.String(), "--gone-after", goneAfter.String()}
	return append(cmd, s.opts.monitorArgs...)
}

// startNATS starts the server or the three nodes of a cluster, at once (a
// cluster node is healthy only once a quorum is up), with the per-role
// users of deploy/nats/compose.conf.
func (s *stack) startNATS() {
	n := max(s.opts.natsNodes, 1)
	s.natsIDs = make([]string, n)
	s.nats = make([]*testcontainers.DockerContainer, n)
	var urls, routes []string
	for i := range n {
		s.natsIDs[i] = "nats"
		if n > 1 {
			s.natsIDs[i] = fmt.Sprintf("nats-%d", i+1)
		}
		urls = append(urls, "nats://"+s.natsIDs[i]+":4222")
		routes = append(routes, "nats://"+s.natsIDs[i]+":6222")
	}
	s.natsURL = strings.Join(urls, ",")
	env := map[string]string{}
	for user, pw := range passwords {
		env[passwordEnv(user)] = pw
	}
	var wg sync.WaitGroup
	for i := range n {
		cmd := []string{"--config", "/etc/nats/workermon.conf", "--name", s.natsIDs[i]}
		if n > 1 {
			cmd = append(cmd, "--cluster_name", "workermon-it", "--cluster", "nats://0.0.0.0:6222",
				"--routes", strings.Join(routes, ","))
		}
		wg.Go(func() {
			s.nats[i] = s.run(s.natsIDs[i], natsImage, cmd, []string{"4222/tcp", "8222/tcp"},
				wait.ForHTTP("/healthz").WithPort("8222/tcp"), env,
				testcontainers.WithFiles(testcontainers.ContainerFile{
					HostFilePath:      "../deploy/nats/compose.conf",
					ContainerFilePath: "/etc/nats/workermon.conf",
					FileMode:          0o644,
				}))
		})
	}
	wg.Wait()
	if s.t.Failed() {
		s.t.FailNow()
	}
	s.t.Cleanup(s.checkViolations)
}

// provisionWorkersBucket creates the worker registry's bucket at the
// stack's replicas before any worker starts, as an operator of a cluster
// does: the monitor creates the busy and thresholds buckets with its
// --replicas, but the registry bucket is created by the first engine to
// register, and `workermon sim` creates it with one replica.
func (s *stack) provisionWorkersBucket() {
	obs := s.observe()
	defer obs.close()
	cfg := kvbucket.Config(events.WorkersBucket, s.opts.replicas)
	waitFor(s.t, 30*time.Second, "bucket "+cfg.Bucket+" provisioned at R"+strconv.Itoa(cfg.Replicas), func() (bool, string) {
		ctx, cancel := context.WithTimeout(s.t.Context(), opTimeout)
		defer cancel()
		if _, err := obs.js.CreateKeyValue(ctx, cfg); err != nil {
			return false, err.Error()
		}
		return true, fmt.Sprintf("history %d, TTL %v, %d replicas", cfg.History, cfg.TTL, cfg.Replicas)
	})
}

// startSim starts worker id: one container, one worker with two DP ranks,
// registered as http://sim<id>:8000, connected as the worker's own user.
func (s *stack) startSim(id uint64) *testcontainers.DockerContainer {
	name := fmt.Sprintf("sim%d", id)
	user := engineUser(id)
	if _, ok := passwords[user]; !ok {
		s.t.Errorf("start %s: deploy/nats/compose.conf has no NATS user %s for worker %d", name, user, id)
		return nil
	}
	cmd := []string{"sim", "--nats-url", s.natsURL, "--model", model, "--workers", "1", "--ranks", "2",
		"--worker-id-base", strconv.FormatUint(id, 10), "--host", "0.0.0.0", "--port-base", "8000",
		"--advertise-host", name}
	cmd = append(cmd, s.opts.simArgs...)
	return s.run(name, workermonImage, cmd, []string{"8000/tcp"},
		wait.ForHTTP("/health").WithPort("8000/tcp"), map[string]string{
			"WORKERMON_NATS_USER": user, "WORKERMON_NATS_PASSWORD": passwords[user]})
}

// run starts one container on the stack's network under alias name and
// waits for it; on failure of the test its last log lines are shown.
func (s *stack) run(name, image string, cmd, ports []string, ready wait.Strategy, env map[string]string,
	more ...testcontainers.ContainerCustomizer) *testcontainers.DockerContainer {
	t := s.t
	start := time.Now()
	opts := []testcontainers.ContainerCustomizer{
		testcontainers.WithCmd(cmd...),
		testcontainers.WithExposedPorts(ports...),
		testcontainers.WithEnv(env),
		network.WithNetwork([]string{name}, s.net),
		testcontainers.WithWaitStrategyAndDeadline(startTimeout, ready),
		testcontainers.WithLogger(tclog.NewNoopLogger()),
		testcontainers.WithLabels(map[string]string{"workermon.integration": t.Name()}),
	}
	c, err := testcontainers.Run(t.Context(), image, append(opts, more...)...)
	testcontainers.CleanupContainer(t, c)
	if c != nil {
		// Runs before the removal registered just above.
		t.Cleanup(func() {
			if t.Failed() {
				showLogs(t, name, c, 60)
			}
		})
	}
	if err != nil {
		t.Errorf("start %s (%s %s): %v", name, image, strings.Join(cmd, " "), err)
		return nil
	}
	t.Logf("started %s in %v: %s %s", name, time.Since(start).Round(time.Millisecond), image, strings.Join(cmd, " "))
	return c
}

// expectViolation declares that the test is about to publish subject as
// user on purpose, and that the server must deny it: checkViolations then
// accepts that denial, and only that one.
func (s *stack) expectViolation(user, subject string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.provoked = append(s.provoked, violation{user: user, subject: subject})
}

// provokedViolations returns the denials the test declared.
func (s *stack) provokedViolations() []violation {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.provoked)
}

// violations returns every permissions violation in the logs of the NATS
// nodes, as "<node>: <line>".
func (s *stack) violations(ctx context.Context) ([]string, int, error) {
	var out []string
	total := 0
	for i, c := range s.nats {
		lines, err := logLines(ctx, c)
		if err != nil {
			return nil, 0, fmt.Errorf("logs of %s: %w", s.natsIDs[i], err)
		}
		total += len(lines)
		for _, l := range lines {
			if strings.Contains(l, "Violation") {
				out = append(out, s.natsIDs[i]+": "+l)
			}
		}
	}
	return out, total, nil
}

// waitViolation waits until a NATS node logged the denial of v and returns
// the log line.
func (s *stack) waitViolation(timeout time.Duration, v violation) string {
	s.t.Helper()
	var found string
	waitFor(s.t, timeout, fmt.Sprintf("NATS logging the denial of %s publishing %s", v.user, v.subject), func() (bool, string) {
		ctx, cancel := context.WithTimeout(s.t.Context(), opTimeout)
		defer cancel()
		lines, _, err := s.violations(ctx)
		if err != nil {
			return false, err.Error()
		}
		for _, l := range lines {
			if strings.Contains(l, v.logged()) {
				found = l
				return true, l
			}
		}
		return false, fmt.Sprintf("%d violation(s) logged, none of %s on %s", len(lines), v.user, v.subject)
	})
	return found
}

// checkViolations fails the test, at its end, if a NATS server logged a
// permissions violation that the test did not provoke on purpose (see
// expectViolation): every role must get by with its own subjects. A
// provoked violation that was never logged fails it too.
func (s *stack) checkViolations() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lines, total, err := s.violations(ctx)
	if err != nil {
		s.t.Logf("violations: %v", err)
		return
	}
	provoked := s.provokedViolations()
	seen := make([]int, len(provoked))
	var bad []string
next:
	for _, l := range lines {
		for i, v := range provoked {
			if strings.Contains(l, v.logged()) {
				seen[i]++
				continue next
			}
		}
		bad = append(bad, l)
	}
	for i, v := range provoked {
		if seen[i] == 0 {
			s.t.Errorf("the denial of %s publishing %s was provoked but never logged", v.user, v.subject)
		} else {
			s.t.Logf("provoked on purpose and logged %d time(s): %s denied publishing %s", seen[i], v.user, v.subject)
		}
	}
	switch {
	case len(bad) > 0:
		s.t.Errorf("NATS logged %d permissions violation(s) not provoked by the test, first: %s", len(bad), bad[0])
	case len(provoked) == 0:
		s.t.Logf("NATS (%s): no permissions violation in %d log lines", strings.Join(s.natsIDs, ", "), total)
	default:
		s.t.Logf("NATS (%s): no other permissions violation in %d log lines", strings.Join(s.natsIDs, ", "), total)
	}
}

// logLines returns a container's log, stdout and stderr, line by line.
func logLines(ctx context.Context, c *testcontainers.DockerContainer) ([]string, error) {
	rc, err := c.Logs(ctx)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	var lines []string
	sc := bufio.NewScanner(rc)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return lines, sc.Err()
}

// showLogs logs the last n lines of a container's log.
func showLogs(t *testing.T, name string, c *testcontainers.DockerContainer, n int) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lines, err := logLines(ctx, c)
	if err != nil {
		t.Logf("logs of %s: %v", name, err)
		return
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	t.Logf("--- last %d log lines of %s ---\n%s", len(lines), name, strings.Join(lines, "\n"))
}

// endpoint returns host:port of a container's port as mapped on this host.
func endpoint(t *testing.T, c *testcontainers.DockerContainer, port string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ep, err := c.PortEndpoint(ctx, port, "")
	if err != nil {
		t.Fatalf("mapped port %s: %v", port, err)
	}
	return ep
}

// lifecycle is what the tests check of a container that must survive a
// fault: still running, never restarted.
type lifecycle struct {
	running      bool
	startedAt    string
	restartCount int
}

func inspectLifecycle(t *testing.T, c *testcontainers.DockerContainer) lifecycle {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := docker.ContainerInspect(ctx, c.GetContainerID(), client.ContainerInspectOptions{})
	if err != nil {
		t.Fatalf("inspect %s: %v", c.GetContainerID(), err)
	}
	st := res.Container.State
	return lifecycle{running: st.Running, startedAt: st.StartedAt, restartCount: res.Container.RestartCount}
}

// requireSurvived fails unless c runs in the same process as before (same
// start time) and was never restarted.
func requireSurvived(t *testing.T, name string, c *testcontainers.DockerContainer, before lifecycle) {
	t.Helper()
	now := inspectLifecycle(t, c)
	if !now.running || now.startedAt != before.startedAt || now.restartCount != 0 {
		t.Errorf("%s did not survive: running=%v started %s (was %s) restarts=%d",
			name, now.running, now.startedAt, before.startedAt, now.restartCount)
		return
	}
	t.Logf("%s survived: running since %s, restart count 0", name, now.startedAt)
}

// kill sends SIGKILL: no goodbye, no final flush.
func kill(t *testing.T, name string, c *testcontainers.DockerContainer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := docker.ContainerKill(ctx, c.GetContainerID(), client.ContainerKillOptions{Signal: "KILL"}); err != nil {
		t.Fatalf("kill %s: %v", name, err)
	}
	t.Logf("killed %s (SIGKILL)", name)
}

// disconnect cuts a container from the stack's network.
func (s *stack) disconnect(name string, c *testcontainers.DockerContainer) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := docker.NetworkDisconnect(ctx, s.net.ID, client.NetworkDisconnectOptions{
		Container: c.GetContainerID(), Force: true}); err != nil {
		s.t.Fatalf("disconnect %s: %v", name, err)
	}
	s.t.Logf("cut %s from network %s", name, s.net.Name)
}

// reconnect puts a container back on the stack's network under its alias.
func (s *stack) reconnect(name string, c *testcontainers.DockerContainer) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := docker.NetworkConnect(ctx, s.net.ID, client.NetworkConnectOptions{
		Container: c.GetContainerID(), EndpointConfig: &mobynet.EndpointSettings{Aliases: []string{name}}}); err != nil {
		s.t.Fatalf("reconnect %s: %v", name, err)
	}
	s.t.Logf("reconnected %s to network %s", name, s.net.Name)
}

// waitFor polls cond every 100 ms until it holds or timeout passes; state
// describes what was seen, for the log. It returns how long it took.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	var state string
	for {
		var ok bool
		ok, state = cond()
		if ok {
			d := time.Since(start).Round(time.Millisecond)
			t.Logf("%s after %v: %s", what, d, state)
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("not %s within %v; last seen: %s", what, timeout, state)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("not %s: %v", what, t.Context().Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
