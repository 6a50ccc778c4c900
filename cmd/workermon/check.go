package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/workermon/workermon/internal/redact"
)

// checkFlag is the flag every command has (contract §19): parse and
// validate the flags and the environment as a start would, print the
// configuration as one JSON object and exit 0, or exit 2 with the reason.
// It connects nowhere, binds no port, starts no embedded server and creates
// no directory. It is never read from the environment: a WORKERMON_CHECK
// left in a pod's environment would make every start a check.
const checkFlag = "check"

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
			v = redact.Value(f.Name, t)
		}
		out[f.Name] = v
	})
	return out
}
