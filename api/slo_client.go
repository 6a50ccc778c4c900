package api

import (
	"context"
	"net/http"
)

// SLORequest is the body of POST /slo; nil targets are left out of the SLO.
type SLORequest struct {
	Model      string   `json:"model"`
	TTFTms     *float64 `json:"ttft_ms,omitempty"`
	ITLms      *float64 `json:"itl_ms,omitempty"`
	Percentile *float64 `json:"percentile,omitempty"`
	Mode       string   `json:"mode,omitempty"`
}

// SLOs returns every SLO with its controller's state (GET /slo).
func (c *Client) SLOs(ctx context.Context) ([]SLOReply, error) {
	var r SLOsReply
	err := c.do(ctx, http.MethodGet, "/slo", nil, nil, false, &r)
	return r.SLOs, err
}

// SLO returns one model's SLO (GET /slo?model=); a StatusError with 404
// when it has none.
func (c *Client) SLO(ctx context.Context, model string) (SLOReply, error) {
	var r SLOReply
	err := c.do(ctx, http.MethodGet, "/slo", modelQuery(model), nil, false, &r)
	return r, err
}

// SetSLO replaces a model's SLO (POST /slo).
func (c *Client) SetSLO(ctx context.Context, req SLORequest) (SLOReply, error) {
	var r SLOReply
	err := c.do(ctx, http.MethodPost, "/slo", nil, req, true, &r)
	return r, err
}

// DeleteSLO drops a model's SLO (DELETE /slo?model=).
func (c *Client) DeleteSLO(ctx context.Context, model string) (SLOReply, error) {
	var r SLOReply
	err := c.do(ctx, http.MethodDelete, "/slo", modelQuery(model), nil, true, &r)
	return r, err
}
