package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
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
// goodbye, estimate, latency window and router queue (contract §22) of many models under the partition events.Partition
// computes locally.
func TestNATSConfigMapsLikePartition(t *testing.T) {
	t.Parallel()
	const parts = 7
	for _, account := range []string{"", "ENGINES"} {
		conf := natsConfig("wm", parts, account, false)
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
				{events.RqSubject("wm", model), fmt.Sprintf("wm.part.%d.rq.%s", p, events.ModelKey(model))},
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
	if out := natsConfig("wm", 1, "", false); strings.Contains(out, "mappings") {
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
	if want := natsConfig(events.DefaultSubjectPrefix, 8, "ENGINES", false); stdout != want {
		t.Errorf("WORKERMON_PARTITIONS=8 WORKERMON_ACCOUNT=ENGINES workermon nats-config printed:\n%s\nwant:\n%s", stdout, want)
	}
}

// TestNATSConfigUsers loads what `workermon nats-config --users` prints
// into a real nats-server and publishes, as each role's user, on every
// subject kind: the server lets through exactly the role's own kinds
// (engines: load, bye, lat; routers: est, latr and rq, contract §22;
// monitors: none of them, only the migrate requests), on the plain
// subjects and, with partitions, through the mappings; the monitor's user
// hears them all.
func TestNATSConfigUsers(t *testing.T) {
	passwords := map[string]string{"monitor": "m-pw", "router": "r-pw", "engine": "e-pw"}
	for user, pw := range passwords {
		t.Setenv("WORKERMON_NATS_"+strings.ToUpper(user)+"_PASSWORD", pw)
	}
	const model = "org/Model-1.5 B"
	kinds := []struct{ kind, subject string }{
		{"load", events.LoadSubject("wm", model, 42, 3)},
		{"bye", events.ByeSubject("wm", model, 42)},
		{"est", events.EstSubject("wm", model, 42, 3)},
		{"est.bye", events.EstByeSubject("wm", model, 42)},
		{"lat", events.LatSubject("wm", model, 42)},
		{"latr", events.LatrSubject("wm", model, 42)},
		{"rq", events.RqSubject("wm", model)},
		{"migrate", "wm.migrate." + events.ModelKey(model) + ".42"},
	}
	want := map[string][]string{
		"engine":  {"load", "bye", "lat"},
		"router":  {"est", "est.bye", "latr", "rq"},
		"monitor": {"migrate"},
	}
	for _, tc := range []struct {
		parts   int
		account string
	}{{1, ""}, {7, ""}, {7, "WM"}} {
		t.Run(fmt.Sprintf("%d partitions, account %q", tc.parts, tc.account), func(t *testing.T) {
			conf := natsConfig("wm", tc.parts, tc.account, true)
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
			if _, err := nats.Connect(srv.ClientURL(), nats.UserInfo("router", "wrong")); err == nil {
				t.Fatal("a wrong password connects")
			}
			got := make(chan *nats.Msg, 64)
			mon := natstest.Connect(t, srv, nats.UserInfo("monitor", passwords["monitor"]))
			if _, err := mon.ChanSubscribe("wm.>", got); err != nil {
				t.Fatal(err)
			}
			if err := mon.Flush(); err != nil {
				t.Fatal(err)
			}
			for _, user := range []string{"engine", "router", "monitor"} {
				denied := make(chan error, len(kinds))
				nc := natstest.Connect(t, srv, nats.UserInfo(user, passwords[user]),
					nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { denied <- err }))
				for _, k := range kinds {
					if err := nc.Publish(k.subject, []byte(k.kind)); err != nil {
						t.Fatal(err)
					}
				}
				// The last one of the user's own kinds marks the end: one
				// connection's messages arrive in order.
				last := want[user][len(want[user])-1]
				var heard []string
				for done := false; !done; {
					select {
					case m := <-got:
						heard = append(heard, string(m.Data))
						done = string(m.Data) == last
						if tc.parts > 1 && string(m.Data) != "migrate" && !strings.HasPrefix(m.Subject, "wm.part.") {
							t.Errorf("%s: %s reached the monitor unmapped (%s)", user, m.Data, m.Subject)
						}
					case <-time.After(10 * time.Second):
						t.Fatalf("%s: the monitor heard %q, and not %s", user, heard, last)
					}
				}
				slices.Sort(heard)
				w := slices.Sorted(slices.Values(want[user]))
				if !slices.Equal(heard, w) {
					t.Errorf("%s may publish %q, want %q", user, heard, w)
				}
				if n := len(kinds) - len(want[user]); n > 0 {
					select {
					case err := <-denied:
						if !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
							t.Errorf("%s: %v, want a permissions violation", user, err)
						}
					case <-time.After(10 * time.Second):
						t.Errorf("%s: no permissions violation reported", user)
					}
				}
			}
		})
	}
}

// TestComposeUsersMatchNATSConfig: the users of the compose stack
// (deploy/nats/compose.conf) have the permissions `workermon nats-config
// --users` gives their role (one partition, the default prefix), each
// engine's narrowed to its own worker id: the two lists cannot drift
// apart (the compose routers lacked the rq subjects of contract §22).
func TestComposeUsersMatchNATSConfig(t *testing.T) {
	for _, v := range []string{"ENGINE_1", "ENGINE_2", "ENGINE_3", "ENGINE_4", "ROUTER", "MONITOR"} {
		t.Setenv("WORKERMON_NATS_"+v+"_PASSWORD", "pw")
	}
	opts, err := server.ProcessConfigFile(filepath.Join("..", "..", "deploy", "nats", "compose.conf"))
	if err != nil {
		t.Fatal(err)
	}
	roles := natsRoles(events.DefaultSubjectPrefix, 1)
	want := map[string]natsRole{"monitor": roles[0], "router": roles[1]}
	for id := 1; id <= 4; id++ {
		want[fmt.Sprintf("engine-%d", id)] = engineRole(events.DefaultSubjectPrefix, 1, fmt.Sprint(id))
	}
	if len(opts.Users) != len(want) {
		t.Errorf("%d users in compose.conf, want %d", len(opts.Users), len(want))
	}
	for _, u := range opts.Users {
		w, ok := want[u.Username]
		if !ok {
			t.Errorf("compose.conf has a user %q of no role", u.Username)
			continue
		}
		checkPermissions(t, "compose.conf "+u.Username, u.Permissions, w)
	}
}

// checkPermissions compares a user's permissions, as nats-server parsed
// them, with a role's lists (as sets).
func checkPermissions(t *testing.T, who string, p *server.Permissions, want natsRole) {
	t.Helper()
	if p == nil || p.Publish == nil || p.Subscribe == nil {
		t.Errorf("%s: permissions %+v, want publish and subscribe lists", who, p)
		return
	}
	for _, c := range []struct {
		what      string
		got, want []string
	}{
		{"publish", p.Publish.Allow, want.publish},
		{"subscribe", p.Subscribe.Allow, want.subscribe},
	} {
		if got, w := slices.Sorted(slices.Values(c.got)), slices.Sorted(slices.Values(c.want)); !slices.Equal(got, w) {
			t.Errorf("%s may %s\n  %q\nwant\n  %q", who, c.what, got, w)
		}
	}
	if (p.Response != nil) != want.allowResponses {
		t.Errorf("%s: allow_responses %v, want %v", who, p.Response != nil, want.allowResponses)
	}
}
