package bench

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/events"
)

// Names shared by the processes.
const (
	// sentinelModel is the model of the sentinel reports that end an
	// ingest round.
	sentinelModel = "bench/sentinel"
	// latencyModel is the model whose worker 1 flips for the latency.
	latencyModel = "bench/latency"
	// rawBucket is the bucket of the raw KV put → watch, made as the busy
	// bucket is; rawKey its key.
	rawBucket, rawKey = "workermon-bench", "k"
	// rawPrefix is the first token of the raw messages' subjects: as long
	// as the monitor's prefix, so that both carry subjects of the same
	// length.
	rawPrefix = "benchmark"
)

var _ = [1]int{}[len(rawPrefix)-len(events.DefaultSubjectPrefix)] // same length

// Roles of the children.
const (
	rolePublisher = "publisher"
	roleWatcher   = "watcher"
	roleMonitor   = "monitor"
)

// childOptions is what a child is told on its command line.
type childOptions struct {
	role                     string
	natsURL                  string
	reports, workers, models int
	cpuProfile               string
}

func (o *childOptions) args() []string {
	a := []string{"--role", o.role, "--nats", o.natsURL, "--reports", strconv.Itoa(o.reports),
		"--workers", strconv.Itoa(o.workers), "--models", strconv.Itoa(o.models)}
	if o.cpuProfile != "" {
		a = append(a, "--cpuprofile", o.cpuProfile)
	}
	return a
}

// RunChild is a child process of Run, told its role by args: the
// publisher or the watcher, which read commands from stdin and answer on
// stdout until stdin ends, or the monitor, profiled (serve is called with
// the arguments after "--", and runs until ctx ends).
func RunChild(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer,
	serve func(ctx context.Context, args []string) error) (err error) {
	var o childOptions
	fs := flag.NewFlagSet("bench child", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.role, "role", "", "publisher, watcher or monitor")
	fs.StringVar(&o.natsURL, "nats", "", "NATS URL")
	fs.IntVar(&o.reports, "reports", DefaultReports, "ingest reports")
	fs.IntVar(&o.workers, "workers", DefaultWorkers, "ingest workers")
	fs.IntVar(&o.models, "models", DefaultModels, "ingest models")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "file to write a CPU profile to")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return fmt.Errorf("bench: profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return fmt.Errorf("bench: profile: %w", err)
		}
		defer func() {
			pprof.StopCPUProfile()
			err = errors.Join(err, f.Close())
		}()
	}
	switch o.role {
	case roleMonitor:
		return serve(ctx, fs.Args())
	case rolePublisher, roleWatcher:
	default:
		return fmt.Errorf("bench: unknown role %q", o.role)
	}
	nc, err := nats.Connect(o.natsURL, nats.Name("workermon-bench-"+o.role))
	if err != nil {
		return fmt.Errorf("bench: %s: %w", o.role, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	var handle func(ctx context.Context, verb string, args []int) (int64, error)
	if o.role == rolePublisher {
		p, err := newPublisher(ctx, nc, js, o)
		if err != nil {
			return err
		}
		handle = p.handle
	} else {
		w, err := newWatcher(ctx, nc, js)
		if err != nil {
			return err
		}
		defer w.close()
		handle = w.handle
	}
	return serveCommands(ctx, stdin, stdout, handle)
}

// serveCommands answers each line of stdin, "verb n n ...", with "ok t"
// or "err message" on stdout, after a first line "ready".
func serveCommands(ctx context.Context, stdin io.Reader, stdout io.Writer,
	handle func(ctx context.Context, verb string, args []int) (int64, error)) error {
	out := bufio.NewWriter(stdout)
	reply := func(format string, a ...any) error {
		fmt.Fprintf(out, format+"\n", a...)
		return out.Flush()
	}
	if err := reply("ready"); err != nil {
		return err
	}
	sc := bufio.NewScanner(stdin)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		args := make([]int, 0, len(fields)-1)
		for _, f := range fields[1:] {
			n, err := strconv.Atoi(f)
			if err != nil {
				return fmt.Errorf("bench: command %q: %w", sc.Text(), err)
			}
			args = append(args, n)
		}
		t, err := handle(ctx, fields[0], args)
		if err != nil {
			if rerr := reply("err %s", strings.ReplaceAll(err.Error(), "\n", "; ")); rerr != nil {
				return rerr
			}
			continue
		}
		if err := reply("ok %d", t); err != nil {
			return err
		}
	}
	return sc.Err()
}
