package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/workermon/workermon/internal/natstest"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/internal/syncbuf"
)

// leakSecret is in every password, token and credential the leak test
// gives; it must never be printed.
const leakSecret = "S3CR3T"

// leakToken is the token a NATS server of the test accepts.
const leakToken = "tok-" + leakSecret

// cliFlag is a flag as `-h` lists it.
type cliFlag struct{ name, typ, usage string }

// invocation is a command line that takes flags: a command, or a command
// and its subcommand.
type invocation struct {
	args  []string
	flags []cliFlag
}

func (inv invocation) String() string { return strings.Join(inv.args, " ") }

func (inv invocation) has(name string) bool {
	return slices.ContainsFunc(inv.flags, func(f cliFlag) bool { return f.name == name })
}

// flagLine is a flag in PrintDefaults' output: "  -name type" or "  -name"
// (a bool); its usage is on the next line.
var flagLine = regexp.MustCompile(`^  -([a-z0-9-]+)(?: (\S+))?$`)

// help runs args -h and returns the flags it lists and its whole text.
func help(t *testing.T, args ...string) ([]cliFlag, string) {
	t.Helper()
	var stdout, stderr syncbuf.Buffer
	if code := run(append(args, "-h"), &stdout, &stderr); code != 0 {
		return nil, stdout.String() + stderr.String()
	}
	var flags []cliFlag
	lines := strings.Split(stderr.String(), "\n")
	for i, l := range lines {
		m := flagLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		f := cliFlag{name: m[1], typ: m[2]}
		if i+1 < len(lines) {
			f.usage = strings.TrimSpace(lines[i+1])
		}
		flags = append(flags, f)
	}
	return flags, stdout.String() + stderr.String()
}

// subcommandsIn finds the subcommands a command's usage names
// (`workermon slo <get|set|delete>`) or its summary (`bench goodput: ...`).
func subcommandsIn(c command, usage string) []string {
	var subs []string
	for _, m := range regexp.MustCompile(`workermon `+regexp.QuoteMeta(c.name)+` <([a-z-]+(?:\|[a-z-]+)+)>`).FindAllStringSubmatch(usage, -1) {
		subs = append(subs, strings.Split(m[1], "|")...)
	}
	for _, m := range regexp.MustCompile(`\b`+regexp.QuoteMeta(c.name)+` ([a-z-]+):`).FindAllStringSubmatch(c.summary, -1) {
		subs = append(subs, m[1])
	}
	slices.Sort(subs)
	return slices.Compact(subs)
}

// invocations returns every command and subcommand of workermon that
// takes flags, with its flags, from their own -h.
func invocations(t *testing.T) []invocation {
	t.Helper()
	var out []invocation
	for _, c := range commands() {
		flags, usage := help(t, c.name)
		if len(flags) > 0 {
			out = append(out, invocation{args: []string{c.name}, flags: flags})
		}
		for _, sub := range subcommandsIn(c, usage) {
			if flags, _ := help(t, c.name, sub); len(flags) > 0 {
				out = append(out, invocation{args: []string{c.name, sub}, flags: flags})
			}
		}
	}
	return out
}

// The kinds of flag the leak test gives a secret to.
const (
	kindNone       = ""
	kindURL        = "URL"         // user info of a URL
	kindSecret     = "secret"      // the value itself
	kindSecretFile = "secret file" // what the named file holds
)

var (
	// "token" alone is no secret here: LLMs count tokens.
	secretUsage = regexp.MustCompile(`(?i)\b(password|secret)s?\b|\b(auth\w*|bearer|access|api) token`)
	// Not "seed" alone: --seed seeds the arrivals.
	secretFileUsage = regexp.MustCompile(`(?i)\b(credentials|creds|nkey|key)\b`)
	urlUsage        = regexp.MustCompile(`URL|[a-z]+://`)
)

// flagKind says what a flag holds by its name and usage, so that a new URL
// or credential flag is covered without naming it here.
func flagKind(f cliFlag) string {
	switch {
	case f.typ == "": // a bool
		return kindNone
	case redact.Secret(f.name) || secretUsage.MatchString(f.usage):
		return kindSecret
	case secretFileUsage.MatchString(f.usage) || strings.Contains(f.name, "creds") || strings.HasSuffix(f.name, "key"):
		return kindSecretFile
	case urlUsage.MatchString(f.usage) || strings.Contains(f.name, "url"):
		return kindURL
	}
	return kindNone
}

