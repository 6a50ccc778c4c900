package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// stopTimeout bounds a child's clean exit before it is killed.
const stopTimeout = 15 * time.Second

// proc is a child process and its command pipe.
type proc struct {
	role  string
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	done  chan struct{}
	err   error // of Wait, once done is closed
}

func start(ctx context.Context, cfg Config, role string, args []string) (*proc, error) {
	cmd := exec.Command(cfg.Executable, args...)
	cmd.Stderr = cfg.Stderr
	cmd.SysProcAttr = sysProcAttr()
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrChild, role, err)
	}
	p := &proc{role: role, cmd: cmd, in: in, lines: make(chan string, 16), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	go func() { // a cancelled run stops its children
		select {
		case <-ctx.Done():
			_ = cmd.Process.Signal(syscall.SIGTERM)
		case <-p.done:
		}
	}()
	return p, nil
}

// line returns the next line the child writes.
func (p *proc) line(timeout time.Duration) (string, error) {
	select {
	case l, ok := <-p.lines:
		if !ok {
			<-p.done
			return "", fmt.Errorf("%s exited: %v", p.role, p.err)
		}
		return l, nil
	case <-time.After(timeout):
		return "", fmt.Errorf("%s: no answer within %v", p.role, timeout)
	}
}

// call sends a command and returns the number it answers.
func (p *proc) call(command string, timeout time.Duration) (int64, error) {
	if _, err := io.WriteString(p.in, command+"\n"); err != nil {
		return 0, fmt.Errorf("%w: %s: %s: %w", ErrChild, p.role, command, err)
	}
	line, err := p.line(timeout)
	if err != nil {
		return 0, fmt.Errorf("%w: %s: %w", ErrChild, command, err)
	}
	if msg, ok := strings.CutPrefix(line, "err "); ok {
		return 0, fmt.Errorf("%w: %s: %s: %s", ErrChild, p.role, command, msg)
	}
	n, err := strconv.ParseInt(strings.TrimPrefix(line, "ok "), 10, 64)
	if err != nil || !strings.HasPrefix(line, "ok ") {
		return 0, fmt.Errorf("%w: %s: %s: answered %q", ErrChild, p.role, command, line)
	}
	return n, nil
}

// stop ends the child: its stdin closes (the publisher and the watcher
// end), SIGTERM (the monitor), then SIGKILL after stopTimeout. It returns
// the child's exit error, once.
func (p *proc) stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.in.Close()
	if p.role == roleMonitor {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%w: %s did not stop within %v", ErrChild, p.role, stopTimeout)
	}
	if p.err != nil {
		return fmt.Errorf("%w: %s: %w", ErrChild, p.role, p.err)
	}
	return nil
}
