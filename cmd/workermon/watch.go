package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/natsconn"
	"github.com/workermon/workermon/watch"
)

// watchOptions is everything `workermon watch` can be told.
type watchOptions struct {
	natsURL string
	nats    natsconn.Config
	model   string
	plain   bool
	// monitorURL, when set, is the monitor's API whose GET /loads gives
	// the workers' leading values (contract §21).
	monitorURL string
	watch      watch.Config
	log        logOptions
}

func defaultWatchOptions() watchOptions {
	o := watchOptions{natsURL: natsconn.DefaultURL, nats: natsconn.DefaultConfig(), watch: watch.DefaultConfig(),
		log: defaultLogOptions()}
	o.nats.Name = "workermon-watch"
	return o
}

func (o *watchOptions) flags(fs *flag.FlagSet) {
	natsFlags(fs, &o.natsURL, &o.nats)
	fs.StringVar(&o.model, "model", o.model, "show only this model")
	fs.BoolVar(&o.plain, "plain", o.plain, "one line per change even on a terminal (the default when the output is not one)")
	fs.DurationVar(&o.watch.StaleAfter, "stale-list-after", o.watch.StaleAfter,
		"on the screen, mark a record not written for this long stale, as the routers do")
	fs.StringVar(&o.monitorURL, "monitor-url", o.monitorURL,
		"base URL of a monitor's API (e.g. "+DefaultMonitorURL+"): read its GET /loads every second to show each worker's queue delay, prefill and preemption rates; empty: the bucket alone")
	o.log.flags(fs)
}

// validate checks the model, the watch's and the NATS client's
// configuration, and sets the latter's URL.
func (o *watchOptions) validate() error {
	var errs []error
	if o.model != "" {
		if err := events.ValidateModel(o.model); err != nil {
			errs = append(errs, fmt.Errorf("--model: %v", err))
		}
	}
	// The bucket and the output come with the start: stand-ins let
	// Validate check the rest (--stale-list-after).
	w := o.watch
	w.JetStream, w.Out, w.Model = jetstreamStandIn{}, io.Discard, ""
	if err := w.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--stale-list-after: %w", err))
	}
	if _, err := o.loadsClient(); err != nil {
		errs = append(errs, err)
	}
	o.nats.URL = o.natsURL
	errs = append(errs, o.nats.Validate())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// loadsClient returns the client of the monitor's API given by
// --monitor-url, nil without one. GET /loads needs no admin token; a URL's
// credentials are hidden in every error (the client redacts).
func (o *watchOptions) loadsClient() (*api.Client, error) {
	if o.monitorURL == "" {
		return nil, nil
	}
	c, err := api.NewClient(o.monitorURL, "", &http.Client{Timeout: o.watch.LoadsTimeout})
	if err != nil {
		return nil, fmt.Errorf("--monitor-url: %w", err)
	}
	return c, nil
}

// watchLoadsHint is the screen's line, without --monitor-url, that says
// how to get the leading values.
const watchLoadsHint = "queue delay, prefill and preemption rates per worker: add --monitor-url " + DefaultMonitorURL +
	" (the monitor's API) or set " + envPrefix + "MONITOR_URL"

// jetstreamStandIn stands for the watch's JetStream before it connects.
type jetstreamStandIn struct{ jetstream.JetStream }

// runWatch is `workermon watch`: the busy-set bucket as it changes, redrawn
// in place on a terminal, one line per change otherwise.
func runWatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := defaultWatchOptions()
	log, check, err := parseCommand("watch", args, stderr, natsURLEnv, o.flags, &o.log)
	if err != nil {
		return err
	}
	if err := o.validate(); err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	// Logs the server's version once connected, as every command does.
	nc, err := natsconn.Connect(ctx, o.nats, log.With("component", "nats"))
	if errors.Is(err, natsconn.ErrUnauthorized) {
		return fmt.Errorf("%w\n%s", err, watchAuthHint(o.nats))
	}
	if err != nil {
		return err
	}
	defer nc.Close()
	cctx, cancel := context.WithTimeout(ctx, serverCheckTimeout)
	err = natsconn.CheckServer(cctx, nc)
	cancel()
	if err != nil {
		return err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("watch: jetstream: %w", err)
	}
	cfg := o.watch
	cfg.JetStream, cfg.Out, cfg.Model = js, stdout, o.model
	cfg.Logger = log.With("component", "watch")
	cfg.Header = natsconn.ConnectedURL(nc) + " (nats-server " + nc.ConnectedServerVersion() + ")"
	c, err := o.loadsClient()
	if err != nil {
		return err // validated above
	}
	if c != nil {
		cfg.Loads, cfg.LoadsFrom = c.Loads, redact.URL(o.monitorURL)
	} else {
		cfg.Hint = watchLoadsHint
	}
	if f, ok := stdout.(*os.File); ok && !o.plain && isTerminal(f) && os.Getenv("TERM") != "dumb" {
		cfg.Mode = watch.Screen
		// https://no-color.org: a set NO_COLOR turns colours off.
		_, noColor := os.LookupEnv("NO_COLOR")
		cfg.Color = !noColor
		cfg.Size = func() (int, int) { return terminalSize(f) }
	}
	return watch.Run(ctx, cfg)
}

// watchAuthHint says what to try when the server refused the connection:
// which credentials the watch needs, and the user of the compose stack that
// has them.
func watchAuthHint(c natsconn.Config) string {
	var b strings.Builder
	if c.CredsFile == "" && c.NKeyFile == "" && c.User == "" && c.Token == "" && !strings.Contains(c.URL, "@") {
		b.WriteString("  The server wants credentials: give those of a user that may read the " + events.BusyBucket + " bucket,\n" +
			"  as a router's may, with --nats-user and --nats-password (or WORKERMON_NATS_USER and WORKERMON_NATS_PASSWORD),\n" +
			"  --nats-creds, --nats-nkey or --nats-token.\n")
	} else {
		b.WriteString("  The server refused the credentials given")
		if c.User != "" {
			fmt.Fprintf(&b, " (user %q)", c.User)
		}
		b.WriteString(": check them; the user must be one that may read the " + events.BusyBucket + " bucket, as a router's may.\n")
	}
	b.WriteString("  Against the docker compose stack: --nats-user router --nats-password router-demo-password\n" +
		"  (or the WORKERMON_NATS_ROUTER_PASSWORD you set for it; docs/operations.md, `workermon watch`).")
	return b.String()
}

// isTerminal reports whether f is a terminal (a character device).
func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
