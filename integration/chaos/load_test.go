package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

type fakeDowns struct{ router, engine bool }

func (f fakeDowns) RouterDown(string, time.Time, time.Time) bool { return f.router }
func (f fakeDowns) EngineDown(time.Time, time.Time) bool         { return f.engine }

func TestLoadClassifiesAnswers(t *testing.T) {
	answer := ""
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch answer {
		case "ok":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n")
		case "error-event":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"error\":{\"message\":\"cut\",\"type\":\"upstream_error\",\"param\":null,\"code\":502}}\n\ndata: [DONE]\n\n")
		case "truncated":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
		case "503":
			w.WriteHeader(http.StatusServiceUnavailable)
		case "429":
			w.WriteHeader(http.StatusTooManyRequests)
		case "502":
			w.WriteHeader(http.StatusBadGateway)
		}
	}))
	defer srv.Close()
	refused := httptest.NewServer(http.NotFoundHandler())
	refused.Close()
	for _, c := range []struct {
		answer string
		url    string
		downs  fakeDowns
		want   Outcome
	}{
		{"ok", srv.URL, fakeDowns{}, OutOK},
		{"503", srv.URL, fakeDowns{}, OutBusy},
		{"429", srv.URL, fakeDowns{}, OutShed},
		{"502", srv.URL, fakeDowns{}, OutViolation},
		{"error-event", srv.URL, fakeDowns{engine: true}, OutCut},
		{"error-event", srv.URL, fakeDowns{}, OutViolation},
		{"truncated", srv.URL, fakeDowns{}, OutViolation},
		{"truncated", srv.URL, fakeDowns{router: true}, OutRouterDown},
		{"", refused.URL, fakeDowns{router: true}, OutRouterDown},
		{"", refused.URL, fakeDowns{engine: true}, OutViolation},
	} {
		answer = c.answer
		l := &Load{Routers: map[string]string{"r": c.url}, Timeout: 5 * time.Second, Down: c.downs, client: http.DefaultClient}
		if got, what := l.one(context.Background(), "r", "m", 0, 1, 1); got != c.want {
			t.Errorf("%s from %s, downs %+v: %s (%s), want %s", c.answer, c.url, c.downs, got, what, c.want)
		}
	}
}
