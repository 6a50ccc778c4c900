package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/workermon/workermon/api"
	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/watch"
)

// Defaults of the operator commands (`thresholds`, `status`).
const (
	// DefaultMonitorURL is where the operator commands find the monitor's API.
	DefaultMonitorURL = "http://" + DefaultMonitorHTTPAddr
	// DefaultClientTimeout bounds one request of an operator command.
	DefaultClientTimeout = 10 * time.Second
)

// clientOptions are the flags of every command that talks to the API.
type clientOptions struct {
	monitorURL string
	adminToken string
	timeout    time.Duration
	json       bool
}

func defaultClientOptions() clientOptions {
	return clientOptions{monitorURL: DefaultMonitorURL, timeout: DefaultClientTimeout}
}

// clientEnv are the only flags of an operator command read from the
// environment. The threshold flags of `thresholds set` are not: they share
// their names, hence their variables, with the defaults of `serve`.
var clientEnv = []string{"monitor-url", "admin-token"}

func (o *clientOptions) flags(fs *flag.FlagSet, withToken bool) {
	fs.StringVar(&o.monitorURL, "monitor-url", o.monitorURL, "base URL of the monitor's API (env "+envName("monitor-url")+")")
	if withToken {
		fs.StringVar(&o.adminToken, "admin-token", o.adminToken, "bearer token for changes, if the monitor requires one (env "+envName("admin-token")+")")
	}
	fs.DurationVar(&o.timeout, "timeout", o.timeout, "give up on the monitor after this long")
	fs.BoolVar(&o.json, "json", o.json, "print the API's JSON reply instead of a table")
}

// client returns an API client for the options.
func (o clientOptions) client() (*api.Client, error) {
	if o.timeout <= 0 {
		return nil, fmt.Errorf("%w: --timeout %v must be positive", errUsage, o.timeout)
	}
	c, err := api.NewClient(o.monitorURL, o.adminToken, &http.Client{Timeout: o.timeout})
	if err != nil {
		return nil, fmt.Errorf("%w: --monitor-url: %v", errUsage, err)
	}
	return c, nil
}

// parseClientFlags parses the flags of an operator command and --check; of
// the environment it reads only the variables of clientEnv.
func parseClientFlags(fs *flag.FlagSet, args []string, stderr io.Writer, synopsis string) (*checkRequest, error) {
	check := newCheck(fs, fs.Name())
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: workermon %s\n\n", synopsis)
		fs.PrintDefaults()
	}
	if err := parseArgs(fs, args); err != nil {
		return nil, err
	}
	return check, flagsFromEnv(fs, clientEnv, nil)
}

// apiError adds a hint to an error of the API client.
func apiError(err error) error {
	if errors.Is(err, api.ErrUnreachable) {
		return fmt.Errorf("%w (is `workermon serve` running there? set --monitor-url or %s)", err, envName("monitor-url"))
	}
	return err
}

const thresholdsUsage = `Usage: workermon thresholds <get|set|unset> [flags]

  get   [--model NAME]         the thresholds of every known model, or of one
  set   --model NAME [--active-decode-blocks-threshold F]
                     [--active-prefill-tokens-threshold N]
                     [--active-prefill-tokens-threshold-frac F]
                     [--kv-committed-threshold F] [--queue-delay-threshold-ms N]
                               set thresholds of a model's override (the others keep their values)
  unset --model NAME           drop the model's override: back to the monitor's defaults

Run 'workermon thresholds <get|set|unset> -h' for the flags.
`

// runThresholds is `workermon thresholds get|set|unset`.
func runThresholds(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	sub, args, err := subcommand(args, thresholdsUsage, stderr, [3]string{"get", "set", "unset"})
	if err != nil {
		return err
	}

	o := defaultClientOptions()
	var model string
	var patch events.Thresholds
	fs := flag.NewFlagSet("thresholds "+sub, flag.ContinueOnError)
	o.flags(fs, sub != "get")
	fs.StringVar(&model, "model", "", "model name, as the engines report it")
	synopsis := "thresholds " + sub + " [flags]"
	if sub == "set" {
		fs.Var(optFloat{&patch.ActiveDecodeBlocks}, "active-decode-blocks-threshold",
			"KV-cache threshold in [0, 1]: busy when active_decode_blocks > threshold × kv_total_blocks")
		fs.Var(optUint{&patch.ActivePrefillTokens}, "active-prefill-tokens-threshold",
			"prefill threshold in tokens: busy when active_prefill_tokens > threshold")
		fs.Var(optFloat{&patch.ActivePrefillTokensFrac}, "active-prefill-tokens-threshold-frac",
			"prefill threshold as a fraction ≥ 0 of max_num_batched_tokens")
		fs.Var(optFloat{&patch.KVCommitted}, "kv-committed-threshold",
			"committed-KV threshold in [0, 4]: busy when kv_committed_blocks > threshold × kv_total_blocks")
		fs.Var(optUint{&patch.QueueDelayMs}, "queue-delay-threshold-ms",
			"queue-delay threshold in ms: busy when the predicted queue delay > threshold")
	}
	check, err := parseClientFlags(fs, args, stderr, synopsis)
	if err != nil {
		return err
	}
	if model == "" && sub != "get" {
		return fmt.Errorf("%w: --model is required", errUsage)
	}
	if model != "" {
		if err := events.ValidateModel(model); err != nil {
			return fmt.Errorf("%w: --model: %v", errUsage, err)
		}
	}
	if sub == "set" && patch.IsZero() {
		return fmt.Errorf("%w: give at least one of --active-decode-blocks-threshold, --active-prefill-tokens-threshold, "+
			"--active-prefill-tokens-threshold-frac, --kv-committed-threshold, --queue-delay-threshold-ms", errUsage)
	}
	c, err := o.client()
	if err != nil || check.on {
		return check.report(stdout, err, nil)
	}

	var rows []api.ModelThresholds
	var reply any
	switch {
	case sub == "get" && model == "":
		rows, err = c.Thresholds(ctx)
		reply = api.ThresholdsReply{Thresholds: rows}
	default:
		var one api.ModelThresholds
		switch sub {
		case "get":
			one, err = c.ThresholdsOf(ctx, model)
		case "set":
			one, err = c.SetThresholds(ctx, model, patch)
		case "unset":
			one, err = c.DeleteThresholds(ctx, model)
		}
		rows, reply = []api.ModelThresholds{one}, one
	}
	if err != nil {
		return apiError(err)
	}
	if o.json {
		return printJSON(stdout, reply)
	}
	if len(rows) == 0 {
		fmt.Fprintln(stdout, "no known models: no worker has reported to this monitor and no override is stored")
		return nil
	}
	return printThresholds(stdout, rows)
}

// printThresholds writes the thresholds as a table; an unset check is "off".
func printThresholds(w io.Writer, rows []api.ModelThresholds) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tDECODE_BLOCKS\tPREFILL_TOKENS\tPREFILL_FRAC\tKV_COMMITTED\tQUEUE_DELAY_MS")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", watch.QuoteModel(r.Model), fmtFloat(r.ActiveDecodeBlocks), fmtUint(r.ActivePrefillTokens),
			fmtFloat(r.ActivePrefillTokensFrac), fmtFloat(r.KVCommitted), fmtUint(r.QueueDelayMs))
	}
	return tw.Flush()
}

func fmtFloat(p *float64) string {
	if p == nil {
		return "off"
	}
	return strconv.FormatFloat(*p, 'g', -1, 64)
}

func fmtUint(p *uint64) string {
	if p == nil {
		return "off"
	}
	return strconv.FormatUint(*p, 10)
}

// printJSON writes v indented.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}
