package publisher_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/publisher"
	"github.com/workermon/workermon/registry"
)

func TestNewRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tests := []struct {
		name    string
		nilConn bool
		model   string
		opts    []publisher.Option
		also    error // a foreign sentinel the error must wrap too
	}{
		{name: "nil connection", nilConn: true, model: "m"},
		{name: "empty model", model: "", also: events.ErrInvalidModel},
		{name: "model not UTF-8", model: "\xff", also: events.ErrInvalidModel},
		{name: "model too long", model: strings.Repeat("m", events.MaxModelLen+1), also: events.ErrInvalidModel},
		{name: "nil option", model: "m", opts: []publisher.Option{nil}},
		{name: "no ranks", model: "m", opts: []publisher.Option{publisher.WithRanks(0, 0)}},
		{name: "ranks overflow", model: "m", opts: []publisher.Option{publisher.WithRanks(^uint32(0), 2)}},
		{name: "too many ranks", model: "m", opts: []publisher.Option{publisher.WithRanks(0, publisher.MaxRanks+1)}},
		{name: "empty source", model: "m", opts: []publisher.Option{publisher.WithSource("")},
			also: events.ErrInvalidSource},
		{name: "bad prefix", model: "m", opts: []publisher.Option{publisher.WithSubjectPrefix("a.*")},
			also: events.ErrInvalidSubject},
		{name: "nil logger", model: "m", opts: []publisher.Option{publisher.WithLogger(nil)}},
		{name: "nil clock", model: "m", opts: []publisher.Option{publisher.WithClock(nil)}},
		{name: "zero debounce", model: "m", opts: []publisher.Option{publisher.WithDebounce(0)}},
		{name: "negative debounce", model: "m", opts: []publisher.Option{publisher.WithDebounce(-time.Millisecond)}},
		{name: "zero heartbeat", model: "m", opts: []publisher.Option{publisher.WithHeartbeat(0)}},
		{name: "heartbeat over a second", model: "m",
			opts: []publisher.Option{publisher.WithHeartbeat(publisher.MaxHeartbeat + time.Millisecond)}},
		{name: "debounce not below heartbeat", model: "m",
			opts: []publisher.Option{publisher.WithHeartbeat(100 * time.Millisecond), publisher.WithDebounce(100 * time.Millisecond)}},
		{name: "endpoint without scheme", model: "m", opts: []publisher.Option{publisher.WithEndpoint("10.0.0.7:8000")}},
		{name: "endpoint ftp", model: "m", opts: []publisher.Option{publisher.WithEndpoint("ftp://h:21")}},
		{name: "endpoint with /v1", model: "m", opts: []publisher.Option{publisher.WithEndpoint("http://h:8000/v1/")}},
		{name: "endpoint with credentials", model: "m", opts: []publisher.Option{publisher.WithEndpoint("http://u:p@h")}},
		{name: "endpoint with query", model: "m", opts: []publisher.Option{publisher.WithEndpoint("http://h/?a=1")}},
		{name: "zero refresh", model: "m",
			opts: []publisher.Option{publisher.WithEndpoint("http://h"), publisher.WithRegistryRefresh(0)}},
		{name: "refresh not below TTL", model: "m",
			opts: []publisher.Option{publisher.WithEndpoint("http://h"), publisher.WithRegistryRefresh(registry.TTL)}},
		{name: "zero replicas", model: "m",
			opts: []publisher.Option{publisher.WithEndpoint("http://h"), publisher.WithRegistryReplicas(0)}},
		{name: "refresh without endpoint", model: "m", opts: []publisher.Option{publisher.WithRegistryRefresh(time.Second)}},
		{name: "block size 0", model: "m", opts: []publisher.Option{publisher.WithEndpoint("http://h"), publisher.WithBlockSize(0)}},
		{name: "block size without endpoint", model: "m", opts: []publisher.Option{publisher.WithBlockSize(16)}},
		{name: "replicas without endpoint", model: "m", opts: []publisher.Option{publisher.WithRegistryReplicas(3)}},
		{name: "router source with endpoint", model: "m",
			opts: []publisher.Option{publisher.WithSource("router/r1"), publisher.WithEndpoint("http://h")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			nc := e.pub
			if tt.nilConn {
				nc = nil
			}
			p, err := publisher.New(nc, tt.model, 1, tt.opts...)
			if !errors.Is(err, publisher.ErrInvalidConfig) {
				t.Fatalf("New = %v, want ErrInvalidConfig", err)
			}
			if tt.also != nil && !errors.Is(err, tt.also) {
				t.Errorf("New = %v, want it to wrap %v too", err, tt.also)
			}
			if p != nil {
				t.Errorf("New returned a Publisher with an error")
			}
		})
	}
}

// Every problem is reported, not only the first.
func TestNewReportsEveryProblem(t *testing.T) {
	t.Parallel()
	_, err := publisher.New(nil, "", 1, publisher.WithDebounce(0), publisher.WithHeartbeat(0))
	for _, want := range []string{"connection", "model", "debounce", "heartbeat"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New = %v, want it to mention %s", err, want)
		}
	}
}

func TestNewRejectsClosedConnection(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.pub.Close()
	if _, err := publisher.New(e.pub, "m", 1); !errors.Is(err, publisher.ErrInvalidConfig) {
		t.Errorf("New = %v, want ErrInvalidConfig", err)
	}
}

func TestNewAcceptsValidOptions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tests := []struct {
		name string
		opts []publisher.Option
	}{
		{name: "none"},
		{name: "all", opts: []publisher.Option{
			publisher.WithRanks(8, 8), publisher.WithSource(events.SourceEngine), publisher.WithSubjectPrefix("a.b"),
			publisher.WithDebounce(time.Millisecond), publisher.WithHeartbeat(publisher.MaxHeartbeat),
			publisher.WithClock(time.Now), publisher.WithEndpoint("https://engine.example:8443/prefix"),
			publisher.WithRegistryRefresh(time.Second), publisher.WithRegistryReplicas(1),
		}},
		{name: "router source", opts: []publisher.Option{publisher.WithSource("router/gw-1")}},
		{name: "last rank", opts: []publisher.Option{publisher.WithRanks(^uint32(0), 1)}},
		{name: "most ranks", opts: []publisher.Option{publisher.WithRanks(^uint32(0)-publisher.MaxRanks+1, publisher.MaxRanks)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p, err := publisher.New(e.pub, "m", 1, tt.opts...)
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			if err := p.Close(t.Context()); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
	}
}
