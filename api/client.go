package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/workermon/workermon/events"
	"github.com/workermon/workermon/internal/redact"
	"github.com/workermon/workermon/monitor"
	"github.com/workermon/workermon/overrides"
)

// maxReply bounds a reply the Client reads.
const maxReply = 64 << 20

// StatusError is the answer of the API with a status other than 200: its
// code and the message of its {"error"} body.
type StatusError struct {
	StatusCode int
	Message    string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("monitor answered %d %s: %s", e.StatusCode, http.StatusText(e.StatusCode), e.Message)
}

// Client calls the monitor's API. Safe for concurrent use.
type Client struct {
	base  *url.URL
	token string
	hc    *http.Client
}

// NewClient returns a client of the API at baseURL (http or https, e.g.
// http://127.0.0.1:8090). token, if not empty, is sent as the bearer token
// with sets and deletes. hc nil means http.DefaultClient.
func NewClient(baseURL, token string, hc *http.Client) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("api: monitor URL %q: want http://host:port or https://host:port", redact.URL(baseURL))
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawQuery, u.Fragment = "", ""
	if hc == nil {
		hc = http.DefaultClient
	}
	return &Client{base: u, token: token, hc: hc}, nil
}

// Thresholds returns every known model's thresholds (GET /busy_threshold).
func (c *Client) Thresholds(ctx context.Context) ([]ModelThresholds, error) {
	var reply ThresholdsReply
	err := c.do(ctx, http.MethodGet, "/busy_threshold", nil, nil, false, &reply)
	return reply.Thresholds, err
}

// ThresholdsOf returns one model's thresholds (POST /busy_threshold with
// only the model).
func (c *Client) ThresholdsOf(ctx context.Context, model string) (ModelThresholds, error) {
	var reply ModelThresholds
	err := c.do(ctx, http.MethodPost, "/busy_threshold", nil, map[string]string{fieldModel: model}, false, &reply)
	return reply, err
}

// SetThresholds sets the thresholds patch sets in a model's override and
// returns the model's thresholds now.
func (c *Client) SetThresholds(ctx context.Context, model string, patch events.Thresholds) (ModelThresholds, error) {
	var reply ModelThresholds
	err := c.do(ctx, http.MethodPost, "/busy_threshold", nil, ModelThresholds{Model: model, Thresholds: patch}, true, &reply)
	return reply, err
}

// DeleteThresholds drops a model's override and returns its thresholds now
// (the defaults).
func (c *Client) DeleteThresholds(ctx context.Context, model string) (ModelThresholds, error) {
	var reply ModelThresholds
	err := c.do(ctx, http.MethodDelete, "/busy_threshold", url.Values{fieldModel: {model}}, nil, true, &reply)
	return reply, err
}

// Records returns the busy sets of model, or of every model when empty.
func (c *Client) Records(ctx context.Context, model string) ([]Record, error) {
	var reply RecordsReply
	err := c.do(ctx, http.MethodGet, "/busy", modelQuery(model), nil, false, &reply)
	return reply.Records, err
}

// Partitions returns the monitor's view of the partitions and their
// holders (GET /partitions).
func (c *Client) Partitions(ctx context.Context) (PartitionsReply, error) {
	var reply PartitionsReply
	err := c.do(ctx, http.MethodGet, "/partitions", nil, nil, false, &reply)
	return reply, err
}

// Workers returns the workers of model, or of every model when empty.
func (c *Client) Workers(ctx context.Context, model string) ([]monitor.WorkerRow, error) {
	var reply WorkersReply
	err := c.do(ctx, http.MethodGet, "/workers", modelQuery(model), nil, false, &reply)
	return reply.Workers, err
}

// Loads returns the rank loads of model, or of every model when empty.
func (c *Client) Loads(ctx context.Context, model string) ([]monitor.LoadRow, error) {
	var reply LoadsReply
	err := c.do(ctx, http.MethodGet, "/loads", modelQuery(model), nil, false, &reply)
	return reply.Loads, err
}

func modelQuery(model string) url.Values {
	if model == "" {
		return nil
	}
	return url.Values{fieldModel: {model}}
}

// do sends a request and decodes a 200 reply into out; any other status is
// a *StatusError.
func (c *Client) do(ctx context.Context, method, path string, query url.Values, in any, auth bool, out any) error {
	u := *c.base
	u.Path += path
	u.RawQuery = query.Encode()
	var body io.Reader
	if in != nil {
		data, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("api: encode request: %w", err)
		}
		body = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), body)
	if err != nil {
		return redact.Error(fmt.Errorf("api: %s %s: %w", method, redact.URL(u.String()), err), u.String())
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	if auth && c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		// net/http's error quotes the URL with a token given as the user.
		return redact.Error(fmt.Errorf("%w at %s: %w", ErrUnreachable, redact.URL(c.base.String()), err), u.String())
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxReply))
	if err != nil {
		return redact.Error(fmt.Errorf("api: %s %s: read reply: %w", method, redact.URL(u.String()), err), u.String())
	}
	if resp.StatusCode != http.StatusOK {
		var e ErrorReply
		if json.Unmarshal(data, &e) != nil || e.Error == "" {
			e.Error = strings.TrimSpace(string(data[:min(len(data), 512)]))
		}
		return &StatusError{StatusCode: resp.StatusCode, Message: e.Error}
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("api: %s %s: decode reply: %w", method, redact.URL(u.String()), err)
	}
	return nil
}

// Cordon cordons a worker (POST /cordon) and returns the stored cordon.
func (c *Client) Cordon(ctx context.Context, model string, worker uint64) (overrides.Cordon, error) {
	var reply overrides.Cordon
	err := c.do(ctx, http.MethodPost, "/cordon", nil, map[string]any{fieldModel: model, fieldWorkerID: worker}, true, &reply)
	return reply, err
}

// Uncordon lifts a worker's cordon (POST /uncordon).
func (c *Client) Uncordon(ctx context.Context, model string, worker uint64) (UncordonReply, error) {
	var reply UncordonReply
	err := c.do(ctx, http.MethodPost, "/uncordon", nil, map[string]any{fieldModel: model, fieldWorkerID: worker}, true, &reply)
	return reply, err
}

// Cordons lists every cordon (GET /cordons).
func (c *Client) Cordons(ctx context.Context) ([]overrides.Cordon, error) {
	var reply []overrides.Cordon
	err := c.do(ctx, http.MethodGet, "/cordons", nil, nil, false, &reply)
	return reply, err
}
