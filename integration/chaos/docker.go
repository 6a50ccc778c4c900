package main

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"
)

// Stack drives the chaos stack through the docker and compose command
// lines: the compose project up and down, and the faults on its
// containers.
type Stack struct {
	Docker  string   // the docker command
	Compose []string // the compose command: docker compose, or docker-compose
	File    string   // deploy/chaos/compose.yml
	Project string   // the compose project name

	mu  sync.Mutex
	ids map[string]string // service → container id
	net string            // the project's network
}

// cmdTimeout bounds each docker and compose command, so that a docker
// that hangs cannot wedge the run; upTimeout bounds compose up, which
// creates and starts several containers, and downTimeout compose down.
const (
	cmdTimeout  = time.Minute
	upTimeout   = 3 * time.Minute
	downTimeout = 2 * time.Minute
)

// compose runs a compose command of the project, bounded by timeout.
func (s *Stack) compose(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	full := append(append(append([]string(nil), s.Compose[1:]...), "-p", s.Project, "-f", s.File), args...)
	return runCmd(ctx, timeout, s.Compose[0], full...)
}

// docker runs a docker command.
func (s *Stack) docker(ctx context.Context, args ...string) (string, error) {
	return runCmd(ctx, cmdTimeout, s.Docker, args...)
}

// runCmd runs a command, killed when ctx ends or timeout passes.
func runCmd(ctx context.Context, timeout time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(lastLines(out.String(), 10)))
	}
	return out.String(), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Up starts the given services (all when none) and waits until each one's
// healthcheck passes.
func (s *Stack) Up(ctx context.Context, timeout time.Duration, services ...string) error {
	if _, err := s.compose(ctx, upTimeout, append([]string{"up", "-d", "--no-recreate"}, services...)...); err != nil {
		return err
	}
	return s.WaitHealthy(ctx, timeout, services...)
}

// WaitHealthy waits until each service's healthcheck passes.
func (s *Stack) WaitHealthy(ctx context.Context, timeout time.Duration, services ...string) error {
	deadline := time.Now().Add(timeout)
	for {
		pending, err := s.unhealthy(ctx, services)
		if err != nil {
			return err
		}
		if len(pending) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not healthy after %v: %s", timeout, strings.Join(pending, ", "))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// unhealthy returns the services among names that are not running and
// healthy yet.
func (s *Stack) unhealthy(ctx context.Context, names []string) ([]string, error) {
	var pending []string
	for _, name := range names {
		id, err := s.ID(ctx, name)
		if err != nil {
			return nil, err
		}
		out, err := s.docker(ctx, "inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}", id)
		if err != nil {
			return nil, err
		}
		st := strings.Fields(out)
		switch {
		case len(st) == 0:
			pending = append(pending, name+"(?)")
		case st[0] == "exited" || st[0] == "dead":
			logs, _ := s.docker(ctx, "logs", "--tail", "20", id)
			return nil, fmt.Errorf("%s is %s:\n%s", name, st[0], logs)
		case st[0] != "running" || len(st) > 1 && st[1] != "healthy":
			pending = append(pending, name+"("+strings.Join(st, " ")+")")
		}
	}
	return pending, nil
}

// ID returns the container of a service.
func (s *Stack) ID(ctx context.Context, service string) (string, error) {
	s.mu.Lock()
	id, ok := s.ids[service]
	s.mu.Unlock()
	if ok {
		return id, nil
	}
	out, err := s.compose(ctx, cmdTimeout, "ps", "-q", service)
	if err != nil {
		return "", err
	}
	id = strings.TrimSpace(out)
	if id == "" || strings.Contains(id, "\n") {
		return "", fmt.Errorf("service %s: no single container (%q)", service, id)
	}
	s.mu.Lock()
	if s.ids == nil {
		s.ids = map[string]string{}
	}
	s.ids[service] = id
	s.mu.Unlock()
	return id, nil
}

// Network returns the project's network, the one its containers are on.
func (s *Stack) Network(ctx context.Context, service string) (string, error) {
	s.mu.Lock()
	nw := s.net
	s.mu.Unlock()
	if nw != "" {
		return nw, nil
	}
	id, err := s.ID(ctx, service)
	if err != nil {
		return "", err
	}
	out, err := s.docker(ctx, "inspect", "-f", "{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}", id)
	if err != nil {
		return "", err
	}
	f := strings.Fields(out)
	if len(f) != 1 {
		return "", fmt.Errorf("%s is on networks %v, want one", service, f)
	}
	s.mu.Lock()
	s.net = f[0]
	s.mu.Unlock()
	return f[0], nil
}

// Signal sends a signal to a service's process (KILL, STOP, CONT).
func (s *Stack) Signal(ctx context.Context, service, sig string) error {
	return s.container(ctx, service, "kill", "--signal", sig)
}

// Stop stops a service's container (SIGTERM, then SIGKILL after 10 s).
func (s *Stack) Stop(ctx context.Context, service string) error {
	return s.container(ctx, service, "stop", "-t", "10")
}

// Start starts a stopped or killed service's container again.
func (s *Stack) Start(ctx context.Context, service string) error {
	return s.container(ctx, service, "start")
}

// container runs `docker args... <the service's container>`.
func (s *Stack) container(ctx context.Context, service string, args ...string) error {
	id, err := s.ID(ctx, service)
	if err != nil {
		return err
	}
	_, err = s.docker(ctx, append(args, id)...)
	return err
}

// Disconnect cuts a service from the project's network.
func (s *Stack) Disconnect(ctx context.Context, service string) error {
	return s.network(ctx, service, "disconnect", "--force")
}

// Connect puts a service back on the project's network under its name.
func (s *Stack) Connect(ctx context.Context, service string) error {
	return s.network(ctx, service, "connect", "--alias", service)
}

// network runs `docker network args... <the project's network> <the
// service's container>`.
func (s *Stack) network(ctx context.Context, service string, args ...string) error {
	id, err := s.ID(ctx, service)
	if err != nil {
		return err
	}
	nw, err := s.Network(ctx, service)
	if err != nil {
		return err
	}
	_, err = s.docker(ctx, slices.Concat([]string{"network"}, args, []string{nw, id})...)
	return err
}

// Logs returns the last n lines of a service's log.
func (s *Stack) Logs(ctx context.Context, service string, n int) string {
	id, err := s.ID(ctx, service)
	if err != nil {
		return err.Error()
	}
	out, err := s.docker(ctx, "logs", "--tail", fmt.Sprint(n), id)
	if err != nil {
		return err.Error()
	}
	return out
}

// Down removes the project: containers, network, volumes. It uses a
// context of its own, so that it runs after an interrupted run too.
func (s *Stack) Down() error {
	_, err := s.compose(context.Background(), downTimeout, "down", "-v", "--remove-orphans", "-t", "2")
	return err
}
