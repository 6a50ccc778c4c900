package main_test

import (
	"bufio"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDemoExitsClean runs the demo binary as a newcomer does, with its
// stdout into a pipe (`workermon demo | tee log`), and ends it each way a
// terminal can: Ctrl-C reaches the whole pipeline, so tee is gone and the
// pipe closed when the demo writes its last lines; the reader can also
// leave on its own (`| head`); SIGTERM; the terminal closing (SIGHUP). Every
// way, the demo exits 0 and its temporary JetStream store is gone.
func TestDemoExitsClean(t *testing.T) {
	t.Parallel()
	bin := wmBinary(t)
	for _, tc := range []struct {
		name     string
		closeOut bool      // close the pipe's reading end after the banner
		sig      os.Signal // then send this (nil: none)
	}{
		{"stdout closed then SIGINT", true, os.Interrupt},
		{"stdout closed", true, nil},
		{"SIGTERM", false, syscall.SIGTERM},
		{"SIGHUP", false, syscall.SIGHUP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tmp := t.TempDir()
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(bin, "demo", "--embedded-nats-addr", "127.0.0.1:0", "--monitor-addr", "127.0.0.1:0",
				"--router-addr", "127.0.0.1:0", "--workers", "1", "--max-rps", "5", "--interval", "200ms")
			cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
			cmd.Stdout = w
			var stderr syncBuf
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			w.Close() // the child holds the only writing end
			exited := make(chan struct{})
			go func() {
				_ = cmd.Wait() // the exit status is in cmd.ProcessState
				close(exited)
			}()
			t.Cleanup(func() {
				_ = cmd.Process.Kill()
				<-exited
			})

			// The reader: the banner, then gone or draining.
			banner := make(chan struct{})
			go func() {
				sc := bufio.NewScanner(r)
				for sc.Scan() {
					if strings.HasPrefix(sc.Text(), "Ctrl-C to stop") {
						break
					}
				}
				close(banner)
				if tc.closeOut {
					r.Close()
					return
				}
				_, _ = io.Copy(io.Discard, r)
				r.Close()
			}()
			select {
			case <-banner:
			case <-exited:
				t.Fatalf("the demo exited before its banner: %v\n%s", cmd.ProcessState, stderr.String())
			case <-time.After(60 * time.Second):
				t.Fatalf("no banner within 60 s:\n%s", stderr.String())
			}
			if tc.sig != nil {
				if err := cmd.Process.Signal(tc.sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
					t.Fatal(err)
				}
			}
			select {
			case <-exited:
			case <-time.After(30 * time.Second):
				t.Fatalf("the demo did not exit within 30 s:\n%s", stderr.String())
			}
			if st := cmd.ProcessState; st.ExitCode() != 0 {
				t.Errorf("exit %v, want 0:\n%s", st, stderr.String())
			}
			left, err := filepath.Glob(filepath.Join(tmp, "workermon-demo-*"))
			if err != nil {
				t.Fatal(err)
			}
			if len(left) > 0 {
				t.Errorf("the demo left its store behind: %v", left)
			}
		})
	}
}
