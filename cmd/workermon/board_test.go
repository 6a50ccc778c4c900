package main

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/board"
	"github.com/workermon/workermon/internal/natstest"
)

// TestBoardMounted: the monitor and the router serve the board at /, its
// stream and its history; other paths keep their own 404s; a monitor's Close ends an
// open stream instead of waiting for it.
func TestBoardMounted(t *testing.T) {
	t.Parallel()
	svc := testService(t, nil)
	rt := routerTestStart(t, svc.natsURL, nil)
	for _, tc := range []struct {
		base, path string
		status     int
		want       string
	}{
		{svc.httpAddr, "/", 200, `<script src="board/board.js"`},
		{svc.httpAddr, "/board/snapshot", 200, `"kind":"monitor"`},
		{svc.httpAddr, "/nothing", 404, `"error":"no such endpoint /nothing`},
		{svc.httpAddr, "/busy", 200, `"records"`},
		{rt.httpAddr, "/", 200, `<script src="board/board.js"`},
		{rt.httpAddr, "/board/snapshot", 200, `"kind":"router"`},
		{svc.httpAddr, "/board/history", 200, `"points":[`},
		{rt.httpAddr, "/board/history", 200, `"points":[`},
		{rt.httpAddr, "/nothing", 404, `"type":"not_found_error"`},
	} {
		code, body := routerTestGet(t, "http://"+tc.base+tc.path)
		if code != tc.status || !strings.Contains(body, tc.want) {
			t.Errorf("GET %s%s: %d %.200q, want %d with %q", tc.base, tc.path, code, body, tc.status, tc.want)
		}
	}

	// A stream open while the monitor shuts down ends with it.
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+svc.httpAddr+"/board/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	var snap board.Snapshot
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatalf("reading the stream: %v", err)
		}
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			if err := json.Unmarshal([]byte(data), &snap); err != nil {
				t.Fatal(err)
			}
			break
		}
	}
	if snap.Kind != board.KindMonitor || snap.Name == "" {
		t.Fatalf("first snapshot %+v", snap)
	}
	natstest.WaitFor(t, 5*time.Second, "one viewer counted", func() bool {
		return metricValue(t, svc.reg, "workermon_board_clients", "", "") == 1
	})
	cctx, ccancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer ccancel()
	if err := svc.Close(cctx); err != nil {
		t.Fatalf("close with a viewer: %v", err)
	}
	for {
		if _, err := rd.ReadString('\n'); err != nil {
			break // the stream ended
		}
	}
}
