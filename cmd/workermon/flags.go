package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/workermon/workermon/internal/redact"
)

// errUsage marks errors in the command line or environment.
var errUsage = errors.New("usage")

// subcommand splits args into one of three subcommands and the rest. With
// no subcommand or an unknown one it prints usage to stderr and returns an
// errUsage error; with -h or help it prints usage and returns flag.ErrHelp.
func subcommand(args []string, usage string, stderr io.Writer, subs [3]string) (string, []string, error) {
	want := subs[0] + ", " + subs[1] + " or " + subs[2]
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return "", nil, fmt.Errorf("%w: missing subcommand: %s", errUsage, want)
	}
	sub, rest := args[0], args[1:]
	switch sub {
	case "-h", "--help", "-help", "help":
		fmt.Fprint(stderr, usage)
		return "", nil, flag.ErrHelp
	case subs[0], subs[1], subs[2]:
		return sub, rest, nil
	}
	fmt.Fprint(stderr, usage)
	return "", nil, fmt.Errorf("%w: unknown subcommand %q: want %s", errUsage, sub, want)
}

// envPrefix prefixes the environment variable of every flag:
// --stale-after is WORKERMON_STALE_AFTER.
const envPrefix = "WORKERMON_"

// envName returns the environment variable that sets flag name.
func envName(name string) string {
	return envPrefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// parseFlags parses args, then sets every flag not given on the command line
// from its environment variable, if present. aliases maps extra variables
// (like NATS_URL) to flag names; the WORKERMON_ variable wins over an alias.
func parseFlags(fs *flag.FlagSet, args []string, stderr io.Writer, aliases map[string]string) error {
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: workermon %s [flags]\n\nEvery flag can also be set by the environment variable %s<FLAG>\n(upper case, '-' as '_'), e.g. --stale-after as %s.\n\n",
			fs.Name(), envPrefix, envName("stale-after"))
		fs.PrintDefaults()
	}
	if err := parseArgs(fs, args); err != nil {
		return err
	}
	var names []string
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name != checkFlag {
			names = append(names, f.Name)
		}
	})
	return flagsFromEnv(fs, names, aliases)
}

// parseArgs parses args, which must all be flags.
func parseArgs(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	return nil
}

// flagsFromEnv sets each flag of names that fs has and the command line did
// not give from its environment variable (envName), then the flags aliases
// name from their variables; the WORKERMON_ variable wins over an alias.
func flagsFromEnv(fs *flag.FlagSet, names []string, aliases map[string]string) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	set := func(env, name string) {
		v, ok := os.LookupEnv(env)
		if !ok || given[name] || fs.Lookup(name) == nil {
			return
		}
		if err := fs.Set(name, v); err != nil {
			// The value, and Set's error that may quote it, through redact.
			errs = append(errs, fmt.Errorf("%w: %s=%q: %v", errUsage, env, redact.Value(name, v), redact.Error(err, v)))
			return
		}
		given[name] = true
	}
	for _, name := range names {
		set(envName(name), name)
	}
	for env, name := range aliases {
		set(env, name)
	}
	return errors.Join(errs...)
}

// optFloat is a float flag that may be left unset.
type optFloat struct{ p **float64 }

func (o optFloat) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return strconv.FormatFloat(**o.p, 'g', -1, 64)
}

func (o optFloat) Set(s string) error {
	if s == "" {
		*o.p = nil
		return nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return fmt.Errorf("%q is not a finite number", s)
	}
	*o.p = &v
	return nil
}

// optUint is an unsigned integer flag that may be left unset.
type optUint struct{ p **uint64 }

func (o optUint) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return strconv.FormatUint(**o.p, 10)
}

func (o optUint) Set(s string) error {
	if s == "" {
		*o.p = nil
		return nil
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return fmt.Errorf("%q is not a non-negative integer", s)
	}
	*o.p = &v
	return nil
}

// uint32Value is a flag of type uint32.
type uint32Value struct{ p *uint32 }

func (v uint32Value) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.FormatUint(uint64(*v.p), 10)
}

func (v uint32Value) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return fmt.Errorf("%q is not a number from 0 to %d", s, uint32(math.MaxUint32))
	}
	*v.p = uint32(n)
	return nil
}

// setDuration is a duration flag that remembers whether it was set.
type setDuration struct {
	p   *time.Duration
	set *bool
}

func (v setDuration) String() string {
	if v.p == nil {
		return ""
	}
	return v.p.String()
}

func (v setDuration) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration", s)
	}
	*v.p, *v.set = d, true
	return nil
}