// scheme returns the scheme a URL flag wants.
func scheme(f cliFlag) string {
	if strings.Contains(f.name, "nats") {
		return "nats"
	}
	return "http"
}

// unreachable is an address where nothing listens.
const unreachable = "127.0.0.1:1"

// leakRequired are the flags a command needs to get past its validation
// to where it would connect; flags not listed here get the defaults of
// baseArgs.
var leakRequired = map[string][]string{
	"scrape":           {"--engine", "vllm", "--worker-id", "1", "--model", "m"},
	"sim":              {"--workers", "1"},
	"slots":            {"--from-registry", "--publish"},
	"load":             {"--rps", "5"},
	"cordon":           {"--model", "m", "--worker-id", "1"},
	"uncordon":         {"--model", "m", "--worker-id", "1"},
	"thresholds set":   {"--model", "m", "--active-decode-blocks-threshold", "0.8"},
	"thresholds unset": {"--model", "m"},
	"slo set":          {"--model", "m", "--itl-ms", "50"},
	"slo delete":       {"--model", "m"},
}

// leakEnv is what the leak test's command lines point at.
type leakEnv struct {
	nats       string // a NATS server without authentication
	authNATS   string // host:port of a NATS server that wants leakToken
	secretFile string // a credentials file
}

// baseArgs returns a command line of inv that binds only free ports: NATS
// URL flags at a server without authentication, the other URL flags at an
// unreachable address, every listen address on port 0, debug logs.
func baseArgs(t *testing.T, inv invocation, env leakEnv) []string {
	args := slices.Clone(inv.args)
	for _, f := range inv.flags {
		switch {
		case flagKind(f) == kindURL && scheme(f) == "nats":
			args = append(args, "--"+f.name, env.nats)
		case flagKind(f) == kindURL:
			args = append(args, "--"+f.name, scheme(f)+"://"+unreachable)
		case strings.HasSuffix(f.name, "-addr"):
			args = append(args, "--"+f.name, "127.0.0.1:0")
		case f.name == "data-dir":
			args = append(args, "--"+f.name, t.TempDir())
		case f.name == "log-level":
			args = append(args, "--log-level", "debug")
		}
	}
	return append(args, leakRequired[inv.String()]...)
}

// leakCase is one command line with a secret in it.
type leakCase struct {
	name     string
	args     []string
	refused  bool // --check must exit 2
	check    bool
	code     int
	out, err string
}

// leakCases returns the command lines that give f of inv a secret.
func leakCases(t *testing.T, inv invocation, f cliFlag, env leakEnv) []leakCase {
	base := baseArgs(t, inv, env)
	var values []struct {
		what, v string
		refused bool
	}
	add := func(what, v string, refused bool) {
		values = append(values, struct {
			what, v string
			refused bool
		}{what, v, refused})
	}
	switch flagKind(f) {
	case kindURL:
		s := scheme(f)
		add("unparsable URL with a password", s+"://user:"+leakSecret+"@host:42x22", true)
		add("unparsable URL with a token", s+"://"+leakSecret+"@host:42x22", true)
		add("unreachable URL with a password", s+"://user:"+leakSecret+"@"+unreachable, false)
		add("unreachable URL with a token", s+"://"+leakSecret+"@"+unreachable, false)
		if s == "nats" {
			add("rejected URL with a password", s+"://user:"+leakSecret+"@"+env.authNATS, false)
			add("rejected URL with a token", s+"://"+leakSecret+"@"+env.authNATS, false)
			add("accepted URL with a token", s+"://"+leakToken+"@"+env.authNATS, false)
			add("server list", s+"://"+unreachable+", "+s+"://user:"+leakSecret+"@host:42x22", true)
			add("scheme-less", "user:"+leakSecret+"@"+unreachable, false)
		}
	case kindSecret:
		add("secret", leakToken, false)
		// A NATS credential goes to a server that wants a token: it
		// accepts --nats-token, rejects a password.
		if strings.HasPrefix(f.name, "nats-") && inv.has("nats-url") {
			base = append(base, "--nats-url", "nats://"+env.authNATS)
		}
		// A password goes with its user (--nats-password, --nats-user).
		if user := strings.TrimSuffix(f.name, "password") + "user"; strings.HasSuffix(f.name, "password") && inv.has(user) {
			base = append(base, "--"+user, "u")
		}
	case kindSecretFile:
		add("file", env.secretFile, false)
		// A file that goes with another (--nats-tls-cert with --nats-tls-key).
		for _, g := range inv.flags {
			if g.name != f.name && (strings.Contains(g.usage, "--"+f.name) || strings.Contains(f.usage, "--"+g.name)) {
				base = append(base, "--"+g.name, env.secretFile)
			}
		}
	}
	var out []leakCase
	for _, v := range values {
		args := append(slices.Clone(base), "--"+f.name, v.v)
		out = append(out,
			leakCase{name: fmt.Sprintf("%s --%s %s", inv, f.name, v.what), args: args},
			leakCase{name: fmt.Sprintf("%s --%s %s --check", inv, f.name, v.what), args: append(slices.Clone(args), "--check"),
				refused: v.refused, check: true})
	}
	return out
}

