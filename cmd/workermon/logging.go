package main

import (
	"flag"
	"fmt"
	"io"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// logOptions are the logging flags every long-running command has.
type logOptions struct {
	level  string
	format string
}

func defaultLogOptions() logOptions { return logOptions{level: "info", format: "text"} }

func (o *logOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.level, "log-level", o.level, "debug, info, warn or error")
	fs.StringVar(&o.format, "log-format", o.format, "text or json")
}

func (o logOptions) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.level)); err != nil {
		return nil, fmt.Errorf("%w: --log-level %q: want debug, info, warn or error", errUsage, o.level)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch o.format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("%w: --log-format %q: want text or json", errUsage, o.format)
}

// newRegistry returns the metrics registry of a process, with the Go and
// process collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
