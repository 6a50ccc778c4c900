package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/natstest"
)

// TestNATSConfigMapsLikePartition loads what `workermon nats-config` prints
// into a real nats-server and checks that the server puts every report,
// goodbye, estimate and latency window of many models under the partition events.Partition
// computes locally.
func TestNATSConfigMapsLikePartition(t *testing.T) {
	t.Parallel()
	const parts = 7
	for _, account := range []string{"", "ENGINES"} {
		conf := natsConfig("wm", parts, account)
		if account != "" {
			// The printed block leaves the account's users to the operator.
			conf = strings.Replace(conf, "# ... the account's users and settings ...", `users: [{user: "e", password: "p"}]`, 1)
		}
		path := filepath.Join(t.TempDir(), "nats.conf")
		if err := os.WriteFile(path, []byte(conf+"\nlisten: \"127.0.0.1:-1\"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		opts, err := server.ProcessConfigFile(path)
		if err != nil {
			t.Fatalf("nats-server does not take the printed configuration: %v\n%s", err, conf)
		}
		opts.NoLog, opts.NoSigs, opts.Port = true, true, -1
		srv := natstest.Start(t, opts)
		var copts []nats.Option
		if account != "" {
			copts = append(copts, nats.UserInfo("e", "p"))
		}
		nc := natstest.Connect(t, srv, copts...)
		got := make(chan string, 1024)
		sub, err := nc.Subscribe("wm.part.>", func(m *nats.Msg) { got <- m.Subject })
		if err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		for i := range 200 {
			model := fmt.Sprintf("org/Model-%d.%d B", i, i*7)
			p := events.Partition(model, parts)
			for _, c := range []struct{ plain, mapped string }{
				{events.LoadSubject("wm", model, 42, 3), fmt.Sprintf("wm.part.%d.load.%s.42.3", p, events.ModelKey(model))},
				{events.ByeSubject("wm", model, 42), fmt.Sprintf("wm.part.%d.bye.%s.42", p, events.ModelKey(model))},
				{"wm.est." + events.ModelKey(model) + ".42.3", fmt.Sprintf("wm.part.%d.est.%s.42.3", p, events.ModelKey(model))},
				{events.LatSubject("wm", model, 42), fmt.Sprintf("wm.part.%d.lat.%s.42", p, events.ModelKey(model))},
				{events.LatrSubject("wm", model, 42), fmt.Sprintf("wm.part.%d.latr.%s.42", p, events.ModelKey(model))},
			} {
				if err := nc.Publish(c.plain, nil); err != nil {
					t.Fatal(err)
				}
				select {
				case s := <-got:
					if s != c.mapped {
						t.Fatalf("account %q: %s mapped to %s, want %s", account, c.plain, s, c.mapped)
					}
				case <-time.After(5 * time.Second):
					t.Fatalf("account %q: %s reached no partition subject", account, c.plain)
				}
			}
		}
		_ = sub.Unsubscribe()
	}
}

func TestNATSConfigOnePartition(t *testing.T) {
	t.Parallel()
	if out := natsConfig("wm", 1, ""); strings.Contains(out, "mappings") {
		t.Errorf("one partition needs no mapping, got:\n%s", out)
	}
}

// TestNATSConfigReadsEnvironment: like every command, nats-config takes
// each flag from its WORKERMON_ variable, so the monitors' exported
// WORKERMON_PARTITIONS prints their mapping.
func TestNATSConfigReadsEnvironment(t *testing.T) {
	t.Setenv("WORKERMON_PARTITIONS", "8")
	t.Setenv("WORKERMON_ACCOUNT", "ENGINES")
	code, stdout, stderr := runCheck("nats-config")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if want := natsConfig(events.DefaultSubjectPrefix, 8, "ENGINES"); stdout != want {
		t.Errorf("WORKERMON_PARTITIONS=8 WORKERMON_ACCOUNT=ENGINES workermon nats-config printed:\n%s\nwant:\n%s", stdout, want)
	}
}
