package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/workermon/workermon/internal/natstest"
)

// TestPartitionsUnmappedInHealthz: with partitions, a report that arrives on
// a plain subject (a NATS server without the partition mapping) is shown in
// /healthz (contract §10), which still answers 200.
func TestPartitionsUnmappedInHealthz(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, natstest.Options(t)) // no mapping
	svc := testService(t, func(o *serveOptions) { o.natsURL, o.partitions = srv.ClientURL(), 2 })
	health := func() string {
		t.Helper()
		resp, err := http.Get("http://" + svc.httpAddr + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("/healthz = %d %s", resp.StatusCode, body)
		}
		return string(body)
	}
	if body := health(); !strings.Contains(body, "\nunmapped_reports 0\n") || strings.Contains(body, "warning") {
		t.Fatalf("/healthz before any unmapped report:\n%s", body)
	}
	nc, _ := connect(t, srv.ClientURL())
	publishReport(t, nc, "org/unmapped", 1, 10, 100)
	natstest.WaitFor(t, 5*time.Second, "the unmapped report shown in /healthz", func() bool {
		body := health()
		return strings.Contains(body, "\nunmapped_reports 1\n") && strings.Contains(body, "nats-config --partitions 2")
	})
}

// TestPartitionsOnePartitionHealthz: with one partition nothing is mapped,
// and /healthz has no unmapped count.
func TestPartitionsOnePartitionHealthz(t *testing.T) {
	t.Parallel()
	svc := testService(t, nil)
	resp, err := http.Get("http://" + svc.httpAddr + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(string(body), "ok\n") || strings.Contains(string(body), "unmapped") {
		t.Errorf("/healthz = %d\n%s", resp.StatusCode, body)
	}
}

// TestPartitionsStatusOnStandby: `workermon status` against a standby says
// it holds no partition (rather than that no worker reported), and lists
// the holder.
func TestPartitionsStatusOnStandby(t *testing.T) {
	t.Parallel()
	holder := testService(t, func(o *serveOptions) { o.writer.MonitorID = "mon-holder" })
	standby := testService(t, func(o *serveOptions) { o.natsURL, o.writer.MonitorID = holder.natsURL, "mon-standby" })
	if held := standby.leaser.Held(); len(held) != 0 {
		t.Fatalf("the second monitor holds %v; want a standby", held)
	}
	for _, args := range [][]string{nil, {"--model", "org/some-model"}} {
		code, out, errOut := runCLI(t, append([]string{"status", "--monitor-url=http://" + standby.httpAddr}, args...)...)
		if code != 0 || !strings.Contains(out, "monitor mon-standby holds no partition") ||
			strings.Contains(out, "no worker has reported") || !strings.Contains(out, "mon-holder") {
			t.Errorf("status %v on the standby: exit %d\n%s%s", args, code, out, errOut)
		}
	}
	code, out, errOut := runCLI(t, "status", "--monitor-url=http://"+holder.httpAddr)
	if code != 0 || !strings.Contains(out, "no worker has reported") {
		t.Errorf("status on the holder without workers: exit %d\n%s%s", code, out, errOut)
	}
}
