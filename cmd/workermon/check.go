package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strings"
	"time"
)

// checkFlag is the flag every command has (contract §19): parse and
// validate the flags and the environment as a start would, print the
// configuration as one JSON object and exit 0, or exit 2 with the reason.
// It connects nowhere, binds no port, starts no embedded server and creates
// no directory. It is never read from the environment: a WORKERMON_CHECK
// left in a pod's environment would make every start a check.
const checkFlag = "check"

// redacted stands for a secret in a check's output.
const redacted = "<redacted>"

// checkRequest is the --check of one command.
type checkRequest struct {
	on   bool
	name string
	fs   *flag.FlagSet
}

// newCheck registers --check on fs for the command name.
func newCheck(fs *flag.FlagSet, name string) *checkRequest {
	c := &checkRequest{name: name, fs: fs}
	fs.BoolVar(&c.on, checkFlag, false,
		"validate the flags and environment, print the configuration as JSON (secrets redacted) and exit: 0 valid, 2 not; connects nowhere, binds nothing")
	return c
}

// checkReport is what --check prints.
type checkReport struct {
	Command string `json:"command"`
	Valid   bool   `json:"valid"`
	// Flags holds every flag's value as the command would run with it:
	// from the command line, else the environment, else the default.
	Flags map[string]any `json:"flags"`
	// Resolved holds values the command derives from its flags.
	Resolved map[string]any `json:"resolved,omitempty"`
}

// report ends a check: an invalid configuration (err) is a usage error
// (exit 2); a valid one is printed to stdout. resolved adds derived values,
// redacted by the caller.
func (c *checkRequest) report(stdout io.Writer, err error, resolved map[string]any) error {
	if err != nil {
		if errors.Is(err, errUsage) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	r := checkReport{Command: c.name, Valid: true, Flags: checkFlags(c.fs), Resolved: resolved}
	enc := json.NewEncoder(stdout)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// checkFlags returns the value of every flag of fs but --check, secrets
// redacted: typed where the flag says its type, a string otherwise (null
// for an optional flag left unset).
func checkFlags(fs *flag.FlagSet) map[string]any {
	out := map[string]any{}
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name == checkFlag {
			return
		}
		var v any
		if g, ok := f.Value.(flag.Getter); ok {
			v = g.Get()
		} else if s := f.Value.String(); s != "" {
			v = s
		}
		switch t := v.(type) {
		case time.Duration:
			v = t.String()
		case string:
			v = redactValue(f.Name, t)
		}
		out[f.Name] = v
	})
	return out
}

// secretFlag reports whether the flag name carries a secret itself: its
// last word is password, token or secret (--nats-password, --admin-token;
// not --active-prefill-tokens-threshold). A file that holds one is shown as
// its path (--nats-creds, --nats-tls-key), never what it holds.
func secretFlag(name string) bool {
	last := name[strings.LastIndex(name, "-")+1:]
	return last == "password" || last == "token" || last == "secret"
}

// redactValue hides a secret flag's value, and the password of every URL in
// a URL flag's value (comma-separated lists too).
func redactValue(name, v string) string {
	if v == "" {
		return v
	}
	if secretFlag(name) {
		return redacted
	}
	if strings.Contains(name, "url") {
		return redactURLs(v)
	}
	return v
}

// redactURLs replaces the password, or a token given as the user, of each
// URL in a comma-separated list.
func redactURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		parts[i] = redactURL(p)
	}
	return strings.Join(parts, ",")
}

func redactURL(raw string) string {
	s := strings.TrimSpace(raw)
	if !strings.Contains(s, "@") {
		return raw
	}
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		if !strings.Contains(s, "://") {
			if u, err = url.Parse("nats://" + s); err == nil && u.User != nil {
				return strings.TrimPrefix(redactUserinfo(u), "nats://")
			}
		}
		// Not a URL that can be taken apart: hide what is before the @.
		_, host, _ := strings.Cut(s, "@")
		return redacted + "@" + host
	}
	return redactUserinfo(u)
}

// redactUserinfo keeps a user name that has a password beside it and hides
// the password; a lone user part may be a token and is hidden.
func redactUserinfo(u *url.URL) string {
	user := redacted
	if _, ok := u.User.Password(); ok {
		user = url.User(u.User.Username()).String() + ":" + redacted
	}
	bare := *u
	bare.User = nil
	return u.Scheme + "://" + user + "@" + strings.TrimPrefix(bare.String(), u.Scheme+"://")
}