// TestNoCommandShowsSecrets runs every command and subcommand of
// workermon in this process, for every flag that its name or usage marks
// as a URL or a credential, with a secret in it: URLs that do not parse
// and URLs that parse but reach nothing, with a password or a token as the
// user; tokens and passwords; files full of secrets. With and without
// --check, the secret must be neither on stdout nor on stderr (the logs,
// at debug). The flags are found from each command's -h, so a new one is
// covered.
func TestNoCommandShowsSecrets(t *testing.T) {
	plain := natstest.Start(t, natstest.Options(t))
	authOpts := natstest.Options(t)
	authOpts.Authorization = leakToken
	auth := natstest.Start(t, authOpts)
	env := leakEnv{nats: plain.ClientURL(), authNATS: strings.TrimPrefix(auth.ClientURL(), "nats://")}

	dir := t.TempDir()
	env.secretFile = filepath.Join(dir, "user.creds")
	content := "-----BEGIN NATS USER JWT-----\neyJ" + leakSecret + "\n------END NATS USER JWT------\n\n" +
		"-----BEGIN USER NKEY SEED-----\nSUA" + leakSecret + "\n------END USER NKEY SEED------\n"
	if err := os.WriteFile(env.secretFile, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}

	invs := invocations(t)
	var cases []leakCase
	covered := map[string]string{}
	for _, inv := range invs {
		for _, f := range inv.flags {
			if k := flagKind(f); k != kindNone {
				covered[f.name] = k
				cases = append(cases, leakCases(t, inv, f, env)...)
			}
		}
	}
	// The discovery must find at least these; more is fine.
	for name, kind := range map[string]string{
		"nats-url": kindURL, "monitor-url": kindURL, "metrics-url": kindURL, "endpoint": kindURL, "target": kindURL, "url": kindURL,
		"nats-password": kindSecret, "nats-token": kindSecret, "admin-token": kindSecret,
		"nats-creds": kindSecretFile, "nats-nkey": kindSecretFile, "nats-tls-key": kindSecretFile,
	} {
		if covered[name] != kind {
			t.Errorf("flag --%s found as %q, want %q", name, covered[name], kind)
		}
	}
	for _, name := range []string{"serve", "router", "sim", "watch", "slots", "scrape", "load", "status", "thresholds set",
		"slo set", "cordon", "uncordon", "healthcheck"} {
		if !slices.ContainsFunc(invs, func(inv invocation) bool { return inv.String() == name }) {
			t.Errorf("command %q not found", name)
		}
	}
	t.Logf("%d command lines over %d commands and subcommands", len(cases), len(invs))

	// Most runs wait on an address where nothing answers until their
	// context ends: run them side by side.
	const runFor = 1500 * time.Millisecond
	byName := map[string]command{}
	for _, c := range commands() {
		byName[c.name] = c
	}
	sem := make(chan struct{}, 32)
	var wg sync.WaitGroup
	for i := range cases {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			c := &cases[i]
			ctx, cancel := context.WithTimeout(t.Context(), runFor)
			defer cancel()
			var stdout, stderr syncbuf.Buffer
			c.code = runCommand(ctx, byName[c.args[0]], c.args[1:], &stdout, &stderr)
			c.out, c.err = stdout.String(), stderr.String()
		})
	}
	wg.Wait()

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if strings.Contains(c.out, leakSecret) || strings.Contains(c.err, leakSecret) {
				t.Errorf("workermon %s\nexit %d, shows the secret:\nstdout:\n%s\nstderr:\n%s",
					strings.Join(c.args, " "), c.code, c.out, c.err)
			}
			if c.refused && c.code != 2 {
				t.Errorf("workermon %s: exit %d, want 2 (refused)\nstderr:\n%s", strings.Join(c.args, " "), c.code, c.err)
			}
		})
	}
}
