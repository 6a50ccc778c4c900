package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/workermon/workermon/internal/redact"
)

// Defaults of `workermon healthcheck`.
const (
	// DefaultHealthcheckURL is the monitor's liveness endpoint on its
	// default address.
	DefaultHealthcheckURL = "http://127.0.0.1:8090/healthz"
	// DefaultHealthcheckTimeout bounds the whole check: connect, request and
	// reading the answer.
	DefaultHealthcheckTimeout = 2 * time.Second
	// healthcheckBodyLimit is how much of the answer is read and shown.
	healthcheckBodyLimit = 512
)

// healthcheckOptions is everything `workermon healthcheck` can be told.
type healthcheckOptions struct {
	url     string
	timeout time.Duration
}

func (o *healthcheckOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.url, "url", o.url, "http:// or https:// URL to GET; any 2xx answer is healthy")
	fs.DurationVar(&o.timeout, "timeout", o.timeout, "give up after this long")
}

func (o healthcheckOptions) validate() error {
	var errs []error
	u, err := redact.Parse(o.url) // url.Parse's error would quote the password
	switch {
	case err != nil:
		errs = append(errs, fmt.Errorf("%w: --url: %v", errUsage, err))
	case u.Scheme != "http" && u.Scheme != "https", u.Host == "":
		errs = append(errs, fmt.Errorf("%w: --url %q: want http://host[:port]/path", errUsage, redact.URL(o.url)))
	}
	if o.timeout <= 0 {
		errs = append(errs, fmt.Errorf("%w: --timeout %v must be positive", errUsage, o.timeout))
	}
	return errors.Join(errs...)
}

// runHealthcheck GETs a URL and fails unless the answer is 2xx. It exists
// for container HEALTHCHECKs: the images are FROM scratch, with no shell,
// curl or wget, so the binary checks itself (and the NATS image's server).
func runHealthcheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o := healthcheckOptions{url: DefaultHealthcheckURL, timeout: DefaultHealthcheckTimeout}
	fs := flag.NewFlagSet("healthcheck", flag.ContinueOnError)
	o.flags(fs)
	check := newCheck(fs, "healthcheck")
	if err := parseFlags(fs, args, stderr, nil); err != nil {
		return err
	}
	if err := o.validate(); err != nil || check.on {
		return check.report(stdout, err, nil)
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, o.url, nil)
	if err != nil {
		return fmt.Errorf("healthcheck: %w", redact.Error(err, o.url))
	}
	// A fresh transport: no proxy from the environment, no kept connection.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("healthcheck: GET %s: %w", redact.URL(o.url), redact.Error(err, o.url))
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, healthcheckBodyLimit))
	text := strings.TrimSpace(string(body))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("healthcheck: GET %s: %s: %s", redact.URL(o.url), resp.Status, text)
	}
	fmt.Fprintf(stdout, "%s: %s %s\n", redact.URL(o.url), resp.Status, text)
	return nil
}
